"""vLLM's side of the engine benchmark: a worker process that runs INSIDE vLLM's virtual environment.

It imports only the standard library and vLLM. One worker holds one `vllm.LLM` (one dtype, LoRA on or off) for
the whole run, so vLLM compiles and warms up once. Jobs arrive as JSON lines on stdin and each answers one JSON
line on stdout, opened by MARK (vLLM logs to stdout too). A job's requests all arrive at once and are stepped through
vLLM's engine the way lora-serve's are (benchmarks/peers/peer_timing.py): the time each request first gets a token
is recorded, so a workload's prefill (until the last first token) and its decode (after it) are timed apart
from one run.

    python vllm_worker.py MODEL_DIR DTYPE MAX_MODEL_LEN MAX_NUM_SEQS [ADAPTER_DIR ...]
"""

import json
import sys
import time
from pathlib import Path

MARK = "PEER-RESULT "  # opens each answer line: vLLM also logs to stdout


def _lora_requests(adapter_dirs):
    from vllm.lora.request import LoRARequest

    return {Path(path).name: LoRARequest(Path(path).name, i + 1, path) for i, path in enumerate(adapter_dirs)}


def _run(llm, loras, job):
    from vllm import SamplingParams

    engine = llm.llm_engine
    first, tokens = {}, {}
    start = time.perf_counter()
    for i, (prompt, max_tokens, adapter) in enumerate(zip(job["prompts"], job["max_tokens"], job["adapters"])):
        params = SamplingParams(max_tokens=max_tokens, temperature=job["temperature"], top_p=job["top_p"],
                                ignore_eos=True)
        prompt = {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt
        engine.add_request(str(i), prompt, params, lora_request=loras[adapter] if adapter else None)
    while engine.has_unfinished_requests():
        for out in engine.step():
            count = len(out.outputs[0].token_ids)
            if count and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - start
            tokens[out.request_id] = count
    return {"seconds": time.perf_counter() - start, "tokens": sum(tokens.values()),
            "first_token_s": sorted(first.values())}


def main():
    model, dtype, adapter_dirs = sys.argv[1], sys.argv[2], sys.argv[5:]
    max_model_len, max_num_seqs = int(sys.argv[3]), int(sys.argv[4])
    from vllm import LLM

    lora = dict(enable_lora=True, max_loras=8, max_lora_rank=8) if adapter_dirs else {}
    llm = LLM(model=model, dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=max_model_len, **lora)
    loras = _lora_requests(adapter_dirs)
    print(MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        try:
            print(MARK + json.dumps(_run(llm, loras, job)), flush=True)
        except Exception as error:  # reported to the parent as a failed job, the worker keeps serving
            print(MARK + json.dumps({"error": f"{type(error).__name__}: {error}"}), flush=True)


if __name__ == "__main__":  # vLLM spawns its engine core: the guard is required
    main()
