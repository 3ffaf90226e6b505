"""The engine benchmark's comparison with vLLM: its requests, its interleaved rounds and its figures (no vLLM
and no model needed: the two sides are stand-ins that record what they are asked)."""

from __future__ import annotations

import pytest

from benchmarks.peers import peer_compare, peer_report
from benchmarks.peers.peer_compare import PeerJob, Sizes
from benchmarks.peers.peer_timing import Batch, Timing

SIZES = Sizes.quick()


def test_every_run_gets_prompts_no_engine_has_seen(tokenizer):
    for job in peer_compare.jobs("float32"):
        first = peer_compare.batch_for(job, SIZES, "Round 0", tokenizer)
        again = peer_compare.batch_for(job, SIZES, "Round 1", tokenizer)
        assert not set(map(str, first.prompts)) & set(map(str, again.prompts)), job
        assert len(set(map(str, first.prompts))) == len(first.prompts), job  # no shared prompt inside a run


def test_workload_shapes(tokenizer):
    batch = {f"{job.workload}/{job.dtype}": peer_compare.batch_for(job, SIZES, "n", tokenizer)
             for job in peer_compare.jobs("float32")}
    assert batch["b/bfloat16"].max_tokens[:4] == list(SIZES.mixed)
    assert (batch["a/float32"].temperature, batch["a/float32"].top_p) == (0.0, 1.0)  # greedy
    sampled = batch["s/float32"]
    assert (sampled.temperature, sampled.top_p) == (1.0, 0.9) and sampled.max_tokens == batch["a/float32"].max_tokens
    assert len(batch["d/float32"].prompts) == 1 and batch["d/float32"].max_tokens == [SIZES.stream_tokens]
    lora = batch["lora/float32"].adapters
    assert lora[:peer_compare.LORA_ADAPTERS] == [f"adapter-{i}" for i in range(peer_compare.LORA_ADAPTERS)]
    long = batch["e/float32"]
    assert all(len(p) == SIZES.long_prompt for p in long.prompts) and len(long.prompts) == SIZES.long_requests
    assert long.adapters == [None] * SIZES.long_requests


class Recorder:
    """Both sides of the comparison, answering at once and keeping the order they were called in."""

    def __init__(self, fail_vllm_on: str | None = None):
        self.calls, self.fail_vllm_on = [], fail_vllm_on

    def run_lora_serve(self, job: PeerJob, batch: Batch) -> Timing:
        return self._answer("lora-serve", job, batch, 2.0)

    def run_vllm(self, job: PeerJob, batch: Batch) -> Timing:
        if job.workload == self.fail_vllm_on:
            raise RuntimeError("worker exited")
        return self._answer("vLLM", job, batch, 4.0)

    def _answer(self, side: str, job: PeerJob, batch: Batch, seconds: float) -> Timing:
        self.calls.append((side, job))
        return Timing(seconds, batch.new_tokens, [seconds / 4] * len(batch.prompts))


def test_rounds_alternate_which_side_goes_first_and_rotate_the_workloads(tokenizer, monkeypatch):
    monkeypatch.setattr(peer_compare.time, "sleep", lambda s: None)
    engines = Recorder()
    results = peer_compare.run(engines, tokenizer, SIZES, 3, "float32")
    jobs = peer_compare.jobs("float32")
    per_round = len(jobs) * 2
    rounds = [engines.calls[i:i + per_round] for i in range(0, len(engines.calls), per_round)]
    assert [r[0][0] for r in rounds] == ["lora-serve", "vLLM", "lora-serve"]
    assert [r[0][1] for r in rounds] == jobs[:3]
    assert all(len(r.lora_serve) == len(r.vllm) == 3 and r.error is None for r in results)


def test_ratios_read_as_speed_and_a_failing_side_is_a_row_not_a_crash(tokenizer, monkeypatch):
    monkeypatch.setattr(peer_compare.time, "sleep", lambda s: None)
    results = peer_compare.run(Recorder(fail_vllm_on="e"), tokenizer, SIZES, 1, "float32")
    rows = {(r.workload, r.dtype, r.metric.label): r for r in peer_report.rows(results)}
    assert rows[("a", "float32", "tok/s")].ratio == pytest.approx(2.0)  # half the time: twice the speed
    assert rows[("d", "float32", "ms/token")].ratio == pytest.approx(2.0)  # lower is better, ratio still > 1
    failed = rows[("e", "float32", "prefill s")]
    assert failed.ratio is None and "worker exited" in failed.error
    text = peer_report.markdown(list(rows.values()), 1, {"vllm": "v", "lora_serve": "l"})
    assert "2.00" in text and "**error**: vLLM: RuntimeError: worker exited" in text


def test_timing_splits_prefill_from_decode():
    timing = Timing(seconds=10.0, tokens=16 * 128, first_token_s=sorted([1.0 + i * 0.25 for i in range(16)]))
    assert timing.prefill_s == 4.75
    assert timing.decode_tok_s == pytest.approx(16 * 127 / 5.25)


def test_a_selection_runs_the_workloads_and_dtypes_named_and_refuses_others(tokenizer, monkeypatch):
    monkeypatch.setattr(peer_compare.time, "sleep", lambda s: None)
    selection = peer_compare.Selection(("a", "e"), ("float32",))
    assert peer_compare.jobs("bfloat16", selection) == [PeerJob("a", "float32"), PeerJob("e", "bfloat16")]
    engines = Recorder()
    rows = peer_report.rows(peer_compare.run(engines, tokenizer, SIZES, 1, "bfloat16", selection))
    assert {job for _, job in engines.calls} == set(peer_compare.jobs("bfloat16", selection))
    assert {(r.workload, r.dtype) for r in rows} == {("a", "float32"), ("e", "bfloat16")}
    assert "adapters" not in peer_report.markdown(rows, 1, {"vllm": "v", "lora_serve": "l"})  # no LoRA, no share
    assert len(peer_compare.jobs("float32")) == 11
    for workloads, dtypes in ((("a", "f"), ("float32",)), (("a",), ("float16",)), ((), ("float32",))):
        with pytest.raises(ValueError, match="workloads must be among a, s, b, d, lora, e"):
            peer_compare.Selection(workloads, dtypes)
    forced = peer_compare.Selection(("e",), long_dtype="bfloat16")
    assert peer_compare.jobs(forced.long_dtype_for(False), forced) == [PeerJob("e", "bfloat16")]
    assert [peer_compare.Selection().long_dtype_for(native) for native in (False, True)] == ["float32", "bfloat16"]
    with pytest.raises(ValueError, match="got fp8"):
        peer_compare.Selection(("a",), vllm_dtype="fp8")


def test_the_cli_refuses_an_unknown_workload_by_name():
    from benchmarks.engine import run_engine

    with pytest.raises(SystemExit, match="got x"):
        run_engine.main(["--workloads", "a,x"])
