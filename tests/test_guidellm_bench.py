"""The guidellm benchmark (benchmarks/serve/run_guidellm.py) reads guidellm's JSON report (a real one of guidellm
0.8.1, trimmed to the figures read), asks guidellm for the loads it names, and tabulates medians over rounds against
vLLM's figures for the same load."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from benchmarks.serve.run_guidellm import VLLM, Load, Point, by_point, figures, loads, table

REPORT = Path(__file__).parent / "data" / "guidellm_report.json"


def test_a_reports_figures_are_its_tokens_over_its_duration_and_its_percentiles():
    got = figures(json.loads(REPORT.read_text()))
    assert got == {"tok_s": pytest.approx(4096 / 11.1031), "ttft_p50_ms": 936.839, "ttft_p99_ms": 2056.672,
                   "itl_p50_ms": 71.347, "itl_p99_ms": 83.828, "errors": 0}


def test_the_loads_are_every_shape_at_every_stream_count_and_the_rates_of_the_first_shape():
    class Args:
        shapes, streams, rates = ["128x64", "512x128"], [1, 32], [2.0]

    assert loads(Args) == [Load(128, 64, streams=1), Load(128, 64, streams=32), Load(512, 128, streams=1),
                           Load(512, 128, streams=32), Load(128, 64, rate=2.0)]
    assert Load(128, 64, streams=32).profile() == "kind=concurrent,streams=32"
    assert Load(128, 64, rate=2.0).profile() == "kind=poisson,rate=2"


def test_the_table_takes_medians_over_rounds_and_sets_each_load_against_vllms():
    load = Load(128, 64, streams=32)
    points = [Point("lora-serve", r, load, tok_s=tok_s, ttft_p50_ms=ttft, errors=0)
              for r, tok_s, ttft in ((0, 100.0, 900.0), (1, 140.0, 700.0), (2, 120.0, 800.0))]
    points += [Point(VLLM, 0, load, tok_s=80.0, ttft_p50_ms=1000.0, errors=0),
               Point(VLLM, 1, load, failure="connection refused")]
    raw = {"points": [asdict(p) for p in points]}
    medians = by_point(raw)
    assert medians[("lora-serve", load.label)]["tok_s"] == 120.0
    assert medians[("lora-serve", load.label)]["ttft_p50_ms"] == 800.0
    assert medians[(VLLM, load.label)]["failures"] == 1
    assert "| 128/64, 32 streams | lora-serve | 120.0 | 1.50x | 800 |" in table(raw)
