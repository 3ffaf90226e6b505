"""Adapters from the Hugging Face Hub and from S3, against real servers on the loopback: a small Hub
(tests/hub_server.py, through HF_ENDPOINT) and moto's S3 server (AWS_ENDPOINT_URL), each in its own process."""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.errors import AdapterError
from engine.free_ports import free_port
from lora_cache.disk_tier import STAGING, DiskTier
from lora_cache.local_cache import local_adapters
from lora_cache.make_source import make_source
from lora_cache.source_config import SourceConfig
from lora_cache.sources import AdapterLocation
from tests.helpers import PROMPTS, lora_shapes_of, ray_and_serve, write_tiny_adapters

ROOT = Path(__file__).parent.parent
FILES = ("adapter_config.json", "adapter_model.safetensors")
S3_ENV = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}


def _serve(args: list[str], port: int) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return process
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, f"{args} did not start"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def adapters(tiny_llama_path, tmp_path_factory):
    return write_tiny_adapters(tiny_llama_path, tmp_path_factory.mktemp("remote-adapters"), ("one", "two", "big"))


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """(endpoint, root) of a Hub server process."""
    root, port = tmp_path_factory.mktemp("hub"), free_port()
    process = _serve(["-m", "tests.hub_server", str(root), str(port)], port)
    yield f"http://127.0.0.1:{port}", root
    process.terminate()
    process.wait()


@pytest.fixture(scope="module")
def s3(adapters):
    """The endpoint of moto's S3 server, with a bucket holding adapters one and two under models/."""
    import boto3

    port = free_port()
    process = _serve(["-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], port)
    endpoint = f"http://127.0.0.1:{port}"
    client = boto3.client("s3", endpoint_url=endpoint, **{k.lower(): v for k, v in S3_ENV.items()
                                                           if k != "AWS_DEFAULT_REGION"}, region_name="us-east-1")
    client.create_bucket(Bucket="adapters")
    for name in ("one", "two"):
        for file in FILES:
            client.upload_file(str(adapters / name / file), "adapters", f"models/acme/{name}/{file}")
    yield endpoint, client
    process.terminate()
    process.wait()


def publish(hub_root: Path, repo: str, commit: str, source: Path, refs=("main",), files=FILES) -> None:
    """Put the adapter files of `source` in the Hub as `repo` at `commit`, with these branches pointing to it."""
    folder = hub_root / repo / commit
    folder.mkdir(parents=True, exist_ok=True)
    for file in files:
        shutil.copy(source / file, folder / file)
    for ref in refs:
        (hub_root / repo / "refs").mkdir(exist_ok=True)
        (hub_root / repo / "refs" / ref).write_text(commit)


def gets(hub_root: Path, repo: str) -> list[str]:
    log = hub_root / "gets.log"
    return [line for line in log.read_text().splitlines() if line.startswith(repo + "/")] if log.exists() else []


def tier_contents(folder: Path) -> list[str]:
    """Entries and staging leftovers of a disk tier."""
    staging = [f"{STAGING}/{p.name}" for p in (folder / STAGING).iterdir()] if (folder / STAGING).exists() else []
    return sorted([p.name for p in folder.iterdir() if p.name != STAGING] + staging)


def tokens(llm: LLM, adapter: str) -> list[int]:
    params = SamplingParams(max_tokens=8, temperature=0)
    return llm.generate([PROMPTS[1]], params, use_tqdm=False, adapters=[adapter])[0].token_ids


@pytest.fixture()
def hub_env(hub, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub[0])
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return hub[1]


def test_hub_adapter_matches_the_local_one_and_downloads_once(tiny_llama_path, adapters, hub_env, tmp_path):
    publish(hub_env, "acme/one", "c1" * 20, adapters / "one")
    local = LLM(str(tiny_llama_path), adapters=local_adapters, max_loras=2, adapters_root=str(adapters),
                log_stats=False)
    options = dict(adapters=local_adapters, max_loras=2, adapter_source="hub", adapter_disk_cache=str(tmp_path),
                   log_stats=False)
    first = LLM(str(tiny_llama_path), **options)
    assert tokens(first, "acme/one") == tokens(local, "one")
    assert gets(hub_env, "acme/one") == [f"acme/one/{'c1' * 20}/{f}" for f in FILES]
    second = LLM(str(tiny_llama_path), **options)  # another process on this node: the disk tier has it
    assert tokens(second, "acme/one") == tokens(local, "one")
    assert len(gets(hub_env, "acme/one")) == 2


def test_hub_revisions_and_a_retrained_adapter_on_main(tiny_llama_path, adapters, hub_env, tmp_path):
    publish(hub_env, "acme/evolving", "a1" * 20, adapters / "one", refs=("main", "v1"))
    config = SourceConfig("hub", disk_cache=str(tmp_path))
    source = make_source(config)
    v1 = source.locate("acme/evolving")
    publish(hub_env, "acme/evolving", "b2" * 20, adapters / "two")  # retrained: main moves on
    v2 = source.locate("acme/evolving")
    assert v2 != v1 and (v2 / FILES[1]).read_bytes() == (adapters / "two" / FILES[1]).read_bytes()
    assert source.locate("acme/evolving@v1") == v1  # a pinned revision keeps its weights, from the tier
    assert source.locate(f"acme/evolving@{'a1' * 20}") == v1
    with pytest.raises(AdapterError, match="not found on the Hub"):
        source.locate("acme/evolving@v9")
    with pytest.raises(AdapterError, match="not found on the Hub"):
        source.locate("acme/absent")


def test_hub_refuses_pickled_weights_without_downloading_them(adapters, hub_env, tmp_path):
    publish(hub_env, "acme/pickled", "d4" * 20, adapters / "one", files=(FILES[0],))
    (hub_env / "acme/pickled" / ("d4" * 20) / "adapter_model.bin").write_bytes(b"a pickle")
    with pytest.raises(AdapterError, match="no adapter_model.safetensors; pickled adapter_model.bin weights are "
                                           "never downloaded"):
        make_source(SourceConfig("hub", disk_cache=str(tmp_path))).locate("acme/pickled")
    assert gets(hub_env, "acme/pickled") == [] and tier_contents(tmp_path) == []


@pytest.mark.parametrize("fault, limit, message", [
    ({}, 0.5, "announce .* bytes, over max_adapter_bytes"),
    ({"understate": FILES[1]}, 0.5, "download passed max_adapter_bytes"),  # the server lies about the size
    ({"truncate": FILES[1]}, 2.0, "download from .* failed|truncated")])
def test_hub_download_truncated_or_over_the_limit_leaves_nothing(adapters, hub_env, tmp_path, fault, limit, message):
    repo = f"acme/fault-{'-'.join(fault) or 'none'}"
    publish(hub_env, repo, "e5" * 20, adapters / "big")
    (hub_env / repo / "faults.json").write_text(json.dumps(fault))
    size = sum((adapters / "big" / f).stat().st_size for f in FILES)
    config = SourceConfig("hub", disk_cache=str(tmp_path), max_adapter_bytes=int(size * limit), download_retries=0)
    with pytest.raises(AdapterError, match=message):
        make_source(config).locate(repo)
    assert tier_contents(tmp_path) == []


def test_hub_offline_reads_the_huggingface_cache_and_sends_nothing(adapters, hub_env, tmp_path, monkeypatch):
    from huggingface_hub import hf_hub_download

    publish(hub_env, "acme/cached", "f6" * 20, adapters / "one")
    cache = tmp_path / "hf-cache"
    for file in FILES:  # the Hugging Face cache, filled by huggingface_hub itself
        hf_hub_download("acme/cached", file, cache_dir=cache, endpoint=os.environ["HF_ENDPOINT"])
    before = len(gets(hub_env, "acme/cached"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = make_source(SourceConfig("hub", hub_cache=str(cache), disk_cache=str(tmp_path / "tier")))
    folder = source.locate("acme/cached")
    assert (folder / FILES[1]).read_bytes() == (adapters / "one" / FILES[1]).read_bytes()
    assert len(gets(hub_env, "acme/cached")) == before


def test_s3_adapter_matches_the_local_one_and_a_rewrite_is_a_new_version(tiny_llama_path, adapters, s3, tmp_path,
                                                                          monkeypatch):
    endpoint, client = s3
    for key, value in {**S3_ENV, "AWS_ENDPOINT_URL": endpoint}.items():
        monkeypatch.setenv(key, value)
    local = LLM(str(tiny_llama_path), adapters=local_adapters, max_loras=2, adapters_root=str(adapters),
                log_stats=False)
    remote = LLM(str(tiny_llama_path), adapters=local_adapters, max_loras=2, adapter_source="s3", adapters_root="s3://adapters/models",
                 adapter_disk_cache=str(tmp_path), log_stats=False)
    assert tokens(remote, "acme/one") == tokens(local, "one")
    assert tokens(remote, "acme/two") == tokens(local, "two")
    source = make_source(SourceConfig("s3", "s3://adapters/models", disk_cache=str(tmp_path)))
    before = source.locate("acme/one")
    client.upload_file(str(adapters / "two" / FILES[1]), "adapters", f"models/acme/one/{FILES[1]}")
    after = source.locate("acme/one")
    assert after != before and (after / FILES[1]).read_bytes() == (adapters / "two" / FILES[1]).read_bytes()
    with pytest.raises(AdapterError, match="'acme/absent': adapter_config.json not found in S3"):
        source.locate("acme/absent")


def test_s3_download_over_the_limit_leaves_nothing(adapters, s3, tmp_path, monkeypatch):
    for key, value in {**S3_ENV, "AWS_ENDPOINT_URL": s3[0]}.items():
        monkeypatch.setenv(key, value)
    config = SourceConfig("s3", "s3://adapters/models", disk_cache=str(tmp_path), max_adapter_bytes=1000)
    with pytest.raises(AdapterError, match="over max_adapter_bytes"):
        make_source(config).locate("acme/one")
    assert tier_contents(tmp_path) == []


def test_disk_tier_evicts_the_least_recently_used_by_bytes(tmp_path):
    tier = DiskTier(tmp_path, capacity_bytes=250, max_adapter_bytes=1000)

    def fill(entry: str):
        def download(open_file):
            with open_file("weights") as file:
                file.write(b"x" * 100)
                file.finish(100)
        return tier.fill(entry, entry, download)

    fill("a"), fill("b")
    time.sleep(0.01)
    assert tier.lookup("a") is not None  # "a" is now more recent than "b"
    time.sleep(0.01)
    fill("c")  # 300 bytes > 250: the least recently used, "b", goes
    assert tier_contents(tmp_path) == ["a", "c"] and tier.lookup("b") is None
    (tmp_path / STAGING / "999999999-dead").mkdir()  # a download whose process died
    DiskTier(tmp_path, capacity_bytes=250, max_adapter_bytes=1000)
    assert tier_contents(tmp_path) == ["a", "c"]


@pytest.fixture(scope="module")
def ray_servers(hub, s3, tmp_path_factory):
    """Ray whose workers (the cache actor) reach the loopback Hub and S3 servers."""
    env = {**S3_ENV, "AWS_ENDPOINT_URL": s3[0], "HF_ENDPOINT": hub[0]}
    with ray_and_serve(num_cpus=1, include_dashboard=False, _temp_dir=str(tmp_path_factory.mktemp("ray")),
                       runtime_env={"env_vars": env}):
        yield




def test_killing_the_cache_actor_mid_download_leaves_no_partial_adapter(ray_servers, tiny_llama_path, adapters,
                                                                         hub, tmp_path):
    """The actor dies while a slow download is half written; Ray restarts it and retries the call: the dead
    download's staging folder is gone, and the one entry is the whole adapter."""
    import ray

    from lora_cache.actor import LoRACacheActor

    hub_root = hub[1]
    publish(hub_root, "acme/slow", "a7" * 20, adapters / "big")
    (hub_root / "acme/slow" / "faults.json").write_text(json.dumps({"slow_s": 0.1}))
    tier = tmp_path / "tier"
    actor = LoRACacheActor.remote(SourceConfig("hub", disk_cache=str(tier)))
    ref = actor.get.remote("acme/slow", lora_shapes_of(tiny_llama_path))
    deadline = time.monotonic() + 60
    while not any(p.is_file() for p in (tier / STAGING).glob("*/*")):
        assert time.monotonic() < deadline, "the download never started"
        time.sleep(0.05)
    ray.kill(actor, no_restart=False)
    (hub_root / "acme/slow" / "faults.json").unlink()
    [adapter_ref] = ray.get(ref)  # retried on the restarted actor
    assert ray.get(adapter_ref).adapter_id == "acme/slow"
    [entry] = tier_contents(tier)
    assert all((tier / entry / f).read_bytes() == (adapters / "big" / f).read_bytes() for f in FILES)



def test_a_download_longer_than_the_cache_timeout_is_waited_for(ray_servers, tiny_llama_path, adapters, hub,
                                                                tmp_path):
    """The replica's bound is on the actor's silence, not on the load's time: a download of about 1.2 s, by an
    actor that answers pings meanwhile, is awaited by a copy whose timeout_s is 0.3 s."""
    import ray

    from lora_cache.actor import LoRACacheActor, RayAdapterCache
    from lora_cache.adapter import content_id

    publish(hub[1], "acme/unhurried", "c9" * 20, adapters / "one")
    chunks = sum(math.ceil((adapters / "one" / f).stat().st_size / 1024) for f in FILES)
    (hub[1] / "acme/unhurried" / "faults.json").write_text(json.dumps({"slow_s": 1.2 / chunks}))
    sources = SourceConfig("hub", disk_cache=str(tmp_path))
    actor = LoRACacheActor.remote(sources)
    ray.get(actor.ping.remote())  # started: the actor's own start is not the wait under test
    shapes = lora_shapes_of(tiny_llama_path)
    client = RayAdapterCache(actor, follow_registry=False, timeout_s=0.3).bound(sources, shapes)
    try:
        start = time.monotonic()
        assert client.get("acme/unhurried").content_id == content_id(adapters / "one")
        assert time.monotonic() - start > 0.6  # well past timeout_s
    finally:
        client.close()
        ray.kill(actor, no_restart=True)

def test_registered_s3_and_hub_locations_load_and_outlive_an_actor_restart(ray_servers, tiny_llama_path, adapters,
                                                                           hub, tmp_path):
    import ray

    from lora_cache.actor import LoRACacheActor, RayAdapterCache
    from lora_cache.adapter import content_id

    publish(hub[1], "acme/registered", "b8" * 20, adapters / "one", refs=("main", "v3"))
    sources = SourceConfig("local", str(adapters), disk_cache=str(tmp_path))
    actor = LoRACacheActor.options(name="registry-test").remote(sources)
    client = RayAdapterCache(actor, "test-replica", follow_registry=False).bound(sources,
                                                                                 lora_shapes_of(tiny_llama_path))
    try:
        shapes = lora_shapes_of(tiny_llama_path)
        from_s3 = ray.get(actor.register.remote("from-s3", "s3://adapters/models/acme/two", shapes))
        from_hub = ray.get(actor.register.remote("from-hub", "hf://acme/registered@v3", shapes))
        assert (from_s3.key, from_hub.key) == ("from-s3#1", "from-hub#1")
        assert from_s3.content_id == content_id(adapters / "two")
        assert from_hub.content_id == content_id(adapters / "one")
        assert client.get(from_hub.key).content_id == from_hub.content_id
        with pytest.raises(AdapterError, match="'absent': adapter_config.json not found in S3"):
            ray.get(actor.register.remote("absent", "s3://adapters/models/acme/absent", shapes))

        ray.kill(actor, no_restart=False)
        deadline = time.monotonic() + 30
        while True:  # the kill lands asynchronously: wait for the restarted actor, its object store tier empty
            try:
                stats = ray.get(actor.stats.remote())
                if not stats.adapters:
                    break
            except ray.exceptions.RayActorError:
                pass
            assert time.monotonic() < deadline, "the actor did not restart"
            time.sleep(0.2)
        # it read its registrations back from the disk cache folder
        assert stats.registered == {"from-s3": "s3://adapters/models/acme/two",
                                       "from-hub": "hf://acme/registered@v3"}
        assert stats.generations == {"from-s3": 1, "from-hub": 1}
        [ref] = ray.get(actor.get.remote("from-s3#1", shapes))
        assert ray.get(ref).content_id == from_s3.content_id
    finally:
        client.close()
        ray.kill(actor, no_restart=True)


def test_the_registry_persists_into_a_folder_not_made_yet(tmp_path, adapters):
    from lora_cache.registry import AdapterRegistry

    path = tmp_path / "never-made" / "registry-x.json"  # a local-source server's disk cache folder
    registry = AdapterRegistry(path)
    assert registry.register("one", AdapterLocation.parse(str(adapters / "one"))) == "one#1"
    assert AdapterRegistry(path).view().key("one") == "one#1"
