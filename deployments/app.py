"""build_app(args): the import_path target of serve_config.yaml."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import ray
from pydantic import Field, ValidationError
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from deployments.api.strict import StrictModel
from deployments.control_node import HEAD_NODE, ControlPlacement
from deployments.gate.auth import ApiKeyConfig, KeyRing
from deployments.gate.gate import MAX_REQUEST_BYTES, GateConfig
from deployments.replica.llm_server import LLMServer
from deployments.replica.openmp import replica_env_vars
from deployments.replica.pacing import STREAM_INTERVAL_MS
from deployments.replica.tracing import TracingConfig
from deployments.routing.direct_ingress import direct_ingress_env, haproxy_enabled
from deployments.routing.ingress_router import AdapterRouter
from deployments.routing.policy import RoutingPolicy
from deployments.routing.request_router import router_config
from engine import host_heap
from engine.config import EngineConfig


class RoutingArgs(StrictModel):
    """How requests find a replica (deployments/routing/policy.py)."""
    router: Literal["lora_aware", "multiplex"] = Field(
        "lora_aware", description="lora_aware: by adapter residence, cached prefix and load; multiplex: Ray "
        "Serve's own router (power of two choices, preferring replicas that loaded the adapter named in the "
        "serve_multiplexed_model_id header), each request served where it lands")
    imbalance: int = Field(8, ge=0, description="requests above the least loaded replica's that adapter "
                           "residence and a cached prefix may outweigh")
    hot_adapter_requests: int | None = Field(
        16, ge=1, description="an adapter's requests on every replica holding it past which it spreads and is "
        "preloaded onto another replica (deployments/routing/replication.py); null: never, residence alone routes")
    kv_high: float = Field(0.9, gt=0, le=1, description="a replica whose KV cache is this full ranks last")

    def policy(self) -> RoutingPolicy | None:
        if self.router != "lora_aware":
            return None
        return RoutingPolicy(self.imbalance, self.hot_adapter_requests, self.kv_high)


class TracingArgs(StrictModel):
    """Per-request OpenTelemetry traces (deployments/replica/tracing.py), as vLLM's --otlp-traces-endpoint."""
    otlp_traces_endpoint: str | None = Field(
        None, min_length=1, description="where replicas send their spans over OTLP (grpc: http://host:4317, "
        "plaintext, or https://host:4317; http/protobuf: the full URL, http://host:4318/v1/traces); None: tracing "
        "off. OTEL_EXPORTER_OTLP_* variables in the replicas' environment set headers, certificates and timeouts")
    protocol: Literal["grpc", "http/protobuf"] = Field("grpc", description="the OTLP transport")
    service_name: str = Field("lora-serve", min_length=1, description="the traces' service.name")
    sample_ratio: float = Field(1.0, ge=0, le=1, description="the share of traces kept; a request that carries a "
                                "traceparent follows its sampled flag")

    def config(self) -> TracingConfig:
        return TracingConfig(self.otlp_traces_endpoint, self.protocol, self.service_name, self.sample_ratio)


class TensorParallelArgs(StrictModel):
    """Where a replica's tensor-parallel workers run (engine.tensor_parallel_size N > 1): one placement-group bundle
    per worker, the replica itself in the first (deployments/replica/tensor_parallel_workers.py). A serve config's
    placement_group_bundles for LLMServer replace these."""
    worker_cpus: float = Field(1.0, gt=0, description="CPUs in each worker's bundle, the replica's own included")
    worker_gpus: int | None = Field(None, ge=0, le=1, description="GPUs in each worker's bundle; None: 1 where "
                                    "engine.device is cuda, else 0")
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "STRICT_PACK", description="Ray's placement of the bundles: STRICT_PACK keeps a replica's workers on one "
        "node, where their all-reduces stay off the network")

    def gpus(self, device: str) -> int:
        return self.worker_gpus if self.worker_gpus is not None else int(device.startswith("cuda"))

    def options(self, size: int, device: str = "cpu", custom: dict[str, float] | None = None) -> dict:
        """The engine deployment's placement options for N workers on `device` (the device option), each bundle
        with the `custom` resources too (replica_resources); none at N = 1."""
        if size == 1:
            return {}
        bundle = {"CPU": self.worker_cpus, **({"GPU": self.gpus(device)} if self.gpus(device) else {}),
                  **(custom or {})}
        return {"placement_group_bundles": [dict(bundle) for _ in range(size)],
                "placement_group_strategy": self.placement_strategy}

    def refuse_too_few_gpus(self, size: int, device: str) -> None:
        """N GPU workers packed on one node (STRICT_PACK) need a node of the connected cluster with N GPUs: refused
        at start, naming both numbers, rather than a replica waiting for a group that never fits."""
        if size == 1 or not self.gpus(device) or self.placement_strategy != "STRICT_PACK" or not ray.is_initialized():
            return
        most = max((node["Resources"].get("GPU", 0) for node in ray.nodes() if node["Alive"]), default=0)
        if most < size:
            raise ValueError(f"tensor_parallel_size {size} packs {size} GPUs on one node; the cluster's largest "
                             f"node has {int(most)}")


class AppArgs(StrictModel):
    engine: dict = Field(default_factory=dict, description="EngineConfig fields (model, dtype, kv_cache_bytes, ...)")
    api_keys: list[ApiKeyConfig] = Field(default_factory=list, description="keys, their scopes and limits; none: "
                                         "the server is open (deployments/gate/auth.py)")
    api_keys_file: str | None = Field(None, description="a YAML or JSON file holding a list of api_keys entries")
    max_request_bytes: int = Field(MAX_REQUEST_BYTES, ge=1024, description="a larger request body gets 413")
    routing: RoutingArgs = Field(default_factory=RoutingArgs, description="which replica serves a request (below)")
    stream_interval_ms: float = Field(STREAM_INTERVAL_MS, gt=0, le=10_000,
                                      description="the longest a streamed response that is producing tokens waits "
                                                  "between events; under load an event holds several tokens "
                                                  "(deployments/replica/pacing.py)")
    tracing: TracingArgs = Field(default_factory=TracingArgs, description="per-request OpenTelemetry traces "
                                 "(below); off without an endpoint")
    tensor_parallel: TensorParallelArgs = Field(default_factory=TensorParallelArgs, description="where a "
                                                "replica's tensor-parallel workers run (below)")
    replica_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources each engine replica asks for, beside its CPUs and "
        "GPU: replicas run only on the nodes that carry them (a node type's own, such as llm_node). A serve "
        "config's ray_actor_options for LLMServer replace build_app's options whole, its runtime_env included; "
        "this adds to them")
    control_resource: str | None = Field(
        HEAD_NODE, min_length=1, description="the nodes where the application's cluster-wide actors run (the "
        "adapter cache actor, the quota ledger): those carrying this Ray resource; by "
        "default the head node's own, so that no node that scale-up added for engine replicas is kept by them; a "
        "custom resource names a node type (KubeRay: a worker group's rayStartParams resources); null: wherever "
        "Ray places them, engine nodes included (deployments/control_node.py)")

    def control(self) -> ControlPlacement:
        return ControlPlacement(self.control_resource)

    def gate(self) -> GateConfig:
        ring = KeyRing.from_config(self.api_keys, self.api_keys_file)  # ValueError: duplicate names or keys
        return GateConfig(ring.keys, self.max_request_bytes)


@dataclass(frozen=True)
class CheckedArgs:
    """An application's args, parsed and checked as build_app uses them."""
    args: AppArgs
    engine: EngineConfig
    gate: GateConfig


class InvalidArgs(ValueError):
    """An application's args refused: one reason per field, each naming the field and no value given."""

    def __init__(self, reasons: list[str]):
        super().__init__(f"invalid lora-serve application args: {'; '.join(reasons)}")
        self.reasons = reasons


def check_args(args: dict | None) -> CheckedArgs:
    """The args parsed and every engine option validated, here rather than in a replica; InvalidArgs with the
    reasons (deployments/check.py runs this offline, before any process of Ray starts)."""
    parsed = _field("args", lambda: AppArgs(**(args or {})))
    engine = _field("engine", lambda: EngineConfig.from_overrides(**parsed.engine))
    gate = _field("api_keys", parsed.gate)
    _field("tensor_parallel", lambda: parsed.tensor_parallel.refuse_too_few_gpus(
        engine.backend.tensor_parallel_size, engine.backend.device))
    return CheckedArgs(parsed, engine, gate)


def _field(name: str, parse):
    """parse(), its refusal raised as InvalidArgs naming the field (pydantic's name the fields within)."""
    try:
        return parse()
    except (ValidationError, TypeError, ValueError, OSError) as exc:
        raise InvalidArgs(_reasons(name, exc)) from None


def build_app(args: dict | None = None) -> Application:
    checked = check_args(args)
    parsed, engine, gate = checked.args, checked.engine, checked.gate
    policy = parsed.routing.policy()
    router = router_config(policy) if policy is not None else RequestRouterConfig()  # Serve's own by default
    placement = parsed.tensor_parallel.options(engine.backend.tensor_parallel_size, engine.backend.device,
                                               parsed.replica_resources)
    actor = _engine_actor_options(placement["placement_group_bundles"][0] if placement else {"CPU": 1},
                                  parsed.replica_resources)
    server = LLMServer.options(ray_actor_options=actor, request_router_config=router, **placement).bind(
        parsed.engine, gate=gate, routing=policy, stream_interval_ms=parsed.stream_interval_ms,
        tracing=parsed.tracing.config(), control=parsed.control())
    if not haproxy_enabled():
        return server
    return with_ingress_router(server, engine.model.name)


def _reasons(field: str, exc: Exception) -> list[str]:
    """Why the args were refused, without the values given: pydantic's own text repeats each input, and an input
    may be a secret (an api key written in clear, which is refused)."""
    if not isinstance(exc, ValidationError):
        return [f"{field}: {exc}"]
    return [f"{'.'.join(map(str, e['loc'])) or field}: {e['msg']}"
            for e in exc.errors(include_input=False, include_url=False)]


def with_ingress_router(server: Application, model_name: str) -> Application:
    """The engine app with the router HAProxy asks for each request's replica (deployments/routing/ingress_router.py),
    through Ray 2.60's private hook for it. It takes a port of the direct-ingress range and no CPU. Serve places its
    replicas itself, one on each node that runs a proxy (the head, and each node while it holds engine replicas), and
    stops a node's one when its engine replicas are gone, so it keeps no node up."""
    router = AdapterRouter.options(ray_actor_options={"num_cpus": 0,
                                                      "runtime_env": {"env_vars": direct_ingress_env()}})
    return server._with_ingress_request_router(router.bind(server, model_name))


def _engine_actor_options(bundle: dict[str, float], custom: dict[str, float] | None = None) -> dict:
    """An engine replica's resources (1 CPU, or one tensor-parallel bundle's CPUs and GPU, and the `custom` ones),
    its process started on Intel's OpenMP runtime (deployments/replica/openmp.py) and, on CPU, with malloc keeping
    the memory its steps free (engine/host_heap.py), and Serve's direct-ingress settings when the controller has them
    (deployments/routing/direct_ingress.py). A serve config's ray_actor_options for LLMServer replace these: keep
    the runtime_env there, or give replica_resources instead."""
    heap = {} if "GPU" in bundle else host_heap.process_env(os.environ.get("GLIBC_TUNABLES"))
    env_vars = {**replica_env_vars(), **heap, **direct_ingress_env()}
    resources = {"num_cpus": bundle["CPU"], **({"num_gpus": bundle["GPU"]} if "GPU" in bundle else {}),
                 **({"resources": custom} if custom else {})}
    return {**resources, **({"runtime_env": {"env_vars": env_vars}} if env_vars else {})}
