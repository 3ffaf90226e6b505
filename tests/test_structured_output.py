"""Structured output: SmolLM2's constrained outputs parse and validate for a range of JSON schemas, in one
continuous batch with free requests (whose tokens the constrained neighbours must not change) and adapters."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from pydantic import BaseModel, constr

from engine import LLM, SamplingParams
from engine.grammar import SAFE_INTEGER, bounded_numbers
from engine.sampling import ResponseFormat
from lora_cache.local_cache import local_adapters
from tests.helpers import PROMPTS

pytestmark = pytest.mark.slow


class Person(BaseModel):  # the course's bonus lesson
    name: constr(max_length=10)
    age: int


class Output(BaseModel):  # the course's NER schema
    person: list[str]
    organization: list[str]
    location: list[str]
    miscellaneous: list[str]


def _obj(properties: dict, required=None, **extra) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            **extra}


SHORT = {"type": "string", "maxLength": 16}
NER_PROMPT = ("Your task is a Named Entity Recognition (NER) task. Predict the category of each entity, then place "
              "the entity into the list associated with the category in an output JSON payload. Below is an "
              'example:\n\nInput: EU rejects German call to boycott British lamb . Output: {"person": [], '
              '"organization": ["EU"], "location": [], "miscellaneous": ["German", "British"]}\n\nNow, complete '
              "the task.\n\nInput: Only France and Britain backed Fischler 's proposal . Output:")
RAW = "raw: "  # a prompt sent as is, as the course sends its NER prompt; the others go through the chat template
CASES = {  # name: (prompt, schema)
    "person (course)": ("Create a person description for me", Person.model_json_schema()),
    "NER output (course)": (RAW + NER_PROMPT, Output.model_json_schema()),
    "nested objects": ("Give a user with an address as JSON.", _obj({
        "user": _obj({"name": SHORT, "address": _obj({"city": SHORT, "zip": {"type": "string",
                                                                              "pattern": "^[0-9]{5}$"}})})})),
    "array of objects": ("List two films with their year.", _obj({"films": {
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": _obj({"title": SHORT, "year": {"type": "integer", "minimum": 1900, "maximum": 2030}})}})),
    "enums": ("Pick a T-shirt.", _obj({"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L"]}},
                                       additionalProperties=False)),
    "bounded numbers": ("Report today's weather.", _obj({
        "temperature": {"type": "number", "minimum": -50, "maximum": 60},
        "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
        "pressure": {"type": "number", "exclusiveMinimum": 0}})),
    "optional fields": ("Describe a book.", _obj({"title": SHORT, "author": SHORT, "pages": {"type": "integer"}},
                                                  required=["title"])),
    "booleans and null": ("Is the task done?", _obj({"done": {"type": "boolean"},
                                                      "note": {"type": ["string", "null"], "maxLength": 20}})),
    "bounded integer array": ("List some prime numbers.", _obj({"primes": {
        "type": "array", "items": {"type": "integer", "minimum": 2}, "minItems": 3, "maxItems": 5}})),
    "anyOf": ("What is six times seven?", _obj({"answer": {"anyOf": [{"type": "integer"},
                                                                      {"type": "string", "maxLength": 12}]}})),
    "top-level array": ("Name three colours.", {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 4}),
    "any JSON object": ("Return a JSON object describing a cat.", {"type": "object"}),
}
BUDGET = 160  # tokens: enough for every schema above


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(str(smollm2_path), dtype="float32", log_stats=False, kv_cache_bytes=128 << 20)


def _chat(llm, text: str) -> str:
    if text.startswith(RAW):
        return text[len(RAW):]
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)


def test_constrained_outputs_parse_and_validate_in_one_batch_with_free_requests(llm):
    free_prompts = PROMPTS[:4]
    free = SamplingParams(max_tokens=24, temperature=0)
    alone = llm.generate(free_prompts, free, use_tqdm=False)

    constrained = [SamplingParams(max_tokens=BUDGET, temperature=0, response_format=ResponseFormat(schema))
                   for _, schema in CASES.values()]
    prompts = [_chat(llm, prompt) for prompt, _ in CASES.values()]
    outputs = llm.generate(prompts + free_prompts, constrained + [free] * len(free_prompts), use_tqdm=False)

    for name, (_, schema), out in zip(CASES, CASES.values(), outputs):
        assert out.finish_reason in ("eos", "stop"), (name, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    for expected, got in zip(alone, outputs[len(CASES):]):
        assert got.token_ids == expected.token_ids  # the masks touch only their own rows


def test_sampled_and_adapter_requests_stay_valid(smollm2_path, tmp_path):
    from transformers import AutoConfig

    from benchmarks.lora_adapters import write_random_adapter

    write_random_adapter(tmp_path / "ada", AutoConfig.from_pretrained(smollm2_path), rank=8, seed=3)
    llm = LLM(str(smollm2_path), dtype="bfloat16", adapters=local_adapters, max_loras=2, adapters_root=str(tmp_path),
              log_stats=False, kv_cache_bytes=128 << 20)
    _, schema = CASES["array of objects"]
    params = [SamplingParams(max_tokens=BUDGET, temperature=0.8, top_p=0.9, seed=seed,
                             response_format=ResponseFormat(schema)) for seed in range(3)]
    prompt = _chat(llm, CASES["array of objects"][0])
    outputs = llm.generate([prompt] * 3, params, use_tqdm=False, adapters=["ada", None, "ada"])
    for out in outputs:
        assert out.finish_reason in ("eos", "stop"), out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_running_out_of_tokens_ends_with_length_and_a_prefix(llm):
    _, schema = CASES["NER output (course)"]
    out = llm.generate([NER_PROMPT], SamplingParams(max_tokens=5, temperature=0,
                                                    response_format=ResponseFormat(schema)), use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.text.startswith('{"person"')
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


@pytest.mark.parametrize("schema, words", [
    ({"type": "objekt"}, "invalid JSON schema"),
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": 5, "maxLength": 2}}, "required": ["a"]},
     "cannot be used: Unsatisfiable schema"),
    ({"$ref": "#/$defs/missing"}, "cannot be used: .*missing"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "cannot be used: .*not"),
    ({"type": "object", "required": "a"}, "invalid JSON schema"),
])
def test_invalid_schemas_are_refused_with_the_reason(llm, schema, words):
    with pytest.raises(ValueError, match=words):
        llm.generate(["hi"], SamplingParams(max_tokens=4, response_format=ResponseFormat(schema)), use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_a_schema_compiles_once(llm):
    compiler = llm.engine.grammars
    before = len(compiler._compiled)
    schema = {"type": "object", "properties": {"k": {"enum": ["v"]}}, "required": ["k"]}
    for _ in range(3):
        out = llm.generate(["x"], SamplingParams(max_tokens=12, temperature=0, response_format=ResponseFormat(schema)),
                           use_tqdm=False)[0]
        assert json.loads(out.text) == {"k": "v"}
    assert len(compiler._compiled) == before + 1


ARITHMETIC = 'start: NUMBER " " OP " " NUMBER\nOP: "+" | "-" | "*"\nNUMBER: /[0-9]{1,3}/'
ANSWER = 'start: ("Yes" | "No") ", because " REASON "."\nREASON: /[a-z ]{1,40}/'
YES_NO = 'start: "yes" | "no"'  # as a grammar: yes or no; as a regex: 'start: "yes" ' or ' "no"'
WEEKDAY = "(Mon|Tues|Wednes|Thurs|Fri|Satur|Sun)day"
PUNCTUATED = ["a|b", "(c)", "ü.*", "new\nline"]  # regex syntax in a choice is literal text
OTHER_KINDS = {  # name: (prompt, response format, a Python regex the whole output matches)
    "regex (phone number)": ("Give me a phone number.", ResponseFormat(regex="[0-9]{3}-[0-9]{4}"), "[0-9]{3}-[0-9]{4}"),
    "regex (weekday)": ("What day comes after Monday?", ResponseFormat(regex=WEEKDAY), WEEKDAY),
    "regex (a grammar's text)": ("Say something.", ResponseFormat(regex=YES_NO), YES_NO),
    "choice": ("Is 'I love this film' positive or negative?",
               ResponseFormat(choice=["positive", "negative", "neutral"]), "positive|negative|neutral"),
    "choice (punctuation)": ("Pick one.", ResponseFormat(choice=PUNCTUATED), "|".join(map(re.escape, PUNCTUATED))),
    "grammar (arithmetic)": ("Write a sum of two numbers.", ResponseFormat(grammar=ARITHMETIC),
                             "[0-9]{1,3} [+*-] [0-9]{1,3}"),
    "grammar (yes/no sentence)": ("Is the sky blue?", ResponseFormat(grammar=ANSWER),
                                  r"(Yes|No), because [a-z ]{1,40}\."),
    "grammar (yes or no)": ("Say something.", ResponseFormat(grammar=YES_NO), "yes|no"),
}


def test_regex_choice_and_grammar_outputs_match_in_one_batch_with_free_requests(llm):
    free_prompts = PROMPTS[:2]
    free = SamplingParams(max_tokens=16, temperature=0)
    alone = llm.generate(free_prompts, free, use_tqdm=False)

    constrained = [SamplingParams(max_tokens=60, temperature=0, response_format=fmt)
                   for _, fmt, _ in OTHER_KINDS.values()]
    prompts = [_chat(llm, prompt) for prompt, _, _ in OTHER_KINDS.values()]
    outputs = llm.generate(prompts + free_prompts, constrained + [free] * len(free_prompts), use_tqdm=False)

    for name, (_, _, pattern), out in zip(OTHER_KINDS, OTHER_KINDS.values(), outputs):
        assert out.finish_reason in ("eos", "stop"), (name, out.text)
        assert re.fullmatch(pattern, out.text), (name, out.text)
    for expected, got in zip(alone, outputs[len(OTHER_KINDS):]):
        assert got.token_ids == expected.token_ids


def _nested(levels: int) -> dict:
    """`levels` object schemas inside each other, each 2 levels of nesting (itself, its properties); the innermost
    property's schema is true (any value), no dict."""
    schema = True
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("make, words", [
    (lambda: ResponseFormat(_nested(17)), "nested more than 32 levels deep"),
    (lambda: ResponseFormat({"type": "object", "description": "x" * 70_000}), "70034 bytes .*: at most 65536"),
    (lambda: ResponseFormat(choice=[str(i) for i in range(300)]), "300 strings: at most 256"),
    (lambda: ResponseFormat(choice=["x" * 2000]), "2000 characters: at most 1024"),
    (lambda: ResponseFormat(choice=[]), "non-empty list of non-empty strings"),
    (lambda: ResponseFormat(choice="yes"), "non-empty list of non-empty strings"),
    (lambda: ResponseFormat(regex="x" * 70_000), "70000 characters: at most 65536"),
    (lambda: ResponseFormat(regex="a", choice=["a"]), "one of schema, regex, choice, grammar; got regex and choice"),
    (lambda: ResponseFormat({"type": "object"}, grammar=YES_NO), "got schema and grammar"),
    (lambda: ResponseFormat(regex="(abc"), "(?s)invalid regex: .*unclosed group"),
    (lambda: ResponseFormat(grammar="start: foo"), 'invalid grammar: .*unknown name: "foo"'),
], ids=["schema too deep", "schema too big", "too many choices", "choice too long", "no choices", "choice not a list",
        "regex too long", "regex and choice", "schema and grammar", "bad regex", "bad grammar"])
def test_invalid_response_formats_are_refused_with_the_reason_and_limit(llm, make, words):
    with pytest.raises(ValueError, match=words):
        llm.generate(["hi"], SamplingParams(max_tokens=4, response_format=make()), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert ResponseFormat(_nested(16)).kind == "schema"  # 32 levels: the limit itself is allowed


def test_unbounded_numbers_stay_within_javascripts_safe_integers(llm):
    """Unbounded, SmolLM2 answers with a 1 and zeros until its 80 tokens run out, in "n" for the first schema and
    in "x" for the second (measured); bounded, both end within 30 tokens at 10**15."""
    schemas = [_obj({"n": {"type": "integer"}}), _obj({"n": {"type": "integer"}, "x": {"type": "number"}})]
    prompt = _chat(llm, "How many atoms are in the observable universe? Give the exact number with every digit.")
    params = [SamplingParams(max_tokens=80, temperature=0, response_format=ResponseFormat(s)) for s in schemas]
    for schema, out in zip(schemas, llm.generate([prompt] * 2, params, use_tqdm=False)):
        assert out.finish_reason == "eos", out.text
        value = json.loads(out.text)
        jsonschema.validate(value, schema)
        assert all(abs(number) <= SAFE_INTEGER for number in value.values()), out.text


def test_bounds_fill_only_the_open_sides_of_numbers_and_leave_values_alone():
    big = 10**20
    schema = {"type": "object", "properties": {
        "type": {"type": ["integer", "null"], "minimum": 0},  # a property named "type" is a name, not a keyword
        "below": {"type": "number", "exclusiveMaximum": 5},
        "both": {"type": "integer", "minimum": 1, "maximum": 9},
        "above": {"type": "integer", "minimum": big},  # past the bound: the top stays open
        "picked": {"type": "integer", "enum": [big]},
        "fixed": {"type": "number", "const": big},
        "valued": {"type": "integer", "default": big, "examples": [{"type": "integer"}]},
        "negated": {"not": {"type": "integer"}},  # bounding inside not would admit more
        "listed": {"type": "array", "items": {"$ref": "#/$defs/count"}},
        "text": {"type": "string"}},
        "$defs": {"count": {"type": "integer"}}}
    before = json.dumps(schema)
    bounded = bounded_numbers(schema)
    props = bounded["properties"]
    assert json.dumps(schema) == before  # the schema itself is left as it was
    assert props["type"] == {"type": ["integer", "null"], "minimum": 0, "maximum": SAFE_INTEGER}
    assert props["below"] == {"type": "number", "exclusiveMaximum": 5, "minimum": -SAFE_INTEGER}
    assert bounded["$defs"]["count"] == {"type": "integer", "minimum": -SAFE_INTEGER, "maximum": SAFE_INTEGER}
    assert props["valued"] == {"type": "integer", "default": big, "examples": [{"type": "integer"}],
                               "minimum": -SAFE_INTEGER, "maximum": SAFE_INTEGER}
    for name in ("both", "above", "picked", "fixed", "negated", "listed", "text"):
        assert props[name] == schema["properties"][name], name
