"""One timed batch of requests, run the same way on lora-serve and on vLLM (benchmarks/peers/vllm_worker.py).

All requests arrive at once; the driver steps the engine until every one is done and records when each got
its first token. From one run that gives throughput (new tokens / wall time), the prefill (until the last
request's first token: with every prompt queued at once, both engines prefill them all before the batch
decodes in full) and the decode rate after it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.peers.vllm_env import vllm_env
from benchmarks.peers.vllm_worker import MARK


@dataclass(frozen=True)
class Batch:
    prompts: list[str | list[int]]  # text, or token ids (the long prompts, cut to an exact length)
    max_tokens: list[int]
    adapters: list[str | None]  # adapter name per request (its folder's name on both sides), None for the base
    temperature: float = 0.0  # 0: greedy; else sampled at this temperature, with top_p
    top_p: float = 1.0

    @property
    def new_tokens(self) -> int:
        return sum(self.max_tokens)


@dataclass
class Timing:
    seconds: float
    tokens: int
    first_token_s: list[float] = field(default_factory=list)  # per request, sorted

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def prefill_s(self) -> float:
        return self.first_token_s[-1]

    @property
    def decode_tok_s(self) -> float:
        """Tokens after each request's first, over the time after the last first token."""
        return (self.tokens - len(self.first_token_s)) / (self.seconds - self.prefill_s)


def run_lora_serve(llm, batch: Batch) -> Timing:
    """The same driver as the vLLM worker's, on lora-serve's engine."""
    from engine import SamplingParams

    engine = llm.engine
    first, tokens = {}, 0
    start = time.perf_counter()
    for i, (prompt, max_tokens, adapter) in enumerate(zip(batch.prompts, batch.max_tokens, batch.adapters)):
        params = SamplingParams(max_tokens=max_tokens, temperature=batch.temperature, top_p=batch.top_p,
                                ignore_eos=True)
        engine.add_request(f"peer-{i}", prompt, params, adapter)
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.new_token_ids)
            first.setdefault(out.request_id, time.perf_counter() - start)
    return Timing(time.perf_counter() - start, tokens, sorted(first.values()))


class VLLMWorker:
    """A vllm_worker.py process in vLLM's environment, kept for the whole run (vLLM compiles once).

    Between its jobs the worker's whole process group is stopped (SIGSTOP): an idle vLLM keeps its OpenMP
    threads, bound to both cores, and its processes polling, which take most of the CPU from lora-serve's runs
    beside them."""

    def __init__(self, python: Path, model_dir: Path, dtype: str, max_model_len: int, adapter_dirs: list[Path],
                 log: Path, kv_cache_gib: int, max_num_seqs: int = 64):
        self.env = vllm_env(python, kv_cache_gib)
        command = [str(python), str(Path(__file__).with_name("vllm_worker.py")), str(model_dir), dtype,
                   str(max_model_len), str(max_num_seqs), *map(str, adapter_dirs)]
        self.log = log.open("w")
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        stderr=subprocess.STDOUT, env=self.env, cwd=log.parent,
                                        start_new_session=True)
        self._read()  # {"ready": true} once the model is loaded and compiled
        self._signal(signal.SIGSTOP)

    def run(self, batch: Batch) -> Timing:
        self._signal(signal.SIGCONT)
        try:
            self.process.stdin.write(json.dumps(asdict(batch)) + "\n")
            self.process.stdin.flush()
            answer = self._read()
        finally:
            self._signal(signal.SIGSTOP)
        return Timing(answer["seconds"], answer["tokens"], answer["first_token_s"])

    def _signal(self, sig: int) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, sig)

    def _read(self) -> dict:
        """The next answer line; vLLM's own output goes to the log."""
        for line in self.process.stdout:
            if line.startswith(MARK):
                answer = json.loads(line[len(MARK):])
                if "error" in answer:
                    raise RuntimeError(f"vLLM: {answer['error']}")
                return answer
            self.log.write(line)
            self.log.flush()
        raise RuntimeError(f"vLLM worker exited (code {self.process.poll()}); see {self.log.name}")

    def close(self) -> None:
        """Ends the worker and everything it started (vLLM's engine core and its worker process share the
        worker's process group), even after a failed job."""
        self._signal(signal.SIGCONT)
        try:
            self.process.stdin.close()
            self.process.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.close()
