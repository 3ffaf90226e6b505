"""Sampler behaviour: seeds, top-k/top-p, repetition penalty, stops, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.sampler import Sampler, inverse_cdf
from engine.sampler_ops import HostSamplerOps
from engine.sampling import SEED_MAX, SEED_MIN
from engine.sampling_filters import filter_logits
from tests.helpers import PROMPTS, hf_generate, hf_greedy


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    return LLM(str(tiny_llama_path), log_stats=False, kv_cache_bytes=32 << 20)


def _sampled(seed=None, **kw):
    return SamplingParams(max_tokens=20, temperature=1.0, seed=seed, ignore_eos=True, **kw)


def test_same_seed_same_text_alone_and_in_busy_batch(llm):
    alone = llm.generate([PROMPTS[0]], _sampled(seed=1234), use_tqdm=False)[0]
    busy_prompts = PROMPTS[1:9] + [PROMPTS[0]] + PROMPTS[9:]
    busy_params = [_sampled() for _ in busy_prompts]
    busy_params[8] = _sampled(seed=1234)
    busy = llm.generate(busy_prompts, busy_params, use_tqdm=False)
    assert busy[8].token_ids == alone.token_ids
    other_seed = llm.generate([PROMPTS[0]], _sampled(seed=99), use_tqdm=False)[0]
    assert other_seed.token_ids != alone.token_ids


def test_the_widest_seeds_sample_and_repeat(llm):
    """A seed at either end of the 64-bit range draws (a wider one is refused when the request is made): the
    generator is seeded inside the step, where an overflow would end the engine loop for every request."""
    for seed in (SEED_MIN, SEED_MAX):
        first, again = (llm.generate([PROMPTS[0]], _sampled(seed=seed), use_tqdm=False)[0] for _ in range(2))
        assert first.token_ids == again.token_ids and len(first.token_ids) == 20


def test_a_vanishing_temperature_is_greedy(llm):
    """As in vLLM: the logits divided by 5e-324 leave float32's range and every probability would be NaN."""
    greedy = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                          use_tqdm=False)[0]
    for temperature in (5e-324, 1e-30, 1e-6):
        tiny = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=8, temperature=temperature, ignore_eos=True),
                            use_tqdm=False)[0]
        assert tiny.token_ids == greedy.token_ids, temperature


def test_unseeded_sampling_varies(llm):
    outs = llm.generate([PROMPTS[1]] * 4, _sampled(), use_tqdm=False)
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_top_k_one_and_tiny_top_p_are_greedy(llm):
    greedy = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                          use_tqdm=False)
    top_k = llm.generate(PROMPTS[:3], _sampled(top_k=1), use_tqdm=False)
    top_p = llm.generate(PROMPTS[:3], _sampled(top_p=1e-6), use_tqdm=False)
    for g, k, p in zip(greedy, top_k, top_p):
        assert k.token_ids[:12] == g.token_ids
        assert p.token_ids[:12] == g.token_ids


def test_sampled_tokens_stay_inside_top_k(llm, tiny_llama_path):
    out = llm.generate([PROMPTS[2]], _sampled(seed=7, top_k=3, logprobs=3), use_tqdm=False)[0]
    for token, alternatives in zip(out.token_ids, out.top_logprobs):
        assert token in alternatives


def test_min_p_samples_only_tokens_near_the_most_likely(llm):
    """At temperature 1 every token drawn with min_p is at least min_p times as likely as the step's most likely
    token (its logprob against the top alternative's); the random model's near-flat rows leave a few such tokens, so
    without min_p the same draws fall below that floor."""
    def gaps(**kw) -> list[float]:
        outs = llm.generate(PROMPTS[:4], _sampled(seed=3, logprobs=1, **kw), use_tqdm=False)
        return [lp - max(top.values()) for out in outs for lp, top in zip(out.logprobs, out.top_logprobs)]

    floor = math.log(0.8)
    assert min(gaps(min_p=0.8)) >= floor - 1e-4
    assert min(gaps()) < floor


def test_repetition_penalty_matches_hf(tiny_llama_path):
    reference = hf_greedy(tiny_llama_path, PROMPTS[:4], 16, repetition_penalty=1.5)
    llm = LLM(str(tiny_llama_path), log_stats=False)
    outs = llm.generate(PROMPTS[:4], SamplingParams(max_tokens=16, temperature=0, repetition_penalty=1.5),
                        use_tqdm=False)
    assert [o.token_ids for o in outs] == reference


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm, tokenizer):
    ids = tokenizer(PROMPTS[1]).input_ids
    cut = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=8, temperature=0, truncate_prompt_tokens=5),
                       use_tqdm=False)[0]
    tail = llm.generate([ids[-5:]], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0]
    assert (cut.prompt_token_ids, cut.token_ids) == (ids[-5:], tail.token_ids)
    assert len(ids) > 5  # the cut did act
    # a prompt past the context is served once cut to fit
    long = llm.generate([[5] * 600], SamplingParams(max_tokens=4, truncate_prompt_tokens=100), use_tqdm=False)[0]
    assert len(long.prompt_token_ids) == 100 and len(long.token_ids) == 4


class OutputPenalties:
    """Reference OpenAI presence/frequency penalties for transformers' generate, over the generated tokens only."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for token in set(input_ids[0, self.prompt_len:].tolist()):
            count = int((input_ids[0, self.prompt_len:] == token).sum())
            scores[0, token] -= self.frequency * count + self.presence
        return scores


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return LLM(str(smollm2_path), dtype="float32", log_stats=False, kv_cache_bytes=128 << 20)


PENALISED_PROMPTS = ["The list of colours: red, green,", "1, 2, 3, 4,", "Repeat after me: hello hello hello"]


@pytest.fixture(scope="module")
def plain_reference(smollm2_path):
    return hf_greedy(smollm2_path, PENALISED_PROMPTS, 20)


@pytest.mark.parametrize("presence, frequency", [(1.5, 0.0), (-0.5, 1.2)])
def test_presence_and_frequency_penalties_match_a_reference(smollm2, smollm2_path, tokenizer, plain_reference,
                                                            presence, frequency):
    # The real model repeats tokens (" the", ",") where a random one does not: the penalties change its text.
    from transformers import LogitsProcessorList

    prompts = PENALISED_PROMPTS
    penalised = SamplingParams(max_tokens=20, temperature=0, presence_penalty=presence, frequency_penalty=frequency)
    plain = SamplingParams(max_tokens=20, temperature=0)
    outs = smollm2.generate(prompts + prompts, [penalised] * 3 + [plain] * 3, use_tqdm=False)  # mixed in a batch
    for prompt, out in zip(prompts, outs):
        processor = OutputPenalties(len(tokenizer(prompt).input_ids), presence, frequency)
        (reference,) = hf_greedy(smollm2_path, [prompt], 20, logits_processor=LogitsProcessorList([processor]))
        assert out.token_ids == reference
    assert [o.token_ids for o in outs[3:]] == plain_reference
    assert any(p.token_ids != q.token_ids for p, q in zip(outs[:3], outs[3:]))  # the penalties did act


def _flat_and_peaked_rows(vocab: int) -> torch.Tensor:
    """Rows from nearly flat to peaked, one with half its tokens already masked (by a structured-output mask, say)."""
    torch.manual_seed(0)
    logits = torch.randn(6, vocab) * torch.tensor([0.3, 1.0, 2.0, 4.0, 1.0, 8.0])[:, None]
    logits[4, : vocab // 2] = float("-inf")
    return logits


def _kept(logits: torch.Tensor, **per_row: list) -> torch.Tensor:
    params = [SamplingParams(temperature=1.0, **{name: values[row] for name, values in per_row.items()})
              for row in range(logits.shape[0])]
    return filter_logits(logits, params).isfinite()


@pytest.mark.parametrize("vocab", [300, 5000])  # 5,000: more tokens than the filters' candidates
def test_filters_keep_what_transformers_warpers_keep(vocab):
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
        TypicalLogitsWarper,
    )

    logits = _flat_and_peaked_rows(vocab)
    ks, ps, typical = [1, 5, 40, 0, 2000, 3], [0.2, 0.5, 0.9, 0.95, 0.7, 1.0], [0.95, 0.2, 1.0, 0.5, 0.9, 0.7]
    min_ps = [0.05, 0.0, 0.3, 0.01, 1.0, 0.5]
    filters = (("top_k", ks, TopKLogitsWarper, 0), ("top_p", ps, TopPLogitsWarper, 1.0),
               ("min_p", min_ps, MinPLogitsWarper, 0.0),
               ("typical_p", typical, TypicalLogitsWarper, 1.0))  # each with the value that turns it off
    for name, values, warper, off in filters:
        kept = _kept(logits, **{name: values})
        for row, value in enumerate(values):
            want = logits[row:row + 1] if value == off else warper(value)(None, logits[row:row + 1].clone())
            assert torch.equal(kept[row], want.isfinite()[0]), (name, row)
    together = _kept(logits, top_k=ks, top_p=ps, min_p=min_ps, typical_p=typical)  # transformers' order
    for row in range(len(ks)):
        scores = logits[row:row + 1].clone()
        for _, values, warper, off in filters:
            scores = scores if values[row] == off else warper(values[row])(None, scores)
        assert torch.equal(together[row], scores.isfinite()[0]), row
    assert 1 <= _kept(logits, typical_p=[0.2] * 6)[0].sum() < _kept(logits, typical_p=[0.9] * 6)[0].sum() < vocab


def _row(vocab: int, heavy: int, share: float) -> torch.Tensor:
    """Logits of a row whose `heavy` tokens, at random places, hold `share` of the mass in equal parts."""
    probs = torch.full((vocab,), (1 - share) / (vocab - heavy))
    probs[torch.randperm(vocab)[:heavy]] = share / heavy
    return probs.log()


def test_filters_rank_each_row_only_as_far_as_its_mass_needs():
    from engine.sampling_filters import TIERS, rank_in_tiers

    torch.manual_seed(0)
    vocab = 20_000
    keys = torch.stack([_row(vocab, 500, 0.99), torch.zeros(vocab), _row(vocab, 2000, 0.95), _row(vocab, 900, 0.97)])

    def widths(batch: torch.Tensor) -> tuple[dict[int, int], torch.Tensor]:
        """How far each row of the batch was ranked, and the rows' results (their width) as returned."""
        seen = {}

        def cut(rows, values, order):
            assert torch.equal(values, batch[rows].gather(1, order)) and bool((values[:, :-1] >= values[:, 1:]).all())
            seen.update(dict.fromkeys(torch.arange(len(batch))[rows].tolist(), order.shape[1]))
            return torch.full_like(batch[rows], float(order.shape[1]))

        out = rank_in_tiers(batch, batch.softmax(dim=-1), torch.full((len(batch), 1), 0.9), cut)
        return seen, out[:, 0]

    seen, out = widths(keys)
    assert seen == {0: TIERS[0], 1: vocab, 2: TIERS[1], 3: TIERS[0]}  # peaked, flat (a full sort), in between
    assert out.tolist() == [seen[row] for row in range(4)]  # each row's result back in its place
    assert widths(keys[[0, 3]])[0] == {0: TIERS[0], 1: TIERS[0]}  # a batch all in the first tier


def test_ranking_in_tiers_and_sorting_whole_rows_keep_the_same_tokens():
    """The GPU's one sort (rank_whole) and the CPU's tiers cut every row alike, in top-p and typical-p (rows without
    ties, whose order among equals either may break its own way): rows peaked enough for the first tier, for the
    second, and flat enough for a full sort."""
    from engine.sampling_filters import rank_in_tiers, rank_whole

    torch.manual_seed(1)
    logits = torch.randn(4, 20_000) * torch.tensor([[12.0], [3.0], [2.0], [0.5]])
    for params in (SamplingParams(top_p=0.9), SamplingParams(typical_p=0.8), SamplingParams(top_p=0.5, typical_p=0.9)):
        tiers = filter_logits(logits, [params] * 4, rank_in_tiers)
        assert torch.equal(filter_logits(logits, [params] * 4, rank_whole), tiers)
        assert (tiers.isinf().sum(dim=-1) > 0).any()


def test_draws_follow_the_probabilities_and_never_take_an_impossible_token():
    from engine.sequence import Sequence

    sampler = Sampler(torch.device("cpu"), seed=0, ops=HostSamplerOps())
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0]).repeat(20_000, 1)
    seqs = [Sequence(str(i), [1], _sampled()) for i in range(20_000)]
    counts = torch.bincount(sampler._draw(probs, seqs), minlength=5).tolist()
    assert counts[1] == counts[4] == 0
    for count, p in zip(counts, (0.5, 0.0, 0.3, 0.2, 0.0)):
        assert abs(count - 20_000 * p) < 5 * math.sqrt(20_000 * p * (1 - p)) + 1, counts
    last_only = torch.tensor([[0.0, 0.0, 1.0, 0.0]]).repeat(100, 1)
    assert set(sampler._draw(last_only, seqs[:100]).tolist()) == {2}
    cumulative = torch.tensor([[0.0, 0.5, 0.5, 1.0, 1.0]], dtype=torch.float64).repeat(4, 1)
    targets = torch.tensor([[0.0], [0.5], [0.7], [1.0]], dtype=torch.float64)  # the last: u * total rounded up
    assert inverse_cdf(cumulative, targets).tolist() == [1, 3, 3, 3]


def test_tiny_typical_p_follows_transformers_token_for_token(smollm2, smollm2_path):
    """With a tiny mass only the most typical token is left, so both sides are deterministic; it is not the
    greedy token (the test would otherwise not tell typical-p from greedy). The real model: a random one's
    near-uniform rows put thousands of tokens within rounding of the entropy, so which is most typical is noise."""
    params = SamplingParams(max_tokens=12, temperature=1.0, typical_p=1e-6)
    typical = smollm2.generate(PENALISED_PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in typical] == hf_generate(smollm2_path, PENALISED_PROMPTS, 12, do_sample=True,
                                                          typical_p=1e-6, top_k=0)
    greedy = smollm2.generate(PENALISED_PROMPTS, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    assert any(t.token_ids != g.token_ids for t, g in zip(typical, greedy))


def test_logit_bias_forces_and_forbids_tokens(llm):
    plain = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    forced = plain[0].token_ids[3]
    params = [SamplingParams(max_tokens=6, temperature=0, logit_bias={forced: 100}),
              SamplingParams(max_tokens=6, temperature=0, logit_bias={plain[1].token_ids[0]: -100})]
    biased = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert biased[0].token_ids == [forced] * 6
    assert biased[1].token_ids[0] != plain[1].token_ids[0]
    sampled = llm.generate(PROMPTS[:1], _sampled(seed=3, logit_bias={forced: 100}), use_tqdm=False)[0]
    assert set(sampled.token_ids) == {forced}
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, logit_bias={10**7: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids token ids outside the vocabulary"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, allowed_token_ids=[3, 10**7]), use_tqdm=False)


def test_min_tokens_bans_eos_and_stop_tokens_until_reached(llm):
    plain = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0]
    stop = plain.token_ids[1]
    cut = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop]),
                       use_tqdm=False)[0]
    assert (len(cut.token_ids), cut.finish_reason) == (2, "stop")
    held = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop], min_tokens=5),
                        use_tqdm=False)[0]
    assert len(held.token_ids) >= 5 and stop not in held.token_ids[:5]
    assert held.token_ids[0] == plain.token_ids[0]  # only the banned choice changes


def test_logprobs_match_model_distribution(llm, tiny_llama_path, tokenizer):
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1, temperature=0, logprobs=5), use_tqdm=False)[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
    ids = tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    with torch.inference_mode():
        expected = model(ids).logits[0, -1].log_softmax(-1)
    token = out.token_ids[0]
    assert math.isclose(out.logprobs[0], expected[token].item(), abs_tol=1e-4)
    top_ids = expected.topk(5).indices.tolist()
    assert list(out.top_logprobs[0]) == top_ids


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 16, "enable_prefix_caching": True}],
                         ids=["one step", "chunked, prefix caching on"])
def test_prompt_logprobs_match_the_model(tiny_llama_path, tokenizer, options):
    llm = LLM(str(tiny_llama_path), log_stats=False, **options)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    llm.generate([PROMPTS[1] * 2], SamplingParams(max_tokens=1), use_tqdm=False)  # with caching: its blocks stay
    prompts = [PROMPTS[1] * 2, PROMPTS[1] * 2, PROMPTS[7]]
    params = [SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2),
              SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0), SamplingParams(max_tokens=2)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, p in zip(outs[:2], params):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.inference_mode():
            want = model(ids).logits[0].log_softmax(-1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == ids.shape[1]
        got = torch.tensor(out.prompt_logprobs[1:])
        torch.testing.assert_close(got, want[:-1].gather(1, ids[0, 1:, None]).squeeze(1), atol=1e-4, rtol=1e-4)
        assert out.prompt_ranks[0] is None
        for rank, scores, target in zip(out.prompt_ranks[1:], want[:-1], ids[0, 1:]):
            # the rank is its count of tokens scoring at least the target's: within the count's range over
            # scores 1e-4 apart (the engine's and transformers' logits differ by that much)
            above, tied = (scores > scores[target] + 1e-4).sum(), (scores >= scores[target] - 1e-4).sum()
            assert int(above) + 1 <= rank <= int(tied)
        if p.prompt_logprobs:
            top = want[:-1].topk(2, dim=-1).indices.tolist()
            assert [list(t) for t in out.prompt_top_logprobs[1:]] == top
        else:
            assert out.prompt_top_logprobs[1:] == [None] * (ids.shape[1] - 1)
    assert outs[2].prompt_logprobs == []  # not asked for
    assert outs[0].token_ids == outs[1].token_ids


def test_prompt_logprobs_come_with_the_first_token_and_when_finished(tiny_llama_path):
    """A stream can show the prompt's scores before the answer (echo does): the engine hands them out with the
    first token, then again with the finished output (all an unstreamed caller reads), and not in between, even when
    the prompt is prefilled over several steps."""
    engine = LLM(str(tiny_llama_path), log_stats=False, max_num_batched_tokens=16).engine
    engine.add_request("scored", PROMPTS[1] * 2, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                                prompt_logprobs=1))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    with_tokens = [out for out in outs if out.new_token_ids]
    assert len(with_tokens) == 4 and with_tokens[-1].finished
    first, last = with_tokens[0], with_tokens[-1]
    assert len(first.prompt_logprobs) == len(first.prompt_token_ids) > 16  # prefilled in chunks, scored whole
    assert (first.prompt_logprobs, first.prompt_top_logprobs, first.prompt_ranks) == (
        last.prompt_logprobs, last.prompt_top_logprobs, last.prompt_ranks)
    assert all(out.prompt_logprobs == [] for out in outs if out not in (first, last))


def test_max_tokens_eos_and_ignore_eos(llm, tokenizer):
    eos = tokenizer.eos_token_id
    out = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    first = out.token_ids[0]
    stopped = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=5, temperature=0, stop_token_ids=[first]),
                           use_tqdm=False)[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    assert eos in llm.engine.eos_token_ids


def test_stop_string_cuts_text(llm):
    full = llm.generate([PROMPTS[4]], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0]
    stop = full.text[5:9]
    assert stop.strip(), "need a non-blank stop string from the generated text"
    cut = llm.generate([PROMPTS[4]], SamplingParams(max_tokens=20, temperature=0, stop=[stop], ignore_eos=True),
                       use_tqdm=False)[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[:full.text.index(stop)]
    kept = llm.generate([PROMPTS[4]], SamplingParams(max_tokens=20, temperature=0, stop=[stop], ignore_eos=True,
                                                     include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.finish_reason == "stop" and kept.token_ids == cut.token_ids
    assert kept.text == full.text[:full.text.index(stop) + len(stop)]


def test_allowed_token_ids_follow_transformers_constrained_generate(llm, tiny_llama_path):
    """Greedy within an allowed set equals transformers' generate with the same set (prefix_allowed_tokens_fn)."""
    allowed = list(range(1000, 1064))
    prompts = PROMPTS[:3]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                allowed_token_ids=allowed), use_tqdm=False)
    want = hf_greedy(tiny_llama_path, prompts, 12, prefix_allowed_tokens_fn=lambda batch, ids: allowed)
    assert [o.token_ids for o in outs] == want
    assert all(set(o.token_ids) <= set(allowed) for o in outs)


def _spells(ids: list[int], word: tuple[int, ...]) -> bool:
    return any(tuple(ids[i:i + len(word)]) == word for i in range(len(ids) - len(word) + 1))


def test_bad_words_are_never_spelled(llm):
    """A word the unconstrained output spells (one token, and two) is not spelled once banned, and the output
    is the unconstrained one up to where it would have been."""
    params = dict(max_tokens=24, temperature=0, ignore_eos=True)
    full = llm.generate([PROMPTS[5]], SamplingParams(**params), use_tqdm=False)[0]
    tokenizer = llm.engine.tokenizer
    for width in (1, 2):
        at = next(i for i in range(4, len(full.token_ids)) if tokenizer.decode(full.token_ids[i:i + width]).strip())
        word = tokenizer.decode(full.token_ids[at:at + width])
        banned = llm.generate([PROMPTS[5]], SamplingParams(bad_words=[word], **params), use_tqdm=False)[0]
        spellings = {tuple(tokenizer(f"{prefix}{word.strip()}", add_special_tokens=False).input_ids)
                     for prefix in ("", " ")}
        assert any(_spells(full.token_ids, spelled) for spelled in spellings), (word, spellings)
        assert not any(_spells(banned.token_ids, spelled) for spelled in spellings), (word, banned.token_ids)
        first = min(i for spelled in spellings for i in range(len(full.token_ids))
                    if tuple(full.token_ids[i:i + len(spelled)]) == spelled)
        assert banned.token_ids[:first] == full.token_ids[:first]


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-2),
                                 dict(repetition_penalty=0), dict(stop=[""]), dict(logprobs=50),
                                 dict(presence_penalty=2.5), dict(frequency_penalty=-3),
                                 dict(logit_bias={5: 101}), dict(logit_bias={-1: 1.0}),
                                 dict(allowed_token_ids=[]), dict(allowed_token_ids=[-3]), dict(bad_words=[" "]),
                                 dict(min_tokens=20, max_tokens=10), dict(min_tokens=-1), dict(typical_p=0),
                                 dict(typical_p=1.5), dict(truncate_prompt_tokens=0), dict(min_p=-0.1),
                                 dict(min_p=1.5), dict(seed=2**63), dict(seed=-2**63 - 1), dict(seed=1.5),
                                 dict(repetition_penalty=1e-300), dict(repetition_penalty=1e300)])
def test_invalid_params_are_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_bad_prompts_are_rejected(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[10 ** 9]], SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match="limit"):
        llm.generate([[5] * 600], SamplingParams(), use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_step_outputs_carry_only_the_new_tokens_and_the_final_one_all(llm):
    """Streaming costs O(new tokens) per step: each step's output holds its own token and logprobs; the
    whole lists arrive once, in the finished output, and equal the steps' pieces joined."""
    engine = llm.engine
    engine.add_request("stream", PROMPTS[3], SamplingParams(max_tokens=6, temperature=0, logprobs=2,
                                                            ignore_eos=True))
    steps = []
    while engine.has_unfinished():
        steps += engine.step()
    final = steps[-1]
    assert final.finished and all(not out.finished and out.token_ids == [] for out in steps[:-1])
    assert final.token_ids == [t for out in steps for t in out.new_token_ids]
    assert final.logprobs == [lp for out in steps for lp in out.new_logprobs]
    assert final.top_logprobs == [top for out in steps for top in out.new_top_logprobs]
    assert len(final.token_ids) == 6 and all(len(top) == 2 for top in final.top_logprobs)


def test_penalty_tallies_grow_step_by_step_to_what_a_rebuild_gives():
    from engine.penalty_tokens import PenaltyTokens

    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 50, (30,), generator=generator).tolist()
    outputs = torch.randint(0, 60, (40,), generator=generator).tolist()
    stepwise = PenaltyTokens.of_prompt(prompt, torch.device("cpu"))
    for n in range(1, len(outputs) + 1):  # one new token per step, as the engine appends them
        stepwise.absorb(outputs[:n])
    rebuilt = PenaltyTokens.of_prompt(prompt, torch.device("cpu"))
    rebuilt.absorb(outputs)
    assert sorted(stepwise.seen_ids.tolist()) == sorted(set(prompt + outputs))
    row = torch.randn(64, generator=generator)
    rows = [row.clone() for _ in range(2)]
    for tallies, r in zip((stepwise, rebuilt), rows):
        tallies.penalise_repetition(r, 1.3)
        tallies.penalise_output(r, 0.5, 0.25)
    torch.testing.assert_close(rows[0], rows[1])
    counted = row.clone()
    for token in outputs:
        counted[token] -= 0.25
    for token in set(outputs):
        counted[token] -= 0.5
    expected = row.clone()
    seen = sorted(set(prompt + outputs))
    expected[seen] = torch.where(row[seen] < 0, row[seen] * 1.3, row[seen] / 1.3)
    expected -= row - counted  # the output penalties, after the repetition penalty
    torch.testing.assert_close(rows[0], expected)


@pytest.mark.parametrize("with_ops", [True, False])
def test_plain_greedy_steps_take_the_argmax_of_bf16_logits_as_they_are(with_ops):
    """A step whose rows are all plain greedy reads a bf16 model's logits as the LM head wrote them (no float32
    copy), rows asking logprobs included: their logprobs and top alternatives are float32 log_softmax's. A row with
    a processor (logit_bias) widens the step. Either way the tokens are float32's argmax."""
    from engine.kernels import cpu_ops
    from engine.sampler_ops import CppSamplerOps
    from engine.sequence import Sequence

    ops = cpu_ops.load()
    sampler = Sampler(torch.device("cpu"), seed=0, ops=CppSamplerOps(ops) if with_ops and ops else HostSamplerOps())
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(0)).bfloat16()
    logits[3, 10] = logits[3, 900] = 9.0  # a tie: the first wins
    want = logits.float().argmax(-1).tolist()
    plain = [Sequence(str(i), [1], SamplingParams(max_tokens=4, temperature=0)) for i in range(8)]
    out = sampler(logits, plain)
    assert out.token_ids == want and out.logprobs == [None] * 8 and sampler.ops.buffer is None
    asking = plain[:6] + [Sequence(str(i), [1], SamplingParams(max_tokens=4, temperature=0, logprobs=k))
                          for i, k in ((6, 0), (7, 2))]
    out = sampler(logits, asking)
    expected = logits.float().log_softmax(-1)
    assert out.token_ids == want and out.logprobs[:6] == [None] * 6 and sampler.ops.buffer is None
    assert out.logprobs[6:] == pytest.approx([expected[6, want[6]].item(), expected[7, want[7]].item()], abs=1e-5)
    values, ids = expected[7].topk(2)
    assert out.top_logprobs[6] is None and list(out.top_logprobs[7]) == ids.tolist()
    assert list(out.top_logprobs[7].values()) == pytest.approx(values.tolist(), abs=1e-5)
    biased = plain[:7] + [Sequence("7", [1], SamplingParams(max_tokens=4, temperature=0, logit_bias={5: 0.5}))]
    out = sampler(logits, biased)
    assert out.token_ids[:7] == want[:7] and sampler.ops.buffer is not None
