"""vLLM's side of the speculative-decoding benchmark: runs INSIDE vLLM's virtual environment, one process per
setting, importing only the standard library and vLLM.

    python vllm_speculative.py MODEL_DIR DTYPE METHOD JOBS_JSON OUT_JSON

METHOD is `off` or `ngram` (vLLM's prompt lookup, with the draft length and n-gram sizes lora-serve uses). Each job
of JOBS_JSON is {"key", "prompts", "streams", "max_tokens"}: the prompts run `streams` at a time, greedy. OUT_JSON
gets each job's tokens/s, and vLLM's own draft counters where it reports them.
"""

import json
import sys
import time


def _counter(llm, name):
    """A vLLM counter's total over its labels, or None where this version does not report it."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 - an older vLLM without get_metrics: no figure, the timing still holds
        return None
    values = [m.value for m in metrics if m.name == name and hasattr(m, "value")]
    return sum(values) if values else None


def _run(llm, job):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0)
    before = [_counter(llm, n) for n in ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")]
    tokens, start = 0, time.perf_counter()
    prompts, streams = job["prompts"], job["streams"]
    for i in range(0, len(prompts), streams):
        outs = llm.generate(prompts[i:i + streams], params, use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    seconds = time.perf_counter() - start
    after = [_counter(llm, n) for n in ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")]
    drafts = [b - a if a is not None and b is not None else None for a, b in zip(before, after)]
    return {"tok_s": tokens / seconds, "tokens": tokens, "proposed": drafts[0], "accepted": drafts[1]}


def main():
    model, dtype, method, jobs_path, out_path = sys.argv[1:6]
    from vllm import LLM

    spec = {} if method == "off" else {"speculative_config": {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}}
    llm = LLM(model=model, dtype=dtype, max_model_len=2048, max_num_seqs=64, disable_log_stats=False, **spec)
    with open(jobs_path) as file:
        jobs = json.load(file)
    llm.generate([jobs[0]["prompts"][0]], use_tqdm=False)  # warm-up
    results = {job["key"]: _run(llm, job) for job in jobs}
    with open(out_path, "w") as out:
        json.dump(results, out)


if __name__ == "__main__":  # vLLM spawns its engine core: the guard is required
    main()
