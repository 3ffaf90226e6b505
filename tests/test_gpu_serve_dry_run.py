"""The GPU serving benchmark (benchmarks/gpu/run_gpu_serve.py) on the CPU: the serve config it writes for the GPU
as Serve and lora-serve read it, and its dry run (--device cpu --tiny) end to end: after a Ray that does not come
up, in one process without Ray, and through `serve run`. Each run's routes answered with the tokens asked for,
every streamed request got its tokens, the offline engine ran the same requests, and the summary, raw figures and
plot were written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from benchmarks.gpu import run_gpu_serve
from benchmarks.gpu.run_gpu_serve import Plan, engine_args, serve_config

ROOT = Path(__file__).parent.parent


def test_the_gpu_config_is_serve_config_yaml_with_one_gpu_replica_of_the_benchmark_s_engine(tmp_path):
    from ray.serve.schema import ServeDeploySchema

    from deployments.app import AppArgs
    from engine import EngineConfig

    engine = engine_args(Plan.full(), tmp_path / "model", tmp_path / "adapters", "cuda")
    spec = serve_config(engine, "cuda")
    app = ServeDeploySchema.model_validate(spec).applications[0]
    config = EngineConfig.from_overrides(**AppArgs(**app.args).engine)
    assert (config.lora.max_loras, config.lora.max_lora_rank, config.scheduler.max_num_seqs) == (16, 16, 256)
    assert config.model.load_format == "dummy" and config.cache.kv_cache_memory_fraction == 0.8
    [replica] = app.deployments
    assert replica.num_replicas == 1 and "autoscaling_config" not in spec["applications"][0]["deployments"][0]
    options = replica.ray_actor_options
    assert options.num_gpus == 1  # replacing build_app's options, so Serve's direct ingress goes with them
    assert options.runtime_env["env_vars"]["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    shipped = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["controller_options"]["runtime_env"]
    assert spec["controller_options"]["runtime_env"]["env_vars"].keys() <= shipped["env_vars"].keys()


def _results(out: Path) -> dict:
    """The run's raw figures, after checking what every run must show."""
    raw = json.loads((out / "gpu_serve.json").read_text())
    plan = raw["plan"]
    assert all(phase["ok"] for phase in raw["phases"].values()), raw["phases"]
    assert len(raw["routes"]) == 12 and all(r["ok"] for r in raw["routes"]), raw["routes"]
    assert {r["route"] for r in raw["routes"]} == {"/v1/completions", "/v1/chat/completions", "/generate",
                                                   "/generate_stream"}
    assert [(r["workload"], r["concurrency"]) for r in raw["load"]] == [
        (w, c) for c, _ in plan["loads"] for w in ("base", "adapters")]
    for row in raw["load"]:
        asked = dict(map(tuple, plan["loads"]))[row["concurrency"]]
        assert row["ok"] == row["requests"] == asked and row["tokens"] == asked * plan["new_tokens"], row
        assert row["tok_s"] > 0 and row["ttft_ms_p50"] > 0 and row["tpot_ms_p50"] is not None
    assert [s["workload"] for s in raw["shares"]] == ["base", "adapters"]
    assert all(o["ok"] and o["tok_s"] > 0 for o in raw["offline"]) and all(s["share"] > 0 for s in raw["shares"])
    summary = (out / "gpu_serve.md").read_text()
    assert "## Routes" in summary and "HTTP share" in summary and "![gpu_serve](gpu_serve.png)" in summary
    assert (out / "gpu_serve.png").stat().st_size > 0 and (out / "gpu_serve_config.yaml").is_file()
    return raw


def test_a_ray_that_does_not_come_up_is_recorded_and_the_same_app_is_served_in_one_process(tmp_path, monkeypatch,
                                                                                            smollm2_path):
    """`serve run` stands in for one whose Ray cannot start its object store: it prints that and exits."""
    from benchmarks.serve.http_servers import Server

    def no_ray(name, config, tmp, env=None):
        log = tmp / "serve.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        failing = subprocess.Popen([sys.executable, "-c", "print('no room for the object store'); exit(1)"],
                                   stdout=log.open("w"), stderr=subprocess.STDOUT)
        return Server(name, "http://127.0.0.1:1", "model", failing, log)

    monkeypatch.setattr(run_gpu_serve, "start_lora_serve", no_ray)
    monkeypatch.setattr(run_gpu_serve, "_stop_on_sigterm", lambda: None)  # pytest's own SIGTERM stays as it is
    run_gpu_serve.main(["--device", "cpu", "--tiny", "--tokenizer", str(smollm2_path), "--out", str(tmp_path)])
    raw = _results(tmp_path)
    assert raw["server"]["server"] == "lora-serve in-process"
    assert "exited with 1" in raw["server"]["ray_error"] and "no room for the object store" in raw["server"]["ray_error"]
    assert "Ray Serve did not come up" in (tmp_path / "gpu_serve.md").read_text()
    assert (tmp_path / "gpu_serve-lora-serve.log").is_file()  # the failed server's log, kept


@pytest.mark.slow
def test_the_dry_run_serves_through_serve_run(tmp_path, smollm2_path):
    """The real path: `serve run` of the config it wrote, a Ray of its own in a process tree it stops."""
    run = subprocess.run([sys.executable, "-m", "benchmarks", "gpu_serve", "--device", "cpu", "--tiny",
                          "--tokenizer", str(smollm2_path), "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=400, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    raw = _results(tmp_path)
    assert raw["server"]["server"] == "lora-serve" and "ray_error" not in raw["server"]
