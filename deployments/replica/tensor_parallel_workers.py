"""A replica's tensor-parallel workers as Ray actors in its placement group: the engine's WorkerLauncher and
WorkerGroup (engine/executor/workers.py), implemented over Ray.

Serve starts a replica in bundle 0 of its placement group (placement_group_bundles, one bundle per worker:
deployments/app.py sets them from tensor_parallel_size, a serve config may set its own). Rank r's actor takes
bundle r and every resource in it (its CPUs, its GPU on CUDA), so Ray accounts for each worker, and the group is
packed on one node unless placement_group_strategy says otherwise. The actors belong to the replica: when Serve
stops or replaces it, Ray ends them with it. Each actor spends its life in one call of the engine's worker loop;
that call ending (the loop's error, or the actor's process gone) is how a dead worker shows, by rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
import torch
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayError
from ray.util.placement_group import PlacementGroup, get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine.executor.worker import WorkerSpec, worker_main
from engine.executor.workers import STOP_TIMEOUT_S, WorkerDiedError

SCHEDULER_RESOURCES = ("CPU", "GPU", "memory")  # a bundle's resources the actor asks for by their own options


class TensorParallelWorker:
    """One rank's process: built on its first call, which runs the worker loop until the driver stops it."""

    def run(self, spec: WorkerSpec) -> None:
        worker_main(spec)


RemoteWorker = ray.remote(max_restarts=0, max_task_retries=0)(TensorParallelWorker)


class RayWorkerLauncher:
    """Ranks 1..N-1 in bundles 1..N-1 of the calling replica's placement group."""

    def host(self) -> str:
        return ray.util.get_node_ip_address()

    def devices(self, size: int, device: torch.device) -> list[torch.device]:
        """On CUDA, Ray shows each actor (the replica too) only its own bundle's GPU: cuda:0 to every rank."""
        if device.type != "cuda":
            return [device] * size
        group = get_current_placement_group()
        gpus = [bundle.get("GPU", 0) for bundle in (group.bundle_specs if group is not None else [])][:size]
        if len(gpus) < size or min(gpus) < 1:
            raise ValueError(f"tensor_parallel_size {size} on CUDA needs a GPU in each of {size} placement-group "
                             f"bundles; this replica's has {sum(g >= 1 for g in gpus)} (tensor_parallel.worker_gpus)")
        return [torch.device("cuda", 0)] * size

    def start(self, specs: list[WorkerSpec]) -> RayWorkers:
        group = get_current_placement_group()
        size = len(specs) + 1
        bundles = group.bundle_specs if group is not None else []
        if len(bundles) < size:
            raise ValueError(f"tensor_parallel_size {size} needs a placement group of {size} bundles, one per "
                             f"worker; this replica's has {len(bundles)} (set placement_group_bundles)")
        actors = [_worker_actor(group, spec.rank, bundles[spec.rank]) for spec in specs]
        return RayWorkers(actors, [actor.run.remote(spec) for actor, spec in zip(actors, specs)])


def _worker_actor(group: PlacementGroup, rank: int, bundle: dict[str, float]) -> ActorHandle:
    custom = {name: amount for name, amount in bundle.items() if name not in SCHEDULER_RESOURCES}
    strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
    return RemoteWorker.options(num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), resources=custom,
                                scheduling_strategy=strategy).remote()


@dataclass
class RayWorkers:
    actors: list[ActorHandle]  # ranks 1..N-1, in order
    runs: list[ray.ObjectRef]  # each actor's worker loop: it ends only when the worker stops or dies

    def check(self, grace_s: float = 0.0) -> None:
        ended, _ = ray.wait(self.runs, num_returns=1, timeout=grace_s)
        if ended:
            rank = self.runs.index(ended[0]) + 1
            raise WorkerDiedError(f"tensor-parallel worker rank {rank} (a Ray actor) {_how_it_ended(ended[0])}: the "
                                  f"engine cannot run its shard without it")

    def alive(self) -> bool:
        ended, _ = ray.wait(self.runs, num_returns=1, timeout=0)
        return not ended

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout_s)
        for actor in self.actors:
            ray.kill(actor)


def _how_it_ended(run: ray.ObjectRef) -> str:
    """The worker loop's end, by the error's kind alone: Ray's messages name hosts, process ids and paths."""
    try:
        ray.get(run, timeout=0)
    except GetTimeoutError:
        return "is stopping"
    except RayError as exc:
        return f"died ({type(exc).__name__})"
    return "left its loop"
