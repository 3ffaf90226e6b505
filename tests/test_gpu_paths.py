"""docs/gpu.md's table of CUDA paths holds the engine to its rule: on CUDA every default is a path that has run on
a GPU. Each row names an EngineConfig option and value (or none: a path with no alternative); the test reads the
defaults from EngineConfig itself, so neither the table nor the code can change a default alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from engine.config import EngineConfig

TABLE = Path(__file__).parents[1] / "docs" / "gpu.md"
HEADER = "| path | what it is | option | default on CUDA | has run on |"
COLUMNS = ("path", "what", "option", "default", "ran")


def _rows() -> list[dict[str, str]]:
    """The table's rows, each cell stripped of its backticks."""
    lines = TABLE.read_text().splitlines()
    start = lines.index(HEADER) + 2  # past the header and its rule
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        assert len(cells) == len(COLUMNS), f"a row of {len(cells)} cells: {line}"
        rows.append(dict(zip(COLUMNS, cells)))
    return rows


ROWS = _rows()


def _option(row: dict[str, str]) -> tuple[str, object] | None:
    """The row's (option, value), parsed as a YAML config gives it, or None for '-'."""
    if row["option"] == "-":
        return None
    (name, value), = yaml.safe_load(row["option"]).items()
    return name, value


def _cuda_defaults() -> dict[str, object]:
    return EngineConfig.from_overrides(device="cuda").options()


def test_the_table_lists_paths_with_options_it_knows():
    assert len(ROWS) >= 10
    defaults = _cuda_defaults()
    for row in ROWS:
        assert row["default"] in ("yes", "no", "-"), row
        option = _option(row)
        if option is not None:
            assert option[0] in defaults, f"{row['path']}: no engine option {option[0]!r}"
            EngineConfig.from_overrides(device="cuda", **dict([option]))  # a value the engine accepts


@pytest.mark.parametrize("row", [row for row in ROWS if _option(row)], ids=lambda row: row["path"])
def test_a_rows_default_is_the_engines(row):
    name, value = _option(row)
    is_default = _cuda_defaults()[name] == value
    assert row["default"] == ("yes" if is_default else "no"), \
        f"{row['path']}: the table says default {row['default']!r}, EngineConfig's {name} is {_cuda_defaults()[name]!r}"


def test_every_cuda_default_has_run_on_a_gpu():
    unverified = [row["path"] for row in ROWS if row["default"] == "yes" and row["ran"].startswith("not yet")]
    assert not unverified, f"CUDA defaults that have not run on a GPU: {unverified}"


def test_each_option_has_one_default_path():
    """Every option the table names has exactly one row that is its default, so no default goes unlisted."""
    options = {}
    for row in ROWS:
        option = _option(row)
        if option is not None:
            options.setdefault(option[0], []).append(row["default"])
    for name, defaults in options.items():
        assert defaults.count("yes") == 1, f"{name}: {defaults.count('yes')} default rows"


@pytest.mark.parametrize("option, value", [("cuda_prefill", "fast"), ("cuda_experts", "fused")])
def test_an_unknown_kernel_is_refused_by_name(option, value):
    with pytest.raises(ValueError, match=f"{option} must be one of .*, got '{value}'"):
        EngineConfig.from_overrides(**{option: value})
