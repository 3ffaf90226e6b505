"""The Ray adapter cache actor: single flight, LRU by bytes, restart after death, errors, engine use."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import ray

from engine import LLM, SamplingParams
from engine.errors import AdapterError
from lora_cache.actor import LoRACacheActor, RayAdapterCache
from lora_cache.adapter_folder import AdapterCacheUnavailableError
from lora_cache.local_cache import local_adapters
from lora_cache.source_config import SourceConfig
from tests.helpers import PROMPTS, lora_shapes_of, write_tiny_adapters

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def adapters_root(tiny_llama_path, tmp_path_factory):
    root = write_tiny_adapters(tiny_llama_path, tmp_path_factory.mktemp("actor-adapters"), ("a", "b", "c"))
    (root / "pickled").mkdir()
    (root / "pickled" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": 8}')
    (root / "pickled" / "adapter_model.bin").write_bytes(b"not really a pickle")
    return root


@pytest.fixture(scope="module")
def ray_cluster(serve_cluster):
    """The shared cluster (tests/conftest.py): these tests' actors have no names, and go with their handles."""
    yield


def _actor(adapters_root, capacity_bytes: int = 4 << 30):
    return LoRACacheActor.remote(SourceConfig(adapters_root=str(adapters_root)), capacity_bytes)


@pytest.fixture(scope="module")
def shapes(tiny_llama_path):
    return lora_shapes_of(tiny_llama_path)


def _client(actor, shapes, adapters_root, *args, **kwargs) -> RayAdapterCache:
    """A replica's copy of the actor, bound as an engine binds it (to its model's LoRA shapes and its sources, the
    actor's here)."""
    return RayAdapterCache(actor, *args, **kwargs).bound(SourceConfig(adapters_root=str(adapters_root)), shapes)


@pytest.fixture(scope="module")
def shared_actor(ray_cluster, tiny_llama_path, adapters_root):
    """One actor for the tests that only read through it: each actor is a worker process, seconds to start."""
    return _actor(adapters_root)


def test_concurrent_requests_cause_one_load(shared_actor, shapes):
    assert "a" not in ray.get(shared_actor.stats.remote()).load_counts  # the first to ask for it
    refs = ray.get([shared_actor.get.remote("a", shapes) for _ in range(8)])
    assert len({r[0].hex() for r in refs}) == 1
    stats = ray.get(shared_actor.stats.remote())
    assert stats.load_counts["a"] == 1 and stats.misses >= 1


def test_lru_eviction_by_bytes(shared_actor, tiny_llama_path, adapters_root, shapes):
    ray.get(shared_actor.get.remote("a", shapes))
    one = ray.get(shared_actor.stats.remote()).adapters["a"].nbytes  # the three adapters are alike in size
    actor = _actor(adapters_root, capacity_bytes=2 * one)
    for name in ("a", "b", "a", "c"):  # "a" was used after "b": "b" is the least recently used
        ray.get(actor.get.remote(name, shapes))
    stats = ray.get(actor.stats.remote())
    assert sorted(stats.adapters) == ["a", "c"] and stats.nbytes <= 2 * one
    ray.get(actor.get.remote("b", shapes))
    assert ray.get(actor.stats.remote()).load_counts["b"] == 2


def test_killed_actor_restarts_and_replica_keeps_what_it_holds(ray_cluster, tiny_llama_path, adapters_root, shapes):
    actor = _actor(adapters_root)
    client = _client(actor, shapes, adapters_root, follow_registry=False)
    held = client.get("a")
    ray.kill(actor, no_restart=False)
    assert client.get("a") is held  # served from the replica's own copy while the actor restarts
    deadline = time.monotonic() + 30  # the kill lands asynchronously: wait for the restarted, empty actor
    while "a" in ray.get(actor.stats.remote()).load_counts and time.monotonic() < deadline:
        time.sleep(0.1)
    fresh = client.get("b")  # the restarted actor loads on demand
    assert fresh.adapter_id == "b"
    assert ray.get(actor.stats.remote()).load_counts == {"b": 1}



def test_a_silent_actor_fails_a_fetch_as_unavailable_and_serves_once_it_answers(shared_actor, shapes, adapters_root):
    """A stopped actor process answers nothing and is not dead to Ray: the replica's wait ends after timeout_s
    with the cache named (a 503 at the edge), and the actor serves again once it runs."""
    client = _client(shared_actor, shapes, adapters_root, follow_registry=False, timeout_s=1)
    pid = ray.get(shared_actor.ping.remote())
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(AdapterCacheUnavailableError, match=r"adapter 'c': the adapter cache is unavailable: "
                                                                r"its actor .* has answered nothing for 1 s"):
            client.get("c")
        assert 1 <= time.monotonic() - start < 5
        with pytest.raises(AdapterCacheUnavailableError, match="answered nothing"):
            asyncio.run(client.cache_stats())
    finally:
        os.kill(pid, signal.SIGCONT)
    assert client.get("c").adapter_id == "c"


def test_a_replica_copy_waits_for_the_actor_only_when_asked(ray_cluster, adapters_root, shared_actor, shapes):
    """The copy does not wait for the actor's start (a replica builds its engine meanwhile); an actor that cannot
    start fails wait_ready with its reason, and a started one answers keys."""
    broken = LoRACacheActor.remote(SourceConfig("s3"))  # no bucket: its __init__ raises
    client = RayAdapterCache(broken, follow_registry=False)  # returns though the actor's __init__ raises
    with pytest.raises(ray.exceptions.RayActorError, match="needs adapters_root"):
        client.wait_ready()
    working = _client(shared_actor, shapes, adapters_root)
    working.wait_ready()
    assert working.key("a") == "a"
    working.close()


def test_bad_adapter_error_reaches_the_replica_with_its_reason(shared_actor, shapes, adapters_root):
    client = _client(shared_actor, shapes, adapters_root, follow_registry=False)
    with pytest.raises(AdapterError, match="pickled"):
        client.get("pickled")
    with pytest.raises(AdapterError, match="not found"):
        client.get("nope")
    with pytest.raises(ValueError, match=r"\.\."):
        client.get("../a")


def test_engine_through_actor_equals_local_cache(shared_actor, tiny_llama_path, adapters_root, shapes):
    params = SamplingParams(max_tokens=8, temperature=0.0)
    adapters = ["a", None, "b", "c"]
    local = LLM(str(tiny_llama_path), adapters=local_adapters, max_loras=2, adapters_root=str(adapters_root),
                log_stats=False)
    expected = [o.token_ids for o in local.generate(PROMPTS[:4], params, use_tqdm=False, adapters=adapters)]
    from engine import EngineConfig
    from engine.llm_engine import LLMEngine

    provider = RayAdapterCache(shared_actor, follow_registry=False)
    config = EngineConfig.from_overrides(str(tiny_llama_path), max_loras=2, log_stats=False,
                                         adapters_root=str(adapters_root))  # the actor's root, as in serving
    engine = LLMEngine(config, provider.bound)
    for i, (prompt, adapter) in enumerate(zip(PROMPTS[:4], adapters)):
        engine.add_request(str(i), prompt, params, adapter)
    outputs = {}
    while engine.has_unfinished():
        outputs.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert [outputs[str(i)] for i in range(4)] == expected
