"""The layout's boundaries: the engine and the adapter tiers it uses import nothing of Ray or HTTP; the routing side,
the app and the cache actor's module import no torch."""

from __future__ import annotations

import json
import subprocess
import sys

TORCH_SIDE = ("torch", "transformers", "safetensors", "tokenizers", "peft")


def loaded_packages(modules: str, among: tuple[str, ...]) -> list[str]:
    """The packages of `among` that a fresh interpreter has loaded after importing `modules`."""
    loaded = f"sorted({{m.split('.')[0] for m in sys.modules}} & {set(among)!r})"
    code = f"import json, sys, {modules}; print(json.dumps({loaded}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_engine_imports_no_ray_and_no_http():
    modules = "engine, engine.llm_engine, engine.llm, engine.async_engine, lora_cache.local_cache"
    assert loaded_packages(modules, ("ray", "fastapi", "starlette", "aiohttp")) == []


def test_the_routing_side_imports_no_torch():
    """The request router runs in Serve's proxy and in every handle's process, the ingress request router in a
    replica of its own: neither loads torch (about 180 MB of each process's memory, 1.6 s of its start)."""
    modules = "deployments.routing.request_router, deployments.routing.ingress_router, deployments.routing.policy"
    assert loaded_packages(modules, TORCH_SIDE + ("engine",)) == []


def test_the_app_and_the_cache_actor_import_no_torch():
    """`serve run` imports the app in a build step before any replica starts, and a replica creates the cache actor
    before it imports the engine: neither import may load torch or transformers (5.8 s of the app's import on
    2 cores with them, 1.8 s without), or it lands on the critical path of every start."""
    assert loaded_packages("deployments.app, deployments.replica.llm_server, lora_cache.actor", TORCH_SIDE) == []


def test_the_engine_package_loads_its_names_on_use():
    assert loaded_packages("engine", TORCH_SIDE) == []
    assert loaded_packages("engine.config, engine.sampling, engine.errors, engine.block_manager", TORCH_SIDE) == []
    code = "from engine import LLM, SamplingParams; print(LLM.__module__, SamplingParams.__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["engine.llm", "engine.sampling"]
    missing = subprocess.run([sys.executable, "-c", "import engine; engine.NoSuchName"], capture_output=True,
                             text=True, timeout=120)
    assert missing.returncode == 1 and "module 'engine' has no attribute 'NoSuchName'" in missing.stderr
