"""lora-serve engine: continuous batching over a paged KV cache.

The names below load on first use (PEP 562): `import engine.config` or `from engine.sampling import ...` must not
import torch, because the serving side's typed boundary (config, sampling parameters, refusals, stats) is imported
by Serve's build step, which runs before any replica starts: with torch and transformers, `import deployments.app`
took seconds, on the critical path of every `serve run`."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "AsyncEngine": "engine.async_engine", "EngineConfig": "engine.config", "EngineDeadError": "engine.errors",
    "EngineOverloadedError": "engine.errors", "EngineStats": "engine.outputs", "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine", "ModelNotFoundError": "engine.model_files",
    "RequestOutput": "engine.outputs", "ResponseFormat": "engine.sampling", "SamplingParams": "engine.sampling",
    "Watermark": "engine.watermark",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
