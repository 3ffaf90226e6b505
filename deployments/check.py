"""python -m deployments.check serve_config.yaml: a serve config checked offline, before any process of Ray starts.

`serve run` hands each application's args to build_app inside Serve's controller: a refused config is logged there
as a traceback, while `serve run` keeps running and /health never answers. This checks what would be refused, the
same way: the file against Ray Serve's own schema (with the keys it would ignore refused by name), each lora-serve
application's args through build_app's own parse (deployments/app.py: check_args), its deployments' names, and
its autoscaling policy with its kwargs. Each problem is one line naming the field and no value given (an api key
written in clear stays out of the output); the exit code is 1 if there is any.

    python -m deployments.check serve_config.yaml && serve run serve_config.yaml

An application of another import path is reported as not checked: its args mean what its own code says.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError
from ray.serve.schema import DeploymentSchema, ServeApplicationSchema, ServeDeploySchema

LORA_SERVE_APP = "deployments.app:build_app"
DEPLOYMENTS = ("LLMServer", "AdapterRouter")  # the engine and, with HAProxy, the ingress request router


@dataclass(frozen=True)
class Problem:
    where: str  # the field, as a path into the file: applications[0].args.engine
    reason: str


def check_file(path: Path) -> tuple[list[Problem], list[str]]:
    """The config's problems, and the applications left unchecked (another import path)."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        return [Problem("file", f"cannot be read as YAML ({type(exc).__name__})")], []
    if not isinstance(data, dict):
        return [Problem("file", "must hold a mapping with an `applications` list")], []
    problems = _schema_problems(data)
    if problems:
        return problems, []
    apps = data.get("applications") or []
    unchecked = [f"applications[{i}]" for i, app in enumerate(apps) if app.get("import_path") != LORA_SERVE_APP]
    for i, app in enumerate(apps):
        if app.get("import_path") == LORA_SERVE_APP:
            problems += _app_problems(f"applications[{i}]", app)
    return problems, unchecked


def _schema_problems(data: dict) -> list[Problem]:
    try:
        ServeDeploySchema.model_validate(data)
    except ValidationError as exc:
        return [Problem(_path(e["loc"]), e["msg"]) for e in exc.errors(include_input=False, include_url=False)]
    except (ImportError, AttributeError, TypeError) as exc:  # the schema imports autoscaling policies itself
        return [Problem("applications", f"Ray Serve's schema refused it: {exc}")]
    problems = _unknown_keys("", data, ServeDeploySchema)
    for i, app in enumerate(data.get("applications") or []):
        problems += _unknown_keys(f"applications[{i}].", app, ServeApplicationSchema)
        for j, deployment in enumerate(app.get("deployments") or []):
            problems += _unknown_keys(f"applications[{i}].deployments[{j}].", deployment, DeploymentSchema)
    return problems


def _unknown_keys(prefix: str, data: dict, schema: type[BaseModel]) -> list[Problem]:
    """Keys Ray Serve's schema would ignore without a word: most likely misspelt."""
    return [Problem(f"{prefix}{key}", f"unknown key; known: {', '.join(sorted(schema.model_fields))}")
            for key in data if key not in schema.model_fields]


def _path(loc: tuple) -> str:
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".") or "file"


def _app_problems(where: str, app: dict) -> list[Problem]:
    from deployments.app import InvalidArgs, check_args

    problems = []
    try:
        check_args(app.get("args"))
    except InvalidArgs as exc:
        problems += [Problem(f"{where}.args", reason) for reason in exc.reasons]
    for j, deployment in enumerate(app.get("deployments") or []):
        at = f"{where}.deployments[{j}]"
        if deployment.get("name") not in DEPLOYMENTS:
            problems.append(Problem(f"{at}.name", f"lora-serve has no such deployment; its deployments: "
                                                  f"{', '.join(DEPLOYMENTS)}"))
        policy = (deployment.get("autoscaling_config") or {}).get("policy")
        if policy:
            problems += _policy_problems(f"{at}.autoscaling_config.policy", policy)
    return problems


def _policy_problems(where: str, policy: dict) -> list[Problem]:
    """A policy class takes its kwargs (Serve builds it with them in its controller). Ray's schema has imported the
    policy already (_schema_problems), from `module:name` or `module.name` alike."""
    target = policy["policy_function"]
    module, _, name = target.partition(":") if ":" in target else target.rpartition(".")
    function = getattr(importlib.import_module(module), name)
    if not inspect.isclass(function):
        return []
    try:
        function(**(policy.get("policy_kwargs") or {}))
    except (TypeError, ValueError) as exc:
        return [Problem(f"{where}.policy_kwargs", str(exc))]
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deployments.check", description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path, help="a serve config, as `serve run` takes it")
    config = parser.parse_args(argv).config
    problems, unchecked = check_file(config)
    for problem in problems:
        print(f"{config}: {problem.where}: {problem.reason}", file=sys.stderr)
    for where in unchecked:
        print(f"{config}: {where}: not checked: its import_path is not {LORA_SERVE_APP}", file=sys.stderr)
    if not problems:
        print(f"{config}: ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
