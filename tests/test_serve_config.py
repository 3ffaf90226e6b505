"""serve_config.yaml, as `serve run` reads it: valid for Ray Serve, and every lora-serve option in it known."""

from __future__ import annotations

from pathlib import Path

import yaml
from ray.serve.schema import ServeDeploySchema

from deployments.app import AppArgs
from deployments.autoscaling import EngineLoadPolicy
from engine import EngineConfig

CONFIG = Path(__file__).parent.parent / "serve_config.yaml"


def test_serve_config_is_valid_and_names_only_known_options():
    config = ServeDeploySchema.model_validate(yaml.safe_load(CONFIG.read_text()))
    app = config.applications[0]
    EngineConfig.from_overrides(**AppArgs(**app.args).engine)
    engine = next(d for d in app.deployments if d.name == "LLMServer")
    EngineLoadPolicy(**engine.autoscaling_config["policy"]["policy_kwargs"])
    assert float(config.controller_options.runtime_env["env_vars"]["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"]) > 0
