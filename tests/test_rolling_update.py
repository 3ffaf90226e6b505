"""Redeploying under load loses no request: a scale-down (num_replicas 2 -> 1) and a rolling update to a changed
engine config (a new adapters_root, a new max_num_seqs), each while client threads keep streamed and whole
requests in flight on /generate, /generate_stream and /v1/completions through Serve's HTTP proxy.

Every request ends in one of three ways: completed (200, a stream with its final event), retryable (429 or 503 with
Retry-After) or failed (any other status, a broken connection, a stream cut before its end, no answer within
120 s). The tests want no failed one, and requests in flight on the stopping replica while it stopped."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass

import pytest
import requests

from tests.helpers import PROMPTS, serving, write_tiny_adapters

pytestmark = pytest.mark.slow
APP = "rolling"
HANG_S = 120  # a request without its whole answer by then hangs
KINDS = ("generate", "generate_stream", "completions", "completions_stream")


@dataclass(frozen=True)
class Done:
    kind: str
    outcome: str  # completed, retryable or failed
    started: float
    ended: float
    detail: str = ""


def _app(engine: dict, replicas: int):
    """The app, versioned by its args as `serve deploy` versions an app by its config's: a changed num_replicas
    alone keeps the replicas, changed args replace them. serve.run gives an unversioned deployment a new random
    version each time, which would replace every replica on any change; options() no longer takes a version."""
    from deployments.replica.llm_server import LLMServer

    llm = LLMServer.options(num_replicas=replicas, ray_actor_options={"num_cpus": 1}, health_check_period_s=1,
                            graceful_shutdown_wait_loop_s=0.5)
    llm._version = hashlib.sha256(json.dumps(engine, sort_keys=True).encode()).hexdigest()[:16]
    return llm.bind(engine)


def _deploy(engine: dict, replicas: int) -> None:
    """Redeploy the app in place, as `serve deploy` of a changed config does; returns once the target runs."""
    from ray import serve

    serve.run(_app(engine, replicas), name=APP, route_prefix="/")
    _wait_for(lambda: _replica_states() == {"RUNNING": replicas}, 120, f"{replicas} replicas and none stopping")


@pytest.fixture(scope="module")
def roots(tiny_llama_path, tmp_path_factory):
    """Two adapter roots: `both` in each (the same weights), `first-only` and `second-only` in one."""
    first = write_tiny_adapters(tiny_llama_path, tmp_path_factory.mktemp("root-1"), ("first-only", "both"))
    second = write_tiny_adapters(tiny_llama_path, tmp_path_factory.mktemp("root-2"), ("second-only", "both"))
    return first, second


@pytest.fixture(scope="module")
def engine(tiny_llama_path, roots, tmp_path_factory) -> dict:
    return {"model": str(tiny_llama_path), "log_stats": False, "num_threads": 1, "kv_cache_bytes": 32 << 20,
            "max_num_seqs": 8, "max_loras": 2, "adapters_root": str(roots[0]),
            "adapter_disk_cache": str(tmp_path_factory.mktemp("rolling-disk-tier"))}


@pytest.fixture(scope="module")
def server(serve_cluster, engine):
    with serving(serve_cluster, _app(engine, 1), APP) as url:
        yield url


def _replica_states() -> dict[str, int]:
    from ray import serve

    states = serve.status().applications[APP].deployments["LLMServer"].replica_states
    return {state: n for state, n in states.items() if n}


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _request(url: str, kind: str, model: str, index: int) -> requests.Response:
    """A request of `kind`, 160-416 tokens long by its index, greedy, past EOS."""
    tokens, prompt = 160 + 64 * (index % 5), PROMPTS[index % len(PROMPTS)]
    if kind.startswith("generate"):
        body = {"inputs": prompt, "parameters": {"max_new_tokens": tokens, "ignore_eos_token": True}}
        return requests.post(f"{url}/{kind}", json=body, timeout=HANG_S, stream=kind == "generate_stream")
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": kind == "completions_stream"}
    return requests.post(f"{url}/v1/completions", json=body, timeout=HANG_S, stream=body["stream"])


def _outcome(kind: str, response: requests.Response) -> tuple[str, str]:
    """completed, retryable or failed, and why it failed."""
    if response.status_code in (429, 503) and "Retry-After" in response.headers:
        return "retryable", ""
    if response.status_code != 200:
        return "failed", f"{response.status_code}: {response.text[:200]}"
    if not kind.endswith("stream"):
        body = response.json()
        text = body["choices"][0]["text"] if kind == "completions" else body["generated_text"]
        return ("completed", "") if text else ("failed", f"no text: {body}")
    lines = [line for line in response.iter_lines() if line.startswith(b"data:")]
    return _stream_outcome(kind, lines)


def _stream_outcome(kind: str, lines: list[bytes]) -> tuple[str, str]:
    """A stream is completed when it ends with its final event: OpenAI's finish_reason then [DONE], LoRAX's
    generated_text; an error event naming 429 or 503 is a retryable end, any other end a failure."""
    if kind == "completions_stream" and (len(lines) < 2 or lines[-1] != b"data: [DONE]"):
        return "failed", f"no [DONE]: {lines[-2:]}"
    last = json.loads(lines[-2 if kind == "completions_stream" else -1].split(b":", 1)[1])
    if "error" in last:
        code = last["error"].get("code") if isinstance(last["error"], dict) else last.get("error_type")
        return ("retryable", "") if code in (429, 503, "overloaded") else ("failed", f"error event: {last}")
    final = last["choices"][0]["finish_reason"] if kind == "completions_stream" else last.get("generated_text")
    return ("completed", "") if final else ("failed", f"cut before its final event: {last}")


def _client(url: str, kind: str, model: str, stop: threading.Event, done: list[Done]) -> None:
    """Send requests of one kind, one at a time, until stop is set."""
    index = 0
    while not stop.is_set():
        started = time.monotonic()
        try:
            outcome, detail = _outcome(kind, _request(url, kind, model, index))
        except (requests.RequestException, ValueError, KeyError, IndexError) as exc:  # reset, cut, hung
            outcome, detail = "failed", repr(exc)
        done.append(Done(kind, outcome, started, time.monotonic(), detail))
        index += 1


class Load:
    """Two client threads per request kind, from start until stop(); every answer they got."""

    def __init__(self, url: str, model: str):
        self.done: list[Done] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=_client, args=(url, kind, model, self._stop, self.done))
                         for kind in KINDS for _ in range(2)]
        for thread in self._threads:
            thread.start()

    def stop(self) -> Counter:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=HANG_S + 30)
        assert not any(t.is_alive() for t in self._threads), "a request hung"
        return Counter(d.outcome for d in self.done)


class StopWatch:
    """When a replica of the app was first seen stopping, from serve.status() polled on a thread."""

    def __init__(self):
        self.stopping_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch)
        self._thread.start()

    def _watch(self) -> None:
        while self.stopping_at is None and not self._stop.wait(0.1):
            if _replica_states().get("STOPPING"):
                self.stopping_at = time.monotonic()

    def close(self) -> float:
        self._stop.set()
        self._thread.join()
        assert self.stopping_at is not None, "no replica was seen stopping"
        return self.stopping_at


def _under_load(url: str, redeploy) -> tuple[Counter, list[Done], float]:
    """Run redeploy() while the load runs, and the load on 3 s after it; the outcome counts, every answer and
    when the replica was seen stopping."""
    load, watch = Load(url, _served_model(url)), StopWatch()
    try:
        _wait_for(lambda: len(load.done) >= 8, 120, "the load's first answers")
        redeploy()
        time.sleep(3)
    finally:
        stopping_at = watch.close()
        counts = load.stop()
    return counts, load.done, stopping_at


def _served_model(url: str) -> str:
    return requests.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]


def _assert_none_lost(counts: Counter, done: list[Done], stopping_at: float, what: str) -> None:
    spanning = [d for d in done if d.started < stopping_at < d.ended]
    print(f"{what}: {dict(counts)}, {len(spanning)} in flight as a replica stopped")
    assert counts["failed"] == 0, [d for d in done if d.outcome == "failed"][:5]
    assert spanning and all(d.outcome == "completed" for d in spanning), spanning
    assert counts["completed"] >= 16


def _replicas_running() -> dict[str, int]:
    """Each replica's running requests, by replica, asked through a handle until both replicas answered."""
    from ray import serve

    handle = serve.get_deployment_handle("LLMServer", app_name=APP)
    seen = {}
    for _ in range(40):
        stats = handle.stats.remote().result(timeout_s=30)
        seen[stats.replica] = stats.running
        if len(seen) == 2:
            break
    return seen


def _both_running(running: dict[str, int]) -> bool:
    return len(running) == 2 and min(running.values()) > 0


def _info(url: str) -> dict:
    return requests.get(f"{url}/info", timeout=60).json()


def test_scale_down_under_load_completes_the_stopped_replicas_requests(server, engine):
    _deploy(engine, 2)
    before = set(_replicas_running())
    assert len(before) == 2

    def scale_down():
        _wait_for(lambda: _both_running(_replicas_running()), 60, "requests on both replicas")
        _deploy(engine, 1)

    counts, done, stopping_at = _under_load(server, scale_down)
    _assert_none_lost(counts, done, stopping_at, "scale-down 2 -> 1")
    after = set(_replicas_running())
    assert len(after) == 1 and after < before  # the kept replica was not restarted


def _adapter_status(url: str, adapter: str) -> int:
    body = {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 4, "adapter_id": adapter}}
    return requests.post(f"{url}/generate", json=body, timeout=HANG_S).status_code


def test_rolling_update_to_a_changed_config_loses_no_request(server, engine, roots):
    """Two replicas, replaced one at a time: the first new one sees the stopped one's last report for a while."""
    _deploy(engine, 2)
    assert _adapter_status(server, "first-only") == 200 and _adapter_status(server, "both") == 200
    old = _info(server)
    changed = {**engine, "adapters_root": str(roots[1]), "max_num_seqs": 4}

    counts, done, stopping_at = _under_load(server, lambda: _deploy(changed, 2))
    _assert_none_lost(counts, done, stopping_at, "rolling update")
    new = _info(server)
    assert new["replica"] != old["replica"] and (old["max_num_seqs"], new["max_num_seqs"]) == (8, 4)
    statuses = {a: _adapter_status(server, a) for a in ("second-only", "both", "first-only")}
    assert statuses == {"second-only": 200, "both": 200, "first-only": 404}
