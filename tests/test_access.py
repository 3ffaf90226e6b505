"""Who may call, how much, and what a request may ask: API keys and their scopes, per-key limits, request limits.

Unit tests of the key ring and token buckets, then a real Ray Serve app with keys (from the app args and from a
file of hashed keys), spoken to over HTTP with requests and the openai client.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import requests

from deployments.gate import rate_limits
from deployments.gate.auth import ApiKeyConfig, KeyLimits, KeyRing, Unauthorized, hash_key, load_key_file
from deployments.gate.quota_ledger import LocalLedger, TokenBucket
from deployments.gate.rate_limits import KeyLimiter, RateLimited
from engine import LLM, SamplingParams
from engine.errors import EngineOverloadedError, TokenBudget, TokenBudgetError
from tests.helpers import serving, write_tiny_adapters

ADMIN, TEAM_A, SLOW, FRUGAL, SINGLE = ("admin-key-0123456789abcdef", "team-a-key-0123456789abcdef",
                                       "slow-key-0123456789abcdef", "frugal-key-0123456789abcdef",
                                       "single-key-0123456789abcdef")
METRICS = {}


# ---- units: keys and buckets ----

def test_a_key_ring_finds_the_key_presented_and_refuses_others():
    ring = KeyRing([ApiKeyConfig(name="a", key_sha256=hash_key("a" * 20).hex()).to_key(),
                    ApiKeyConfig(name="b", key_sha256=hash_key("b" * 20).hex(), adapters=["b-*"]).to_key()])
    assert ring.authenticate("Bearer " + "a" * 20).name == "a"
    assert ring.authenticate("bearer " + "b" * 20).scope.allows_adapter("b-1")
    assert not ring.authenticate("Bearer " + "b" * 20).scope.allows_adapter("a-1")
    for header in (None, "", "Basic xyz", "Bearer " + "c" * 20):
        with pytest.raises(Unauthorized):
            ring.authenticate(header)
    assert "a" * 20 not in repr(ring.keys)  # a key's text is not kept, its hash is not shown
    assert KeyRing([]).authenticate(None).name == "anonymous"  # no keys: open


def test_bad_key_configs_are_refused_with_the_reason(tmp_path):
    with pytest.raises(ValueError, match="unique"):
        KeyRing([_hashed("a", "a" * 20), _hashed("a", "b" * 20)])
    with pytest.raises(ValueError, match="exactly one"):
        ApiKeyConfig(name="a")
    with pytest.raises(ValueError, match="min_priority"):
        ApiKeyConfig(name="a", key_sha256=hash_key("a" * 20).hex(), min_priority=2 ** 40)
    clear = tmp_path / "keys.yaml"
    clear.write_text(json.dumps([{"name": "a", "key": "a" * 20}]))
    with pytest.raises(ValueError, match="in clear"):
        load_key_file(clear)
    clear.write_text(json.dumps({"name": "a"}))
    with pytest.raises(ValueError, match="a list of key entries"):
        load_key_file(clear)


def _hashed(name: str, secret: str):
    return ApiKeyConfig(name=name, key_sha256=hash_key(secret).hex()).to_key()


def test_a_key_is_read_from_its_environment_variable_or_file_and_kept_as_its_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("LORA_SERVE_TEST_KEY", ADMIN)
    (tmp_path / "team-a.key").write_text(TEAM_A + "\n")  # as a mounted secret ends: the newline is not the key's
    ring = KeyRing([ApiKeyConfig(name="env", key_env="LORA_SERVE_TEST_KEY").to_key(),
                    ApiKeyConfig(name="file", key_file=str(tmp_path / "team-a.key")).to_key()])
    assert ring.authenticate(f"Bearer {ADMIN}").name == "env" and ring.authenticate(f"Bearer {TEAM_A}").name == "file"
    assert ADMIN not in repr(ring.keys) and TEAM_A not in repr(ring.keys)
    for entry, words in [({"key_env": "LORA_SERVE_UNSET"}, "environment variable LORA_SERVE_UNSET is not set"),
                         ({"key_file": str(tmp_path / "absent")}, "is not set"),
                         ({"key_env": "LORA_SERVE_SHORT"}, "shorter than 16 characters"),
                         ({"key_env": "NOT-A-NAME"}, "key_env"),
                         ({"key_env": "LORA_SERVE_TEST_KEY", "key_sha256": hash_key(ADMIN).hex()}, "exactly one")]:
        monkeypatch.setenv("LORA_SERVE_SHORT", "short")
        with pytest.raises(ValueError, match=words):
            ApiKeyConfig(name="k", **entry).to_key()


def test_a_key_in_clear_is_refused_at_build_saying_how_to_write_it_and_not_repeated(tmp_path):
    from deployments.app import build_app

    clear = tmp_path / "keys.yaml"
    clear.write_text(json.dumps([{"name": "a", "key": TEAM_A}]))
    for args in ({"api_keys": [{"name": "ops", "key": ADMIN}]}, {"api_keys_file": str(clear)}):
        with pytest.raises(ValueError) as refused:
            build_app(args)
        message = str(refused.value)
        assert "in clear" in message and "key_sha256" in message and "key_env" in message, message
        assert ADMIN not in message and TEAM_A not in message, message


def _limits(**limits) -> KeyLimits:
    return ApiKeyConfig(name="k", key_sha256=hash_key("k" * 20).hex(), **limits).to_key().limits


def test_token_buckets_refill_with_time_and_carry_debt():
    async def scenario():
        limiter = KeyLimiter("k", _limits(requests_per_minute=600, tokens_per_minute=6000, max_concurrent=2),
                             LocalLedger(), "replica-a")
        await limiter.admit()
        await limiter.admit()
        with pytest.raises(RateLimited, match="max_concurrent 2"):
            await limiter.admit()
        limiter.release()
        limiter.charge(12000)  # a request that cost two minutes' tokens: the next waits about a minute
        with pytest.raises(RateLimited, match="6000 tokens per minute") as refused:
            await limiter.admit()
        assert 55 < refused.value.retry_after_s <= 61

    asyncio.run(scenario())
    bucket = TokenBucket(600)  # 10 per second
    bucket.take(600)
    assert bucket.wait_s(1) == pytest.approx(0.1, abs=0.02)
    time.sleep(0.15)
    assert bucket.wait_s(1) == 0


def test_replicas_sharing_a_ledger_hold_a_keys_limits_together():
    """Two replicas' limiters over one ledger: a key gets its requests per minute, concurrency and tokens once,
    not once per replica."""
    ledger = LocalLedger()

    async def requests_per_minute():
        a, b = (KeyLimiter("k", _limits(requests_per_minute=6), ledger, replica) for replica in ("a", "b"))
        assert [await _admitted(limiter) for limiter in (a, b) * 6] == [True] * 6 + [False] * 6

    asyncio.run(requests_per_minute())

    async def concurrency():
        a, b, c = (KeyLimiter("c", _limits(max_concurrent=2), ledger, r) for r in ("a", "b", "c"))
        assert [await _admitted(x) for x in (a, b, c)] == [True, True, False]
        a.release()
        for _ in range(3):
            await asyncio.sleep(0)
        assert await _admitted(c) and not await _admitted(a)

    asyncio.run(concurrency())

    async def tokens():
        a, b = (KeyLimiter("t", _limits(tokens_per_minute=600), ledger, r) for r in ("a", "b"))
        assert await _admitted(a) and await _admitted(b)
        a.charge(1200)  # two minutes' tokens at replica a: once b has spent its own lease, b waits too
        b.charge(20)
        for _ in range(3):
            await asyncio.sleep(0)
        with pytest.raises(RateLimited, match="600 tokens per minute") as refused:
            await b.admit()
        assert 55 < refused.value.retry_after_s <= 125

    asyncio.run(tokens())


async def _admitted(limiter: KeyLimiter) -> bool:
    try:
        await limiter.admit()
    except RateLimited:
        return False
    return True


def test_a_ledger_that_does_not_answer_gets_503_and_admits_nothing_new(monkeypatch):
    class Silent(LocalLedger):
        async def lease(self, ask):
            await asyncio.Event().wait()

    monkeypatch.setattr(rate_limits, "LEDGER_TIMEOUT_S", 0.1)

    async def scenario():
        limiter = KeyLimiter("k", _limits(requests_per_minute=60), Silent(), "a")
        with pytest.raises(RateLimited, match="could not be checked") as refused:
            await limiter.admit()
        assert refused.value.status == 503 and refused.value.retry_after_s >= 1

    asyncio.run(scenario())


# ---- the engine: max_tokens against the context and the ceiling ----

def test_max_tokens_past_the_context_is_refused_with_the_figures(tiny_llama_path):
    llm = LLM(str(tiny_llama_path), max_model_len=64, max_tokens_limit=40, log_stats=False)
    prompt = list(range(1, 31))  # 30 tokens: 34 left in the context
    with pytest.raises(TokenBudgetError, match="at most 34, got 35") as refused:
        llm.generate([prompt], SamplingParams(max_tokens=35), use_tqdm=False)
    assert refused.value.budget == TokenBudget(asked=35, allowed=34, max_model_len=64, prompt_tokens=30)
    assert refused.value.budget.message("max_new_tokens").endswith("so max_new_tokens may be at most 34, got 35")
    with pytest.raises(ValueError, match="at most 40 .max_tokens_limit"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=41), use_tqdm=False)
    fill = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    outs = llm.generate([prompt, [1, 2]], fill, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [34, 40]  # the context's room, then the ceiling
    assert not llm.engine.has_unfinished()


def test_the_engines_refusals_pickle_with_what_made_them():
    """As across a Ray hop: the same type, message and figures."""
    for error in (TokenBudgetError(TokenBudget(41, 40)), EngineOverloadedError(7, 2.0)):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and str(copy) == str(error)
    assert pickle.loads(pickle.dumps(TokenBudgetError(TokenBudget(41, 40)))).budget == TokenBudget(41, 40)
    assert pickle.loads(pickle.dumps(EngineOverloadedError(7, 2.0))).retry_after_s == 2.0


# ---- over HTTP ----

@pytest.fixture(scope="module")
def server(serve_cluster, tiny_llama_path, tmp_path_factory):
    from deployments.app import build_app

    root = write_tiny_adapters(tiny_llama_path, tmp_path_factory.mktemp("access-adapters"),
                               ("team-a-chat", "team-b-chat"))
    key_file = tmp_path_factory.mktemp("keys") / "keys.yaml"
    key_file.write_text(json.dumps([{"name": "team-a", "key_sha256": hash_key(TEAM_A).hex(),
                                     "adapters": ["team-a-*"], "base_model": False, "min_priority": 0}]))
    METRICS.update(url=serve_cluster.metrics_url, temp=serve_cluster.temp)
    engine = {"model": str(tiny_llama_path), "log_stats": False, "max_loras": 2, "adapters_root": str(root),
              "max_model_len": 512, "max_tokens_limit": 400,
              "adapter_disk_cache": str(tmp_path_factory.mktemp("disk-tier"))}
    secrets = tmp_path_factory.mktemp("secrets")
    (secrets / "slow.key").write_text(SLOW)
    # each way of giving a key: an environment variable, a file, a hash inline, a file of hashes (above)
    keys = [{"name": "admin", "key_env": "LORA_SERVE_ADMIN_KEY", "manage_adapters": True},
            {"name": "slow", "key_file": str(secrets / "slow.key"), "requests_per_minute": 2},
            {"name": "frugal", "key_sha256": hash_key(FRUGAL).hex(), "tokens_per_minute": 40},
            {"name": "single", "key_env": "LORA_SERVE_SINGLE_KEY", "max_concurrent": 1}]
    with pytest.MonkeyPatch.context() as patch:  # read by build_app, in this process: a replica never needs them
        patch.setenv("LORA_SERVE_ADMIN_KEY", ADMIN)
        patch.setenv("LORA_SERVE_SINGLE_KEY", SINGLE)
        app = build_app({"engine": engine, "api_keys": keys, "api_keys_file": str(key_file),
                         "max_request_bytes": 64 * 1024})
    with serving(serve_cluster, app) as url:
        yield url


def _post(server, path, body, key=ADMIN, **kwargs):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.post(f"{server}{path}", json=body, headers=headers, timeout=60, **kwargs)


def _client(server, key):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=key, max_retries=0)


def _complete(server, model, key=ADMIN, **extra):
    return _post(server, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2, **extra}, key)


@pytest.mark.slow
def test_no_key_or_a_bad_one_gets_401_on_every_route_but_health(server, tiny_llama_path):
    assert requests.get(f"{server}/health", timeout=10).status_code == 200
    for key in (None, "not-a-key-0123456789"):
        r = _complete(server, str(tiny_llama_path), key)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"], r.text
        assert r.headers["WWW-Authenticate"] == "Bearer"
        r = _post(server, "/generate", {"inputs": "hi"}, key)
        assert r.status_code == 401 and r.json()["error_type"] == "unauthorized", r.text
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        assert requests.get(f"{server}/v1/models", headers=headers, timeout=10).status_code == 401
        assert requests.get(f"{server}/info", headers=headers, timeout=10).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        _client(server, "not-a-key-0123456789").completions.create(model=str(tiny_llama_path), prompt="hi",
                                                                  max_tokens=2)
    assert _complete(server, str(tiny_llama_path)).status_code == 200


@pytest.mark.slow
def test_a_scoped_key_reaches_only_its_adapters(server, tiny_llama_path):
    ok = _complete(server, "team-a-chat", TEAM_A)
    assert ok.status_code == 200, ok.text
    outside, missing = _complete(server, "team-b-chat", TEAM_A), _complete(server, "team-a-nope", TEAM_A)
    assert outside.status_code == missing.status_code == 404
    assert outside.json()["error"]["message"] == "adapter 'team-b-chat' not found"
    assert missing.json()["error"]["message"] == "adapter 'team-a-nope' not found"  # the same words: no leak
    base = _complete(server, str(tiny_llama_path), TEAM_A)
    assert base.status_code == 403 and "base model" in base.text
    lorax = _post(server, "/generate", {"inputs": "hi", "parameters": {"adapter_id": "team-b-chat"}}, TEAM_A)
    assert lorax.status_code == 404 and lorax.json()["error_type"] == "not_found"
    assert _complete(server, "team-b-chat").status_code == 200  # the admin key reaches every adapter
    models = requests.get(f"{server}/v1/models", headers={"Authorization": f"Bearer {TEAM_A}"}, timeout=10).json()
    assert "team-b-chat" not in {m["id"] for m in models["data"]}
    load = _post(server, "/v1/load_lora_adapter", {"lora_name": "team-a-new", "lora_path": "/nowhere"}, TEAM_A)
    assert load.status_code == 403 and "may not load" in load.text


@pytest.mark.slow
def test_a_key_with_min_priority_cannot_ask_to_go_first(server, tiny_llama_path):
    ahead = _complete(server, "team-a-chat", TEAM_A, priority=-1)
    assert ahead.status_code == 403
    assert ahead.json()["error"]["message"] == ("this API key may ask priority 0 or above (lower is more urgent), "
                                                "got -1")
    assert all(_complete(server, "team-a-chat", TEAM_A, priority=p).status_code == 200 for p in (0, 5))
    assert _complete(server, "team-a-chat", priority=-5).status_code == 200  # the admin key has no floor


@pytest.mark.slow
def test_over_a_keys_request_rate_gets_429_with_retry_after(server, tiny_llama_path):
    codes = [_complete(server, str(tiny_llama_path), SLOW) for _ in range(3)]
    assert [r.status_code for r in codes] == [200, 200, 429]
    assert 1 <= int(codes[2].headers["Retry-After"]) <= 30
    assert "2 requests per minute" in codes[2].json()["error"]["message"]
    with pytest.raises(openai.RateLimitError):
        _client(server, SLOW).completions.create(model=str(tiny_llama_path), prompt="hi", max_tokens=2)
    assert _complete(server, str(tiny_llama_path)).status_code == 200  # other keys are not held back


@pytest.mark.slow
def test_over_a_keys_token_rate_gets_429(server, tiny_llama_path):
    first = _complete(server, str(tiny_llama_path), FRUGAL, max_tokens=50, ignore_eos=True)
    assert first.status_code == 200, first.text
    second = _post(server, "/generate", {"inputs": "hi"}, FRUGAL)
    assert second.status_code == 429 and "40 tokens per minute" in second.json()["error"], second.text
    assert int(second.headers["Retry-After"]) >= 1


@pytest.mark.slow
def test_a_keys_concurrent_streams_are_capped(server, tiny_llama_path):
    body = {"model": str(tiny_llama_path), "prompt": "hi", "max_tokens": 400, "n": 4, "ignore_eos": True,
            "stream": True}  # seconds of work each on 2 cores: sent at once, they overlap

    def stream(_):
        with _post(server, "/v1/completions", body, SINGLE, stream=True) as r:
            return r.status_code, b"".join(r.iter_content(None)).decode()

    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(stream, range(3)))
    codes = sorted(code for code, _ in answers)
    assert codes[0] == 200 and codes[-1] == 429, codes
    assert all("max_concurrent 1" in text for code, text in answers if code == 429)
    assert _complete(server, str(tiny_llama_path), SINGLE).status_code == 200  # counted out when it ended


@pytest.mark.slow
@pytest.mark.parametrize("path, body, words", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 401}, "max_tokens is 401; this server allows at most 400 "
                                                             "(max_tokens_limit)"),
    ("/v1/completions", {"prompt": list(range(1, 301)), "max_tokens": 250}, "the prompt has 300, so max_tokens may "
                                                                            "be at most 212, got 250"),
    # each API names the parameter as its client sent it
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 500},
     "max_tokens is 500; this server allows at most 400"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 500},
     "max_completion_tokens is 500; this server allows at most 400"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 401}, "max_output_tokens is 401; this server allows"),
    ("/v1/responses", {"input": "hi " * 300, "max_output_tokens": 390}, "so max_output_tokens may be at most"),
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 450}}, "max_new_tokens is 450; this server "
                                                                           "allows at most 400"),
    ("/generate_stream", {"inputs": "hi", "parameters": {"max_new_tokens": 450}}, "max_new_tokens is 450"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 17}, "at most 16"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(301)}}, "at most 300"),
    ("/generate", {"inputs": "hi", "parameters": {"stop": ["x"] * 17}}, "at most 16"),
])
def test_requests_past_a_limit_get_a_4xx_that_states_it(server, tiny_llama_path, path, body, words):
    r = _post(server, path, {"model": str(tiny_llama_path), **body} if path.startswith("/v1") else body)
    assert r.status_code in (400, 422), r.text
    assert words in r.text


@pytest.mark.slow
def test_a_body_over_the_limit_gets_413_unparsed(server, tiny_llama_path):
    r = _complete(server, str(tiny_llama_path), prompt="word " * 20000)
    assert r.status_code == 413 and "65536" in r.json()["error"]["message"], r.text
    chunked = requests.post(f"{server}/generate", data=iter([b'{"inputs": "', b"x" * 70000, b'"}']),
                            headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"},
                            timeout=60)
    assert chunked.status_code == 413, chunked.text


@pytest.mark.slow
def test_per_key_usage_is_exported_and_keys_never_logged(server, tiny_llama_path):
    assert _complete(server, str(tiny_llama_path)).status_code == 200

    def exported():
        text = requests.get(METRICS["url"], timeout=10).text
        return text if 'tenant="admin"' in text and "lora_serve_tenant_tokens" in text else None

    deadline = time.monotonic() + 60
    while not (text := exported()):
        assert time.monotonic() < deadline, "per-key metrics not exported"
        time.sleep(2)
    assert 'outcome="unauthorized"' in text or 'tenant="unauthenticated"' in text
    logs = [p for p in Path(METRICS["temp"]).rglob("*") if p.is_file() and p.suffix in (".log", ".out", ".err")]
    assert logs
    for secret in (ADMIN, TEAM_A, SLOW, FRUGAL, SINGLE):
        assert not [p for p in logs if secret in p.read_text(errors="ignore")], "a key reached a log"
        assert secret not in text, "a key reached the metrics"


@pytest.mark.slow
def test_many_keys_at_once_are_each_counted(server, tiny_llama_path):
    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(lambda key: _complete(server, str(tiny_llama_path), key).status_code,
                              [ADMIN, SINGLE, ADMIN, SINGLE]))
    assert codes.count(200) >= 3 and set(codes) <= {200, 429}
    assert _complete(server, str(tiny_llama_path), SINGLE).status_code == 200  # nothing left counted in


def _dashboard_queries() -> list[str]:
    dashboard = json.loads((Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "lora-serve.json").read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def _names_and_labels(queries: list[str]) -> tuple[set[str], set[str]]:
    """The metrics a dashboard's PromQL reads (with a histogram's _bucket), and the labels it groups or filters by."""
    import re

    names = {name for q in queries for name in re.findall(r"\b(lora_serve_[a-z_]+)", q)}
    grouped = {label.strip() for q in queries for group in re.findall(r"by \(([^)]*)\)", q)
               for label in group.split(",")}
    filtered = {label for q in queries for label in re.findall(r"(\w+)\s*!?=", q)}
    return names, (grouped | filtered) - {"le"}


@pytest.mark.slow
def test_the_grafana_dashboard_reads_only_what_the_server_exports(server, tiny_llama_path):
    """Every metric and label of deploy/grafana/lora-serve.json's queries is in what Ray exports for this app, once
    it has served base, adapter and streamed requests and refused one: a renamed metric fails here."""
    assert _complete(server, str(tiny_llama_path)).status_code == 200
    for _ in range(2):  # an adapter: loaded into the replica, then found there
        assert _complete(server, "team-a-chat").status_code == 200
    streamed = _post(server, "/v1/completions", {"model": str(tiny_llama_path), "prompt": "hi", "max_tokens": 8,
                                                 "stream": True}, stream=True)
    assert streamed.status_code == 200 and len([line for line in streamed.iter_lines() if line]) >= 3
    assert _complete(server, str(tiny_llama_path), key=None).status_code == 401
    names, labels = _names_and_labels(_dashboard_queries())
    assert "lora_serve_inter_token_latency_seconds_bucket" in names and "tenant" in labels  # the parse found them
    deadline = time.monotonic() + 60
    while True:
        text = requests.get(METRICS["url"], timeout=10).text
        missing = [n for n in names if n not in text] + [f'{label}="' for label in labels if f'{label}="' not in text]
        if not missing:
            break
        assert time.monotonic() < deadline, f"the dashboard reads what the server does not export: {missing}"
        time.sleep(2)
