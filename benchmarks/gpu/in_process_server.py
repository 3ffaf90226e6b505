"""A serve config's lora-serve app in one process without Ray, in a process of its own, for a benchmark to drive.

    python -m benchmarks.gpu.in_process_server CONFIG PORT

It serves the engine args of CONFIG's application (benchmarks/serve/run_serve_load.py: served_engine) through the
same routes and gate as a Serve replica (deployments/replica/in_process.py) over uvicorn on the loopback, and stops
on SIGTERM (uvicorn's handler), shutting the engine down. A process of its own, not the benchmark's: the client's
event loop then does not take the GIL from the engine's step thread, as it does not under `serve run`, and the
device is free once the process has ended. start_in_process starts it as benchmarks/serve/http_servers.py starts
`serve run`: a Server, its log in a file, its process group its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from benchmarks.serve.http_servers import ROOT, Server
from engine.free_ports import free_port

NAME = "lora-serve in-process"


def start_in_process(config: Path, tmp: Path) -> Server:
    """This module on `config`, on a free loopback port; wait for it with Server.wait_healthy."""
    from benchmarks.serve.run_serve_load import served_engine

    port = free_port()
    tmp.mkdir(parents=True, exist_ok=True)
    log = tmp / "in_process.log"
    process = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu.in_process_server", str(config), str(port)],
                               cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log.open("w"),
                               stderr=subprocess.STDOUT, start_new_session=True)
    return Server(NAME, f"http://127.0.0.1:{port}", served_engine(config, None)["model"], process, log)


def serve(config: Path, port: int) -> None:
    import uvicorn

    from benchmarks.serve.run_serve_load import served_engine
    from deployments.gate.gate import Gate, GateConfig
    from deployments.replica.in_process import InProcessEngine
    from deployments.routes.routes import http_app
    from engine import EngineConfig
    from lora_cache.local_cache import local_adapters

    args = served_engine(config, None)
    engine = InProcessEngine(EngineConfig.from_overrides(**args), local_adapters if args.get("max_loras") else None)
    try:
        uvicorn.Server(uvicorn.Config(http_app(engine.served, Gate(GateConfig())), host="127.0.0.1", port=port,
                                      log_level="warning")).run()
    finally:
        engine.shutdown()


if __name__ == "__main__":
    serve(Path(sys.argv[1]), int(sys.argv[2]))
