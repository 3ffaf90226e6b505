"""The layout's boundaries: the engine and the adapter tiers it uses import nothing of Ray or HTTP; the routing side
imports no torch."""

from __future__ import annotations

import subprocess
import sys


def test_the_engine_imports_no_ray_and_no_http():
    code = ("import sys, engine, engine.llm_engine, engine.async_engine, lora_cache.local_cache; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'fastapi', 'starlette', 'aiohttp'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_the_routing_side_imports_no_torch():
    """The request router runs in Serve's proxy and in every handle's process, the ingress request router in a
    replica of its own: neither loads torch (about 180 MB of each process's memory, 1.6 s of its start)."""
    code = ("import sys, deployments.request_router, deployments.ingress_router, deployments.routing; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'safetensors', "
            "'engine'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
