"""The layout's boundaries: the engine and the adapter tiers it uses import nothing of Ray or HTTP."""

from __future__ import annotations

import subprocess
import sys


def test_the_engine_imports_no_ray_and_no_http():
    code = ("import sys, engine, engine.llm_engine, engine.async_engine, lora_cache.local_cache; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'fastapi', 'starlette', 'aiohttp'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
