"""The one command line of the benchmarks (`python -m benchmarks NAME`) and the per-replica token texts."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks import common
from benchmarks.common import Folders, benchmark_args, save_results
from deployments.api.token_texts import TokenTexts

ROOT = Path(__file__).parent.parent


def _benchmarks(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_the_cli_lists_every_entry_point_of_every_subject():
    listed = _benchmarks()
    assert listed.returncode == 0
    entry_points = sorted(ROOT.glob("benchmarks/*/run_*.py"))
    assert len(entry_points) >= 10
    for path in entry_points:
        name = path.stem.removeprefix("run_")
        assert f"benchmarks.{path.parent.name}.{path.stem}" in listed.stderr, name


def test_the_cli_refuses_an_unknown_benchmark_by_name_and_passes_options_on():
    unknown = _benchmarks("nope")
    assert unknown.returncode == 2 and "unknown benchmark 'nope'" in unknown.stderr
    helped = _benchmarks("soak", "--help")
    assert helped.returncode == 0 and "--minutes" in helped.stdout
    refused = _benchmarks("soak", "--no-such-option")
    assert refused.returncode == 2 and "--no-such-option" in refused.stderr


def test_a_results_file_names_the_options_it_ran_with_but_not_its_folder(monkeypatch):
    """The results' "Command:" line: the options as given (quoted for a shell), without --out."""
    # `python -m benchmarks serve_load` runs the module as __main__: sys.argv[0] is then its file
    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / "serve" / "run_serve_load.py")])
    add = lambda parser: parser.add_argument("--variant", action="append", default=[])  # noqa: E731
    args = benchmark_args("doc", "quick", ["--out", "/tmp/x", "--variant", "a=my config.yaml", "--out=/tmp/y",
                                           "--quick"], add)
    assert args.command == "PYTHONPATH=. python -m benchmarks serve_load --variant 'a=my config.yaml' --quick"
    assert args.variant == ["a=my config.yaml"] and args.out == Path("/tmp/y")
    assert args.folders == Folders(Path("/tmp/y"), Path("/tmp/y"))  # --out: every file of the run in one folder
    kind = benchmark_args("doc", "quick", ["--kind", "zen4", "--quick"])
    assert kind.kind == "zen4" and "--kind" not in kind.command and "zen4" not in kind.command


def test_a_run_files_its_summary_by_machine_kind_and_its_raw_figures_apart(monkeypatch):
    """Without --out: the summary and its plot in results/KIND, the raw JSON in runs/KIND (git-ignored); a smoke
    run all in runs/KIND/smoke, so it never replaces a kind's summary."""
    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / "engine" / "run_prefix.py")])
    full = benchmark_args("doc", "quick", ["--kind", "avx2"])
    assert full.folders == Folders(common.RESULTS / "avx2", common.RUNS / "avx2")
    smoke = benchmark_args("doc", "quick", ["--kind", "avx2", "--quick"])
    assert smoke.folders == Folders(common.RUNS / "avx2" / "smoke", common.RUNS / "avx2" / "smoke")
    shorter = benchmark_args("doc", "quick", ["--kind", "h200", "--quick"], quick_is_smoke=False)  # a GPU's --quick
    assert shorter.folders == Folders(common.RESULTS / "h200", common.RUNS / "h200")
    for raw in ("benchmarks/runs/avx2/prefix.json", "benchmarks/results/avx2/prefix.json"):
        assert subprocess.run(["git", "check-ignore", "-q", raw], cwd=ROOT, check=False).returncode == 0, raw


def test_save_results_writes_the_summary_and_one_plot_apart_from_the_raw_figures_and_further_plots(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    def plot(raw):
        fig, ax = plt.subplots(figsize=(3, 2))
        ax.plot(raw["x"], raw["y"])
        return fig

    folders = Folders(tmp_path / "results", tmp_path / "runs")
    save_results(folders, "demo", {"x": [1, 2, 3], "y": [3, 1, 2]}, plot, "# Demo\n", {"other": plot})
    assert sorted(p.name for p in folders.results.iterdir()) == ["demo.md", "demo.png"]
    assert sorted(p.name for p in folders.raw.iterdir()) == ["demo.json", "demo_other.png"]
    assert "![demo](demo.png)" in (folders.results / "demo.md").read_text()  # the summary links its plot
    with Image.open(folders.results / "demo.png") as image:
        assert image.mode == "P"  # a palette PNG: small enough to commit


def test_the_machine_kind_is_named_by_the_cpu_s_vector_units_or_the_gpu_s_model(monkeypatch):
    def cpu(flags, vendor="AuthenticAMD", family="25"):
        monkeypatch.setattr(common, "_cpu_info", lambda: {"flags": flags, "vendor_id": vendor, "cpu family": family})
        return common.cpu_kind()

    assert cpu("fpu sse avx avx2 fma") == "avx2"  # Zen 3: family 25 without AVX-512
    assert cpu("avx2 avx512f avx512_bf16") == "zen4"
    assert cpu("avx2 avx512f avx512_bf16", family="26") == "avx512"
    assert cpu("avx2 avx512f avx512_bf16 amx_bf16 amx_tile", vendor="GenuineIntel", family="6") == "amx"
    monkeypatch.setattr(common.torch.cuda, "is_available", lambda: True)
    for name, kind in (("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100")):
        monkeypatch.setattr(common.torch.cuda, "get_device_name", lambda name=name: name)
        assert common.machine_kind("cuda") == kind
    assert common.machine_kind("cpu") == "amx"  # a CPU benchmark on a GPU host files under the host's CPU


def test_token_texts_decode_as_the_tokenizer_and_once(tokenizer):
    texts = TokenTexts(tokenizer)
    ids = [0, 1, 2, 42, 1000, 42, tokenizer.eos_token_id]
    assert texts.texts(ids) == [tokenizer.decode([i]) for i in ids]
    assert texts.piece(tokenizer.eos_token_id) == tokenizer.convert_ids_to_tokens(tokenizer.eos_token_id)
    assert tokenizer.eos_token_id in texts.special_ids
    assert texts.decode([42, 1000]) == tokenizer.decode([42, 1000])
    calls = []
    texts_counted = TokenTexts(_Counting(tokenizer, calls))
    texts_counted.texts([5, 5, 6, 5])
    assert calls == [[5], [6]]  # each token decoded once


class _Counting:
    """The tokenizer, recording the ids each decode call got."""

    def __init__(self, tokenizer, calls: list):
        self.tokenizer, self.calls = tokenizer, calls
        self.all_special_ids = tokenizer.all_special_ids

    def decode(self, ids):
        self.calls.append(list(ids))
        return self.tokenizer.decode(ids)


def test_the_load_benchmark_sets_every_application_s_dtype_and_refuses_others():
    import yaml

    from benchmarks.serve.http_servers import with_dtype

    shipped = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    changed = with_dtype(yaml.safe_load((ROOT / "serve_config.yaml").read_text()), "float32")
    assert [a["args"]["engine"]["dtype"] for a in changed["applications"]] == ["float32"] * len(shipped["applications"])
    for application in changed["applications"]:
        application["args"]["engine"].pop("dtype")
    for application in shipped["applications"]:
        application["args"]["engine"].pop("dtype")
    assert changed == shipped  # nothing else changes
    assert with_dtype(shipped, None) == shipped
    refused = _benchmarks("serve_load", "--dtype", "float16")
    assert refused.returncode == 2 and "invalid choice: 'float16'" in refused.stderr


def test_the_contention_cell_refuses_a_busy_loop_and_wakers_together():
    refused = subprocess.run([sys.executable, "-m", "benchmarks.serve.contention_worker", "--duty", "0.1", "--wakers",
                              "3"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--duty and --wakers measure different things" in refused.stderr


def test_the_contention_cell_refuses_a_busy_loop_placed_without_its_duty():
    refused = subprocess.run([sys.executable, "-m", "benchmarks.serve.contention_worker", "--busy-in", "engine"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--busy-in engine places the busy loop: give its --duty" in refused.stderr


def test_a_busy_thread_of_this_process_takes_its_duty_of_a_core_is_measured_alone_and_stops():
    from benchmarks.serve.contention_worker import BusyThread

    busy = BusyThread(0.3)
    try:
        before, start = busy.cpu_seconds(), time.perf_counter()
        time.sleep(1.0)
        cores = (busy.cpu_seconds() - before) / (time.perf_counter() - start)
    finally:
        busy.stop()  # left spinning, it would take a third of a core and the GIL from every later test
    assert 0.15 < cores < 0.45  # the spin's 30% of every 10 ms; this test's own thread sleeps meanwhile
    assert "busy-loop" not in {thread.name for thread in threading.enumerate()}


def test_the_contention_table_sets_each_place_of_the_busy_loop_against_the_same_engine_alone():
    from benchmarks.serve.run_contention import table

    def cell(duty, busy_in, tok_s, rnd=0):
        return {"round": rnd, "threads": 2, "duty": duty, "busy_in": busy_in, "other_cores": duty, "tok_s": tok_s,
                "tpot_ms_p50": 30.0}

    raw = {"environment": {"cpu_count": 2}, "cells": [
        cell(0.0, "none", 1000.0), cell(0.0, "none", 1000.0, 1), cell(0.1, "other", 900.0),
        cell(0.1, "other", 900.0, 1), cell(0.1, "engine", 800.0), cell(0.1, "engine", 850.0, 1)]}
    rows = [line.split(" | ") for line in table(raw).splitlines()[2:]]
    assert [row[1] for row in rows] == ["-", "another process", "the engine's process"]
    assert rows[1][4:6] == ["90%", "900.0 / 900.0"] and rows[1][7].rstrip(" |") == "2.0"
    assert rows[2][3:6] == ["825.0", "82%", "800.0 / 850.0"] and rows[2][7].rstrip(" |") == "3.5"


def test_the_wakers_process_wakes_about_once_a_period_per_thread_and_takes_little_cpu():
    """3 threads waking every 2 ms: about 1,500 voluntary context switches a second, and a small share of a core."""
    wakers = subprocess.Popen([sys.executable, "-m", "benchmarks.serve.busy_loop", "--wakers", "3", "0.002"],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert wakers.stdout.readline().strip() == "ready"
        before, cpu_before = _voluntary_switches(wakers.pid), _cpu_seconds(wakers.pid)
        time.sleep(1.0)
        switches, cpu = _voluntary_switches(wakers.pid) - before, _cpu_seconds(wakers.pid) - cpu_before
    finally:
        wakers.kill()
    assert 300 < switches < 1700 and cpu < 0.5


def _voluntary_switches(pid: int) -> int:
    """Summed over the process's threads (/proc/PID/status counts the main thread's alone)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        status = (task / "status").read_text()
        total += int(status.split("voluntary_ctxt_switches:")[1].split()[0])
    return total


def _cpu_seconds(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def test_the_serve_load_share_is_taken_against_the_offline_runs_beside_each_server():
    """Each server's share against its own engine's runs that bracket it and the run beside it while it idled, not
    another server's or another engine's; the idle server's own cores, not the offline engine's ("outside" its
    tree)."""
    from benchmarks.serve.run_serve_load import IDLE_SERVER, STOPPED_SERVER, cpu_table, offline_name, share_table

    def run(system, tok_s, concurrency=32, beside=None, cores=None):
        return {"system": system, "concurrency": concurrency, "round": 0, "tok_s": tok_s, "beside": beside,
                "cores": cores}

    bracket, idle = offline_name(32, 64), offline_name(32, 64, IDLE_SERVER)
    stopped = offline_name(32, 64, STOPPED_SERVER)
    vllm_bracket, vllm_idle, vllm_stopped = (offline_name(32, 64, state, "vLLM")
                                             for state in ("", IDLE_SERVER, STOPPED_SERVER))
    raw = {"requests": 64, "concurrency": [32], "systems": ["lora-serve", "lora-serve direct", "vLLM"],
           "offline": [offline_name(64, 64), bracket, stopped, idle, vllm_bracket, vllm_stopped, vllm_idle],
           "scenarios": [run(offline_name(64, 64), 1200.0, 64),
                         run(bracket, 1000.0, beside="lora-serve"), run(bracket, 900.0, beside="lora-serve"),
                         run(idle, 860.0, beside="lora-serve", cores={"engine replica": 0.1, "outside": 1.8}),
                         run(stopped, 940.0, beside="lora-serve"), run(stopped, 960.0, beside="lora-serve"),
                         run("lora-serve", 855.0, cores={"engine replica": 1.8}),
                         run(bracket, 800.0, beside="lora-serve direct"),
                         run(bracket, 800.0, beside="lora-serve direct"),
                         run(idle, 700.0, beside="lora-serve direct", cores={"raylet": 0.02, "outside": 1.9}),
                         run(stopped, 740.0, beside="lora-serve direct"),
                         run(stopped, 780.0, beside="lora-serve direct"),
                         run("lora-serve direct", 700.0, cores={"engine replica": 1.8}),
                         run(vllm_bracket, 700.0, beside="vLLM"), run(vllm_bracket, 660.0, beside="vLLM"),
                         run(vllm_idle, 650.0, beside="vLLM", cores={"vLLM API server": 0.15, "outside": 1.8}),
                         run(vllm_stopped, 690.0, beside="vLLM"), run(vllm_stopped, 670.0, beside="vLLM"),
                         run("vLLM", 612.0, cores={"vLLM worker": 1.8})]}
    rows = {tuple(cell.strip() for cell in line.split("|")[1:3]): line.split("|")[5].strip()
            for line in share_table(raw).splitlines()[2:]}
    assert rows[("lora-serve", offline_name(64, 64))] == "71%"  # 855 / 1200
    assert rows[("lora-serve", bracket)] == "90%"  # 855 / the mean of 1000 and 900
    assert rows[("lora-serve", idle)] == "99%"  # 855 / 860
    assert rows[("lora-serve", stopped)] == "90%"  # 855 / the mean of 940 and 960
    assert rows[("lora-serve direct", stopped)] == "92%"  # 700 / the mean of 740 and 780
    assert rows[("lora-serve direct", bracket)] == "88%" and rows[("lora-serve direct", idle)] == "100%"
    assert rows[("vLLM", vllm_bracket)] == "90%" and rows[("vLLM", vllm_stopped)] == "90%"  # 612 / 680
    assert rows[("vLLM", vllm_idle)] == "94%"  # 612 / 650
    assert {system for system, _ in rows} == {"lora-serve", "lora-serve direct", "vLLM"}
    assert not [name for system, name in rows if (system == "vLLM") != name.startswith("vLLM offline")]
    idle_cores = [line.split("|")[4].strip() for line in cpu_table(raw).splitlines()[2:]]
    assert idle_cores == ["0.100", "0.020", "0.150"]


def test_a_stopped_server_takes_no_cpu_and_runs_again_after(tmp_path):
    """Server.stopped() stops every process of its tree (a parent and the busy child it started), and continues
    them when the block ends: the child's CPU time stands still inside and moves after."""
    import psutil

    from benchmarks.serve.http_servers import Server

    child = "while True: pass"
    parent = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {child!r}])\ntime.sleep(60)"
    process = subprocess.Popen([sys.executable, "-c", parent])
    server = Server("tree", "http://127.0.0.1:1", "model", process, tmp_path / "log")
    try:
        while len(server.tree()) < 2:
            time.sleep(0.05)
        busy = server.tree()[1]
        with server.stopped():
            time.sleep(0.1)  # a signal is delivered asynchronously
            assert {p.status() for p in server.tree()} == {psutil.STATUS_STOPPED}
            frozen = _cpu_seconds(busy.pid)
            time.sleep(0.5)
            assert _cpu_seconds(busy.pid) == frozen
        time.sleep(0.5)
        assert psutil.STATUS_STOPPED not in {p.status() for p in server.tree()}
        assert _cpu_seconds(busy.pid) > frozen
    finally:
        server.stop()
