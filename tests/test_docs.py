"""The docs. The references generated from the code are what docs/generate.py writes: docs/configuration.md holds
every engine option and every build_app argument, each with a meaning; docs/api.md every route and the fields of its
API's client that it refuses by name. The README is a short front door, and no doc is a diary: no dates. The
committed benchmark results are each benchmark's current summary per machine kind, small enough to clone."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

from deployments.app import AppArgs, RoutingArgs
from deployments.gate.auth import ApiKeyConfig
from engine.config import EngineConfig

ROOT = Path(__file__).parent.parent


def test_the_configuration_reference_is_what_the_script_writes():
    check = subprocess.run([sys.executable, "docs/generate.py", "--check"], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
    assert check.returncode == 0, check.stderr


def test_every_option_has_an_entry():
    text = (ROOT / "docs" / "configuration.md").read_text()
    names = list(EngineConfig().options())
    names += [*AppArgs.model_fields, *RoutingArgs.model_fields, *ApiKeyConfig.model_fields]
    assert not [name for name in names if f"| `{name}` |" not in text]


def test_an_option_without_a_meaning_fails_the_script():
    import importlib.util

    import pytest

    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)

    @dataclasses.dataclass
    class Options:
        documented: int = 1  # what it does
        silent: int = 2

    comments = generate.field_comments(Options)
    assert comments == {"documented": "what it does", "silent": ""}
    rows = [(name, "int", "1", meaning) for name, meaning in comments.items()]
    with pytest.raises(generate.MissingMeaning, match="silent"):
        generate.table("Options", "", rows)


def test_the_api_reference_names_every_route_and_what_it_refuses():
    text = (ROOT / "docs" / "api.md").read_text()
    for route in ("POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses", "POST /generate",
                  "POST /v1/load_lora_adapter", "POST /v1/unload_lora_adapter", "GET /v1/models", "POST /tokenize"):
        assert f"| `{route}` |" in text, route
    completions = text.split("### CompletionRequest")[1].split("###")[0]
    assert "`suffix`" in completions.split("Refused by name")[1]  # OpenAI's, refused: tests/test_serve.py sends it


DATE = re.compile(r"\b20[0-9]{2}-[01][0-9]-[0-3][0-9]\b")


def test_the_readme_is_short_and_no_doc_carries_a_date():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 400
    dated = [f"{path.name}: {m.group()}" for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
             for m in DATE.finditer(path.read_text())]
    assert dated == []


def test_the_committed_results_are_one_summary_per_benchmark_and_kind_under_a_megabyte():
    results = ROOT / "benchmarks" / "results"
    files = [path for path in results.rglob("*") if path.is_file()]
    assert sum(path.stat().st_size for path in files) < 1 << 20
    assert all(path.parent.parent == results and path.suffix in (".md", ".png") for path in files)
    summaries = {path.with_suffix("") for path in files if path.suffix == ".md"}
    assert {path.with_suffix("") for path in files if path.suffix == ".png"} <= summaries
