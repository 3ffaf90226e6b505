"""One elastic cycle of `serve run serve_config.yaml` on a cluster that Ray's autoscaler grows and shrinks.

The cluster (benchmarks/serve/fake_cluster.py) starts with its head alone; engine replicas ask for a resource that
only its worker nodes carry (`replica_resources`), so the first replica makes the autoscaler add a node. Streams of
chat requests, over the base model and adapters, then rise, hold and fall (a `Profile`); the engine's autoscaling
policy asks for more replicas, and the autoscaler adds their nodes. Once the load is gone the deployment scales
back down, and every node that held nothing else is removed after the autoscaler's idle timeout. A sampler records
the nodes, replicas, tokens/s and first-token times every second.

The serve config is the shipped one with small changes (`cycle_config`): its port, replicas on the worker nodes,
autoscaling that reacts in seconds, one thread per replica. Run it as the first process of a PID namespace of its
own (`python -m benchmarks.serve.elastic_cycle --out FILE` through fake_cluster.isolated_command); the elastic
benchmark (run_elastic.py) and tests/test_elastic_cluster.py do.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import yaml

from benchmarks.serve.fake_cluster import FakeAutoscalingCluster, NodeType
from engine.free_ports import free_port

ROOT = Path(__file__).resolve().parent.parent.parent
NODE_RESOURCE = "llm_node"
QUESTION = "What is the capital of Italy?"


@dataclass(frozen=True)
class Phase:
    streams: int  # concurrent closed-loop streams
    seconds: float  # how long, counted from when the phase's condition holds (peak: the last replica serving)


@dataclass(frozen=True)
class Profile:
    """The load: `rise` until the deployment runs `max_replicas`, then `peak` held, then `fall`, then none.
    Requests name the base model and the adapters, Zipf-skewed in that order: the shipped pirate adapter alone, or
    `random_adapters` random ones (benchmarks/lora_adapters.py)."""
    rise: Phase
    peak: Phase
    fall: Phase = Phase(0, 0)
    random_adapters: int = 0
    zipf: float = 1.1
    max_tokens: int = 24
    max_replicas: int = 2
    idle_timeout_s: float = 10.0
    downscale_delay_s: float = 5.0

    @property
    def adapters(self) -> tuple[str, ...]:
        return tuple(f"rand-{i:02d}" for i in range(self.random_adapters)) if self.random_adapters else ("pirate",)


PROFILES = {"quick": Profile(Phase(12, 0), Phase(12, 4), idle_timeout_s=6, downscale_delay_s=3),
            "zipf": Profile(Phase(16, 0), Phase(16, 30), Phase(4, 20), random_adapters=32, max_tokens=32)}


@dataclass
class Sample:
    t: float  # seconds since the cluster started
    nodes: int  # worker nodes alive
    replicas: int  # engine replicas running
    done: int  # requests finished so far
    failed: int
    tokens: int


@dataclass
class Outcome:
    model: str
    status: int
    ttft_s: float | None
    tokens: int
    text: str
    t_end: float


@dataclass
class Cycle:
    """What one cycle shows: the timeline, each request's outcome, and when each milestone came."""
    samples: list[Sample] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    events: dict[str, float] = field(default_factory=dict)  # milestone -> seconds since the cluster started
    placement: dict[str, bool] = field(default_factory=dict)  # cluster-wide actor -> on the head node
    # adapter -> the replicas (replica@node) that held it at the peak, and the reads of it from its source
    adapter_replicas: dict[str, list[str]] = field(default_factory=dict)
    source_loads: dict[str, int] = field(default_factory=dict)


def cycle_config(profile: Profile, port: int, adapters_root: Path) -> dict:
    """serve_config.yaml, adapted to this cluster: its engine replicas on the worker nodes, one thread each, a
    small KV cache, autoscaling that reacts within seconds, and an adapter spread to another replica from a few
    concurrent requests, as a larger load would spread it."""
    spec = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    spec["http_options"] = {"host": "127.0.0.1", "port": port}
    env = spec["controller_options"]["runtime_env"]["env_vars"]
    first = free_port()  # the direct-ingress range: one port per replica and the ingress request router
    env.update({"RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(first),
                "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(first + 2 * profile.max_replicas + 4)})
    app = spec["applications"][0]
    app["args"]["engine"].update(kv_cache_bytes=64 << 20, max_num_seqs=16, num_threads=1,
                                 adapters_root=str(adapters_root))
    app["args"]["replica_resources"] = {NODE_RESOURCE: 1}
    app["args"]["routing"]["hot_adapter_requests"] = 2  # a few streams of one adapter spread it to a second node
    scaling = app["deployments"][0]["autoscaling_config"]
    scaling.update(min_replicas=1, max_replicas=profile.max_replicas, metrics_interval_s=1, look_back_period_s=2,
                   upscale_delay_s=1, downscale_delay_s=profile.downscale_delay_s)
    scaling["policy"]["policy_kwargs"]["target_running_per_replica"] = 4
    return spec


class Load:
    """Closed-loop streams of chat requests in a thread of their own; their number is set as the profile goes."""

    def __init__(self, url: str, base_model: str, profile: Profile, started: float, seed: int = 0):
        self.url, self.base_model, self.profile, self.started = url, base_model, profile, started
        self.outcomes: list[Outcome] = []
        self.streams = 0
        self.in_flight = 0
        self._random = random.Random(seed)
        self._weights = [1 / (rank + 1) ** profile.zipf for rank in range(len(profile.adapters) + 1)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.streams = 0
        self._stop.set()
        self._thread.join(timeout=300)

    async def _run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            tasks: list[asyncio.Task] = []
            while not self._stop.is_set():
                tasks = [t for t in tasks if not t.done()]
                tasks += [asyncio.create_task(self._stream(session, len(tasks) + i))
                          for i in range(self.streams - len(tasks))]
                await asyncio.sleep(0.2)
            await asyncio.gather(*tasks)

    async def _stream(self, session: aiohttp.ClientSession, slot: int) -> None:
        """One stream: requests one after another while the load keeps this slot."""
        while slot < self.streams:
            model = self._random.choices([self.base_model, *self.profile.adapters], self._weights)[0]
            self.in_flight += 1
            self.outcomes.append(await self._ask(session, model))
            self.in_flight -= 1

    async def _ask(self, session: aiohttp.ClientSession, model: str) -> Outcome:
        body = {"model": model, "messages": [{"role": "user", "content": QUESTION}],
                "max_tokens": self.profile.max_tokens, "temperature": 0, "stream": True}
        start, first, texts, status = time.monotonic(), None, [], 0
        try:
            async with session.post(f"{self.url}/v1/chat/completions", json=body) as response:
                status = response.status
                async for line in response.content:
                    delta = _delta(line)
                    if delta:
                        first = first or time.monotonic()
                        texts.append(delta)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            status = status or -1
        ttft = first - start if first else None
        return Outcome(model, status, ttft, len(texts), "".join(texts), time.monotonic() - self.started)


def _delta(line: bytes) -> str:
    """The text of one server-sent chat chunk ('' for others); an error event raises, failing the request."""
    if not line.startswith(b"data: {"):
        return ""
    chunk = json.loads(line[len(b"data: "):])
    if "error" in chunk:
        raise aiohttp.ClientPayloadError(str(chunk["error"])[:200])
    choices = chunk.get("choices") or [{}]
    return choices[0].get("delta", {}).get("content") or ""


class Sampler:
    """Every second: the worker nodes alive, the engine replicas running, and the load's totals."""

    def __init__(self, cycle: Cycle, load: Load, started: float):
        self.cycle, self.load, self.started = cycle, load, started
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            outcomes = list(self.load.outcomes)
            self.cycle.samples.append(Sample(
                time.monotonic() - self.started, len(FakeAutoscalingCluster.workers(NODE_RESOURCE)),
                running_replicas(), len(outcomes), sum(o.status != 200 for o in outcomes),
                sum(o.tokens for o in outcomes)))


def running_replicas() -> int:
    from ray import serve

    try:
        deployment = serve.status().applications["lora-serve"].deployments["LLMServer"]
    except (KeyError, RuntimeError):
        return 0
    return deployment.replica_states.get("RUNNING", 0)


def wait_for(what: str, condition, timeout_s: float, cycle: Cycle, started: float, poll_s: float = 0.5) -> None:
    """Until condition() holds, recording when it did as the milestone `what`; TimeoutError naming it."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(poll_s)
    cycle.events[what] = round(time.monotonic() - started, 1)
    print(f"[elastic] {cycle.events[what]:7.1f} s  {what}", flush=True)


def healthy(url: str) -> bool:
    import requests

    try:
        return requests.get(f"{url}/health", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def run_cycle(profile: Profile, folder: Path) -> Cycle:
    """The whole cycle on a fresh fake cluster: up from no worker node, load, and back to one node."""
    cycle, port = Cycle(), free_port()
    folder.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port}"
    config = folder / "serve_config.yaml"
    spec = cycle_config(profile, port, adapters_root(profile, folder / "adapters"))
    config.write_text(yaml.safe_dump(spec))
    node = NodeType(cpus=1, resources={NODE_RESOURCE: 1}, max_workers=profile.max_replicas)
    with FakeAutoscalingCluster(folder, free_port(), 1, {"engine": node}, profile.idle_timeout_s) as cluster:
        started = time.monotonic()
        import ray

        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        log = (folder / "serve.log").open("w")
        server = subprocess.Popen(["serve", "run", "--address", cluster.address, str(config)], cwd=ROOT,
                                  stdout=log, stderr=subprocess.STDOUT)
        load = Load(url, spec["applications"][0]["args"]["engine"]["model"], profile, started)
        sampler = Sampler(cycle, load, started)
        try:
            _drive(cycle, profile, url, load, started)
        finally:
            load.close()
            sampler.close()
            cycle.outcomes = load.outcomes
            server.kill()  # the namespace's end takes Serve and the cluster with it
    return cycle


def adapters_root(profile: Profile, folder: Path) -> Path:
    """The shipped adapters' folder, or one of the profile's random adapters for the embedded model."""
    if not profile.random_adapters:
        return ROOT / "examples" / "adapters"
    from transformers import AutoConfig

    from benchmarks.lora_adapters import write_random_adapter
    from engine.config import default_cache_dir
    from engine.model_files import resolve_model

    config = AutoConfig.from_pretrained(resolve_model("smollm2-135m-instruct", default_cache_dir() / "models"))
    for seed, name in enumerate(profile.adapters):
        write_random_adapter(folder / name, config, seed=seed)
    return folder


def _drive(cycle: Cycle, profile: Profile, url: str, load: Load, started: float) -> None:
    workers = lambda: len(FakeAutoscalingCluster.workers(NODE_RESOURCE))  # noqa: E731
    wait_for("first worker node", lambda: workers() >= 1, 120, cycle, started)
    wait_for("serving", lambda: healthy(url), 300, cycle, started)
    cycle.placement = head_placement()
    load.streams = profile.rise.streams
    cycle.events["load rises"] = round(time.monotonic() - started, 1)
    wait_for(f"{profile.max_replicas} worker nodes", lambda: workers() >= profile.max_replicas, 180, cycle, started)
    wait_for(f"{profile.max_replicas} replicas running", lambda: running_replicas() >= profile.max_replicas, 300,
             cycle, started)
    load.streams = profile.peak.streams
    time.sleep(profile.peak.seconds)
    cycle.adapter_replicas, cycle.source_loads = adapter_holders()
    load.streams = profile.fall.streams
    cycle.events["load falls"] = round(time.monotonic() - started, 1)
    time.sleep(profile.fall.seconds)
    load.streams = 0
    wait_for("load stops", lambda: load.in_flight == 0, 120, cycle, started)
    wait_for("1 replica running", lambda: running_replicas() == 1, 120, cycle, started)
    wait_for("1 worker node", lambda: workers() == 1, profile.idle_timeout_s + 120, cycle, started)
    time.sleep(3)  # a few samples of the cluster as it stays


def adapter_holders() -> tuple[dict[str, list[str]], dict[str, int]]:
    """From the cluster's adapter cache: per adapter, the replicas holding it (device or CPU copy), and how often
    it was read from its source."""
    import ray

    from lora_cache.actor import ACTOR_NAME

    [actor] = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"] == ACTOR_NAME]
    stats = ray.get(ray.get_actor(ACTOR_NAME, namespace=actor["namespace"]).stats.remote())
    holders = {name: sorted(set(where.device_replicas + where.cpu_replicas))
               for name, where in stats.residence().items()}
    return holders, dict(stats.load_counts)


def head_placement() -> dict[str, bool]:
    """Whether each cluster-wide actor that exists runs on the head node (deployments/control_node.py)."""
    import ray

    from deployments.control_node import HEAD_NODE
    from deployments.gate.ray_ledger import LEDGER_NAME
    from lora_cache.actor import ACTOR_NAME

    head = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and HEAD_NODE in n["Resources"])
    on_head = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith((ACTOR_NAME, LEDGER_NAME)):
            handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
            node = ray.get(handle.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()))
            on_head[actor["name"]] = node == head
    return on_head


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the cycle's JSON (samples, outcomes, events)")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="quick", help="the load (PROFILES)")
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cycle = run_cycle(PROFILES[args.profile], args.out.parent / "cluster")
    args.out.write_text(json.dumps(asdict(cycle)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
