"""build_app(args): the import_path target of serve_config.yaml."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray.serve import Application

from deployments.ingress import Ingress
from deployments.llm_server import LLMServer
from engine import EngineConfig


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    engine: dict = Field(default_factory=dict, description="EngineConfig fields (model, dtype, kv_cache_bytes, ...)")


def build_app(args: dict | None = None) -> Application:
    try:
        parsed = AppArgs(**(args or {}))
        EngineConfig.from_overrides(**parsed.engine)  # fail here, with the reason, not in a replica
    except (ValidationError, TypeError, ValueError) as exc:
        raise ValueError(f"invalid lora-serve application args: {exc}") from exc
    return Ingress.bind(LLMServer.bind(parsed.engine), parsed.engine)
