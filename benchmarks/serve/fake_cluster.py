"""A Ray cluster whose worker nodes Ray's own autoscaler adds and removes, on this one machine.

Ray's fake multi-node provider (`ray.autoscaler._private.fake_multi_node`) starts each worker node as a raylet on
this machine when the autoscaler launches one, and stops it when the autoscaler terminates it, as KubeRay's in-tree
autoscaler does with pods. The head is started by `ray start --head --autoscaling-config`, with a config written
here (the provider's example config is not in Ray's wheel). The cluster ends with the process that started it: that
process is the first of a PID namespace of its own (`unshare --pid --fork --mount-proc`, `isolated_command`), and the
kernel kills every process left in the namespace when it exits. No Ray process outside it is touched, where
`ray stop` would kill every one on the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import ray

ENV = {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_AUTH_MODE": "token"}


@dataclass(frozen=True)
class NodeType:
    """A worker node type: what each node of it offers, and how many the autoscaler may run."""
    cpus: int
    resources: dict[str, float] = field(default_factory=dict)
    max_workers: int = 2


def isolated_command(argv: list[str]) -> list[str]:
    """argv run as the first process of a PID namespace of its own, with its own /proc, in the environment the
    fake provider needs (Ray reads it as it is imported, so it is set before the process starts)."""
    return ["env", *(f"{k}={v}" for k, v in ENV.items()), "unshare", "--pid", "--fork", "--mount-proc", *argv]


def in_own_pid_namespace() -> bool:
    return os.getpid() == 1


class FakeAutoscalingCluster:
    """The head (its CPUs, which engine replicas never ask for) and worker node types that start at 0 nodes."""

    def __init__(self, folder: Path, port: int, head_cpus: int, node_types: dict[str, NodeType],
                 idle_timeout_s: float):
        if not in_own_pid_namespace() or any(os.environ.get(k) != v for k, v in ENV.items()):
            raise RuntimeError("a fake autoscaling cluster ends with its PID namespace: run it through "
                               "isolated_command, as the first process of a namespace of its own")
        self.folder, self.port, self.head_cpus = folder, port, head_cpus
        self.node_types, self.idle_timeout_s = node_types, idle_timeout_s
        self.address = f"{ray.util.get_node_ip_address()}:{port}"

    def config(self) -> dict:
        workers = {name: {"resources": {"CPU": t.cpus, **t.resources}, "node_config": {}, "min_workers": 0,
                          "max_workers": t.max_workers} for name, t in self.node_types.items()}
        head = {"resources": {"CPU": self.head_cpus}, "node_config": {}, "max_workers": 0}
        empty_lists = ("cluster_synced_files", "rsync_exclude", "rsync_filter", "initialization_commands",
                       "setup_commands", "head_setup_commands", "worker_setup_commands", "head_start_ray_commands",
                       "worker_start_ray_commands")
        return {"cluster_name": "fake", "max_workers": sum(t.max_workers for t in self.node_types.values()),
                "upscaling_speed": 1.0, "idle_timeout_minutes": self.idle_timeout_s / 60,
                # the provider's nodes are up once started: no updater sets them up (it would try to tag them,
                # which the fake provider refuses, and the autoscaler would terminate them as failed launches)
                "provider": {"type": "fake_multinode", "gcs_address": self.address, "disable_node_updaters": True,
                             "disable_launch_config_check": True, "use_node_id_as_ip": True},
                "auth": {"ssh_user": "ray"}, "docker": {}, "head_node_type": "ray.head.default",
                "available_node_types": {"ray.head.default": head, **workers}, "file_mounts": {},
                "file_mounts_sync_continuously": False, **{key: [] for key in empty_lists}}

    def __enter__(self) -> FakeAutoscalingCluster:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / "autoscaling.json"
        path.write_text(json.dumps(self.config()))
        # Ray's sockets live under RAY_TMPDIR, and AF_UNIX paths may not exceed 107 bytes: a short folder of its
        # own, which the worker nodes the autoscaler starts inherit too
        self.ray_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        os.environ["RAY_TMPDIR"] = self.ray_dir  # for this process's Ray client, and what it starts
        subprocess.run([shutil.which("ray") or "ray", "start", "--head", f"--port={self.port}",
                        f"--num-cpus={self.head_cpus}", f"--autoscaling-config={path}", "--include-dashboard=false",
                        "--disable-usage-stats"], check=True, stdout=subprocess.DEVNULL, stderr=sys.stderr)
        return self

    def __exit__(self, *exc) -> None:
        """Nothing of the cluster is stopped here: this process is its namespace's first, and when it exits the
        kernel kills every process left in the namespace (`ray stop` would wait out its grace period on the
        processes that this process, which reaps none, left as zombies)."""
        if ray.is_initialized():
            ray.shutdown()
        logs = Path(self.ray_dir) / "session_latest" / "logs"
        if logs.is_dir():  # the replicas' own tracebacks, kept beside the run
            shutil.copytree(logs, self.folder / "ray-logs", dirs_exist_ok=True, ignore_dangling_symlinks=True)
        shutil.rmtree(self.ray_dir, ignore_errors=True)

    @staticmethod
    def workers(resource: str) -> list[str]:
        """The ids of the live nodes that offer `resource` (the worker type's own)."""
        return [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(resource, 0) > 0]
