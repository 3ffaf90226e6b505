"""`serve run` of the shipped serve_config.yaml, as a user or a service manager runs it: in a session of its own,
its own Ray cluster, HAProxy on its port, stopped by a signal to its process group.

The config is serve_config.yaml with the tiny model, free ports and API keys given every way the config may give
them: a hash inline, an environment variable, a file, and a file of hashes. No key reaches any file under Ray's
session folder (the controller's build log, which lists the app's arguments, the replicas', the workers' .out and
.err), `serve run`'s output, Ray's or HAProxy's metrics, or a response. Stopped by SIGTERM, then started again at
once and stopped by SIGINT, it leaves no HAProxy process and no listener on its ports.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import requests
import yaml

from deployments.gate.auth import hash_key
from deployments.routing.haproxy_launcher import install
from tests.helpers import write_tiny_adapters

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parent.parent
SECRETS = {"inline": "inline-key-0123456789abcdef", "env": "env-key-0123456789abcdef",
           "file": "file-key-0123456789abcdef", "listed": "listed-key-0123456789abcdef"}
KEY_ENV = "LORA_SERVE_TEST_ENV_KEY"
START_S = 240  # Ray, Serve, the replica and HAProxy on 2 busy cores
STOP_S = 60
REPLICA_PORTS = 16  # Serve skips a port it finds taken, for good: room for a few


@dataclass(frozen=True)
class Ports:
    http: int
    haproxy_stats: int
    haproxy_metrics: int
    first_replica: int  # the direct-ingress range: this and the REPLICA_PORTS - 1 next

    def all(self) -> list[int]:
        return [self.http, self.haproxy_stats, self.haproxy_metrics,
                *range(self.first_replica, self.first_replica + REPLICA_PORTS)]


@dataclass
class ServeRun:
    process: subprocess.Popen
    output: Path
    ray_temp: Path  # RAY_TMPDIR: Ray's folder is ray/ in it
    started: float  # time.time() when it started: the HAProxy processes it made are younger


@pytest.fixture(scope="module")
def app_config(tiny_llama_path, tmp_path_factory) -> tuple[Path, Ports]:
    """serve_config.yaml with the tiny model, two adapters, free ports and keys given each way, one replica."""
    folder = tmp_path_factory.mktemp("serve-run")
    adapters = write_tiny_adapters(tiny_llama_path, folder / "adapters", ("alpha",))
    (folder / "file.key").write_text(SECRETS["file"] + "\n")
    listed = [{"name": "listed", "key_sha256": hash_key(SECRETS["listed"]).hex()}]
    (folder / "keys.yaml").write_text(yaml.safe_dump(listed))
    base = _free_block(3 + REPLICA_PORTS)
    ports = Ports(base, base + 1, base + 2, base + 3)
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["controller_options"]["runtime_env"]["env_vars"].update({
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(ports.first_replica),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(ports.first_replica + REPLICA_PORTS - 1),
        "RAY_SERVE_HAPROXY_STATS_PORT": str(ports.haproxy_stats),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(ports.haproxy_metrics)})
    config["http_options"] = {"host": "127.0.0.1", "port": ports.http}
    [app] = config["applications"]
    app["args"] = {"engine": {"model": str(tiny_llama_path), "log_stats": False, "num_threads": 1, "max_loras": 2,
                              "adapters_root": str(adapters)},
                   "api_keys": [{"name": "inline", "key_sha256": hash_key(SECRETS["inline"]).hex()},
                                {"name": "env", "key_env": KEY_ENV},
                                {"name": "file", "key_file": str(folder / "file.key")}],
                   "api_keys_file": str(folder / "keys.yaml")}
    [deployment] = app["deployments"]
    deployment.pop("autoscaling_config")
    deployment["num_replicas"] = 1
    path = folder / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    install()  # the HAProxy launcher serve_config.yaml names (.ci/install.sh writes it too)
    return path, ports


def _free_block(count: int) -> int:
    """The first of `count` consecutive free ports below Linux's ephemeral range: Ray's own connections take
    ephemeral ports, and Serve blocks a replica port it finds taken, so a block among them may run out."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32000 - count)
        if all(_bindable(port) for port in range(base, base + count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports in 20000-32000")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _start(config: Path, ports: Ports) -> ServeRun:
    # a short Ray folder: its sockets' paths must fit a Unix socket's 107 bytes
    ray_temp = Path(tempfile.mkdtemp(prefix="lsr-", dir="/tmp"))
    output = ray_temp / "serve-run.out"
    env = {**os.environ, "RAY_TMPDIR": str(ray_temp), KEY_ENV: SECRETS["env"]}
    with output.open("wb") as out:
        process = subprocess.Popen([shutil.which("serve") or "serve", "run", str(config)], cwd=ROOT, env=env,
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    run = ServeRun(process, output, ray_temp, time.time())
    try:
        _wait_serving(run, ports)
    except BaseException:
        _kill(run)
        raise
    return run


def _wait_serving(run: ServeRun, ports: Ports) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        assert run.process.poll() is None, f"serve run exited: {run.output.read_text()[-3000:]}"
        try:
            if _get(ports, "/v1/models", SECRETS["inline"]).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    raise TimeoutError(f"serve run did not serve in {START_S} s: {run.output.read_text()[-3000:]}")


def _get(ports: Ports, path: str, key: str | None) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.get(f"http://127.0.0.1:{ports.http}{path}", headers=headers, timeout=30)


def _complete(ports: Ports, key: str, model: str = "alpha") -> requests.Response:
    return requests.post(f"http://127.0.0.1:{ports.http}/v1/completions", timeout=60,
                         json={"model": model, "prompt": "hi", "max_tokens": 3},
                         headers={"Authorization": f"Bearer {key}"})


def _stop(run: ServeRun, signum: int) -> None:
    """Signal serve run's process group, as a service manager or a shell's job control does, and wait for it."""
    os.killpg(run.process.pid, signum)
    try:
        run.process.wait(STOP_S)
    except subprocess.TimeoutExpired:
        _kill(run)
        raise AssertionError(f"serve run did not stop within {STOP_S} s of signal {signum}") from None


def _kill(run: ServeRun) -> None:
    """What this test started, by id: serve run's group, and the HAProxy processes its cluster made."""
    try:
        os.killpg(run.process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for process in _haproxies(run):
        process.kill()


def _haproxies(run: ServeRun) -> list[psutil.Process]:
    """Live HAProxy processes younger than this serve run."""
    found = []
    for process in psutil.process_iter(["name", "create_time", "status", "cmdline"]):
        info = process.info
        if (info["name"] or "").startswith("haproxy") and info["create_time"] >= run.started - 1 \
                and info["status"] != psutil.STATUS_ZOMBIE:
            found.append(process)
    return found


def _listening(ports: Ports) -> set[int]:
    wanted = set(ports.all())
    return {c.laddr.port for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port in wanted}


def _assert_all_gone(run: ServeRun, ports: Ports) -> None:
    """Within a few seconds of serve run's exit (the kernel delivers the parent-death signal at once; Ray's last
    processes end on their own), no HAProxy it made is alive and nothing listens on its ports."""
    deadline = time.monotonic() + 20
    while (left := (_haproxies(run), _listening(ports))) != ([], set()) and time.monotonic() < deadline:
        time.sleep(0.5)
    haproxies, listening = left
    commands = [p.info["cmdline"] for p in haproxies]
    if haproxies:
        _kill(run)
    assert not haproxies, f"HAProxy outlived serve run: {commands}"
    assert not listening, f"ports still listened on after serve run stopped: {sorted(listening)}"


def _metrics(run: ServeRun, ports: Ports) -> str:
    """Ray's Prometheus export (once the per-key metrics are there) and HAProxy's."""
    [port_file] = (run.ray_temp / "ray" / "session_latest").glob("metrics_export_port_*")
    url = f"http://127.0.0.1:{port_file.read_text().strip()}/metrics"
    deadline = time.monotonic() + 60
    while "lora_serve_tenant_requests" not in (text := requests.get(url, timeout=10).text):
        assert time.monotonic() < deadline, "per-key metrics not exported"
        time.sleep(2)
    return text + requests.get(f"http://127.0.0.1:{ports.haproxy_metrics}/metrics", timeout=10).text


def _logs(run: ServeRun) -> dict[Path, str]:
    """Every file under Ray's session folder, and serve run's output."""
    files = [p for p in (run.ray_temp / "ray").rglob("*") if p.is_file() and not p.is_symlink()]
    return {p: p.read_text(errors="ignore") for p in files + [run.output]}


def test_keys_never_leave_the_server_and_sigterm_leaves_nothing_behind(app_config):
    config, ports = app_config
    run = _start(config, ports)
    try:
        answers = [_complete(ports, secret) for secret in SECRETS.values()]
        assert [r.status_code for r in answers] == [200] * len(SECRETS), [r.text for r in answers]
        refused = [_complete(ports, "not-a-key-0123456789abcdef"), _get(ports, "/v1/models", None)]
        assert [r.status_code for r in refused] == [401, 401]
        answers += refused + [_get(ports, "/v1/models", SECRETS["env"]), _get(ports, "/info", SECRETS["file"])]
        metrics = _metrics(run, ports)
    except BaseException:
        _kill(run)
        raise
    _stop(run, signal.SIGTERM)
    _assert_all_gone(run, ports)
    logs = _logs(run)
    assert any("Importing application" in text for text in logs.values())  # the build log was read
    texts = {"responses": "".join(r.text + str(r.headers) for r in answers), "metrics": metrics,
             **{str(path): text for path, text in logs.items()}}
    for secret in SECRETS.values():
        leaks = [where for where, text in texts.items() if secret in text]
        assert not leaks, f"a key reached {leaks}"
    shutil.rmtree(run.ray_temp, ignore_errors=True)


def test_a_second_serve_run_starts_at_once_and_sigint_leaves_nothing_behind(app_config):
    config, ports = app_config
    run = _start(config, ports)  # on the ports the SIGTERM-stopped one held
    try:
        assert _complete(ports, SECRETS["listed"]).status_code == 200
    except BaseException:
        _kill(run)
        raise
    _stop(run, signal.SIGINT)
    _assert_all_gone(run, ports)
    shutil.rmtree(run.ray_temp, ignore_errors=True)
