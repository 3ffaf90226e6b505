"""The engine under tensor parallelism on CPU over gloo: LLM(..., tensor_parallel_size=2) runs rank 0 in the test's
process and rank 1 in a spawned worker, each step's ForwardBatch broadcast to it once (engine/distributed/).

One engine per model covers the scheduler's paths at once: more prompts than max_num_seqs (queued), a KV cache
small enough to preempt, a token budget that prefills prompts in chunks, and, generated again, prompts whose
blocks the prefix cache holds. Its greedy tokens equal the unsharded engine's under the same options and Hugging
Face's, each chosen token's logprob (and each prompt token's, where asked) within 1e-4 of the unsharded engine's
in float32. Mixed-adapter batches over sharded adapters give PEFT's merged models' tokens. What it does not run
yet is refused at start, by name."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.executor.workers import WorkerDiedError
from engine.forward_batch import ForwardBatch
from engine.layers.attention import PagedAttention, PrefillSegment
from engine.lora.segments import AdapterRun
from lora_cache.local_cache import local_adapters
from tests.helpers import GREEDY, PROMPTS, hf_greedy, peft_adapters

TOLERANCE = 1e-4
MAX_TOKENS = 16
# queued (16 prompts, 4 running), preempted (40 blocks of 4 tokens for 4 sequences of up to 32), chunked prefill
# (8 tokens a step), the prefix cache on
# steps by tokens alone: time-sized steps and the waiting queue's aging follow each engine's own step times, and
# the two engines compared here must schedule (and preempt) alike
STRESSED = {"dtype": "float32", "log_stats": False, "kv_cache_bytes": 32 << 20, "max_num_seqs": 4,
            "num_kv_blocks": 24, "block_size": 4, "max_num_batched_tokens": 8, "step_time_target_s": None}
SHARED_PREFIX = "The quick sort algorithm works by choosing a pivot element and then"


def _params(count: int) -> list[SamplingParams]:
    """Greedy with the chosen tokens' logprobs; every third request scores its prompt too."""
    return [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0,
                           prompt_logprobs=0 if i % 3 == 0 else None) for i in range(count)]


def _phases(llm: LLM) -> list:
    """Every prompt (queued, preempted, chunked), then a few again and two sharing a prefix (prefix cache hits)."""
    first = llm.generate(PROMPTS, _params(len(PROMPTS)), use_tqdm=False)
    again = PROMPTS[:2] + [SHARED_PREFIX + " splitting", SHARED_PREFIX + " partitioning"]
    second = llm.generate(again, _params(len(again)), use_tqdm=False)
    return first + second


def _difference(sharded: list[float | None], whole: list[float | None]) -> float:
    pairs = [(a, b) for a, b in zip(sharded, whole) if a is not None]
    return max((abs(a - b) for a, b in pairs), default=0.0)


def _check_against_unsharded(path) -> LLM:
    """The N=2 engine's outputs against N=1's under the same options; the N=2 engine is returned open."""
    whole_llm = LLM(str(path), **STRESSED)
    whole = _phases(whole_llm)
    assert whole_llm.engine.scheduler.total_preemptions > 0, "the options no longer preempt"
    llm = LLM(str(path), tensor_parallel_size=2, **STRESSED)
    sharded = _phases(llm)
    token_diff = prompt_diff = 0.0
    for s, w in zip(sharded, whole):
        assert s.token_ids == w.token_ids, f"{path.name}: {s.prompt!r} differs from the unsharded engine's"
        assert len(s.logprobs) == len(w.logprobs) == len(s.token_ids)
        token_diff = max(token_diff, _difference(s.logprobs, w.logprobs))
        prompt_diff = max(prompt_diff, _difference(s.prompt_logprobs, w.prompt_logprobs))
    assert any(s.prompt_logprobs for s in sharded)
    assert max(len(s.prompt_token_ids) for s in sharded) > STRESSED["max_num_batched_tokens"]  # prefilled in chunks
    stats = llm.engine.stats()
    assert stats.preemptions == whole_llm.engine.stats().preemptions > 0
    assert stats.prefix_cache_hit_tokens > 0
    assert llm.engine.block_manager.num_used_blocks == 0
    print(f"{path.name} N=2: max |logprob difference| from N=1, chosen tokens {token_diff:.2e}, prompt tokens "
          f"{prompt_diff:.2e}")
    assert token_diff <= TOLERANCE and prompt_diff <= TOLERANCE
    reference = hf_greedy(path, PROMPTS, MAX_TOKENS)
    assert [s.token_ids for s in sharded[:len(PROMPTS)]] == reference, f"{path.name}: differs from Hugging Face"
    return llm


def _worker_exit_codes(llm: LLM) -> list[int | None]:
    return [process.exitcode for process in llm.engine.executor.workers.processes]


def test_tiny_llama_over_two_workers_equals_one_and_a_dead_worker_is_named(tiny_llama_path):
    llm = _check_against_unsharded(tiny_llama_path)
    worker = llm.engine.executor.workers.processes[0]
    os.kill(worker.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"worker rank 1 \(pid \d+\) exited with code -9"):
        llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert time.monotonic() - started < 10
    llm.close()
    llm.close()  # idempotent


def test_tiny_qwen2_over_two_workers_equals_one(tiny_qwen2_path):
    """Qwen2's q/k/v biases split with their heads; its tied LM head shares the embedding's vocabulary shard."""
    with _check_against_unsharded(tiny_qwen2_path) as llm:
        workers = llm.engine.executor.workers.processes
    assert [w.exitcode for w in workers] == [0], "a worker did not exit cleanly on close"


def test_tiny_gpt2_over_two_workers_equals_one(tiny_gpt2_path):
    """GPT-2's fused c_attn split by heads, learned positions whole on every rank. Then a worker whose step fails
    (here a message it cannot run) ends its process at once, and the driver's next step names it."""
    llm = _check_against_unsharded(tiny_gpt2_path)
    llm.engine.executor.channel.send("not a step")
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"worker rank 1 \(pid \d+\) exited with code 1"):
        llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert time.monotonic() - started < 10
    llm.close()


def test_what_does_not_split_or_run_yet_is_refused_by_name(tiny_llama_path):
    with pytest.raises(ValueError, match="tensor_parallel_size 4 does not divide num_key_value_heads 2"):
        LLM(str(tiny_llama_path), tensor_parallel_size=4, log_stats=False)
    with pytest.raises(ValueError, match="async_scheduling under tensor parallelism is not supported yet"):
        LLM(str(tiny_llama_path), tensor_parallel_size=2, async_scheduling=True, log_stats=False)
    with pytest.raises(ValueError, match="quantization 'int8' under tensor parallelism is not supported yet"):
        LLM(str(tiny_llama_path), tensor_parallel_size=2, quantization="int8", log_stats=False)
    with pytest.raises(ValueError, match="kv_cache_memory_fraction under tensor parallelism is not supported yet"):
        EngineConfig.from_overrides(str(tiny_llama_path), tensor_parallel_size=2, kv_cache_memory_fraction=0.5)
    with pytest.raises(ValueError, match="tensor_parallel_size must be positive, got 0"):
        EngineConfig.from_overrides(str(tiny_llama_path), tensor_parallel_size=0)


def test_more_workers_than_the_nodes_gpus_are_refused_naming_both_numbers(tiny_llama_path):
    """From the node's last GPU on (cuda:<count>, whatever this machine has), two workers cannot each have one."""
    count = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"tensor_parallel_size 2 needs 2 GPUs from cuda:{count}; this node has "
                                         f"{count}"):
        LLM(str(tiny_llama_path), device=f"cuda:{count}", tensor_parallel_size=2, log_stats=False)


def test_a_steps_batch_travels_with_every_tensor_on_the_host_and_lands_on_the_ranks_device():
    """ForwardBatch.portable/on carry each tensor of the step, nested ones included, from device to device (here
    to the meta device, as a worker carries it to its own GPU), and drop the runner's own cache writer."""
    segment = PrefillSegment(start=1, length=3, context_len=5, block_table=torch.tensor([2, 3]))
    attention = PagedAttention(torch.arange(4), 1, [segment], print,
                               decode_block_tables=torch.zeros(1, 2, dtype=torch.long),
                               decode_context_lens=torch.tensor([3]))
    batch = ForwardBatch(torch.arange(4), torch.arange(4), attention, [AdapterRun(-1, 4)], [0, 3], [])
    sent = batch.portable()
    assert sent.attention.kv_write is None and sent.input_ids is batch.input_ids  # on the host already: no copy
    landed = sent.on(torch.device("meta"))
    tensors = [landed.input_ids, landed.positions, landed.attention.slot_mapping, landed.attention.decode_block_tables,
               landed.attention.decode_context_lens, landed.attention.prefills[0].block_table]
    assert all(t.device.type == "meta" for t in tensors)
    assert landed.adapter_runs == batch.adapter_runs and landed.sample_rows == [0, 3]
    assert landed.attention.prefills[0].context_len == 5 and type(landed.attention) is PagedAttention


@pytest.mark.parametrize("base_fixture, specs", [("tiny_llama_path", "LLAMA_ADAPTERS"),
                                                 ("tiny_phi3_path", "PHI3_ADAPTERS"),  # fused q/k/v in one module
                                                 ("tiny_gpt2_path", "GPT2_ADAPTERS")])
def test_mixed_adapter_batches_over_two_workers_match_peft_merged(request, tmp_path_factory, base_fixture, specs):
    """Column-parallel linears hold B's rows of the rank's heads or columns, row-parallel ones A's inputs (each
    rank's delta summed with its partial product); 2 slots for 4 adapters of ranks 4 to 16: slots are reloaded."""
    from tests import test_multi_lora as multi

    base_path, specs = request.getfixturevalue(base_fixture), getattr(multi, specs)
    root = tmp_path_factory.mktemp(f"tp-adapters-{base_fixture}")
    references = peft_adapters(base_path, root, specs, seed=20)
    with LLM(str(base_path), tensor_parallel_size=2, adapters=local_adapters, max_loras=2, adapters_root=str(root),
             dtype="float32", log_stats=False) as llm:
        base = llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
        prompts = [p for p in PROMPTS[:4] for _ in range(len(specs) + 1)]
        adapters = [a for _ in PROMPTS[:4] for a in (None, *specs)]
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False, adapters=adapters)
        assert llm.engine.adapter_slots.evictions > 0
    for i, (out, adapter) in enumerate(zip(outputs, adapters)):
        want = base[i // (len(specs) + 1)].token_ids if adapter is None else references[adapter][i // (len(specs) + 1)]
        assert out.token_ids == want, f"{base_fixture}: adapter {adapter} on {prompts[i]!r}"
    assert any(references[name][0] != base[0].token_ids for name in specs), "adapters must change outputs"


def test_an_adapters_shards_are_cut_as_the_base_linears_are():
    """Row-parallel: A by input columns, B whole; column-parallel: B's rows of each fused part apart (a fused
    checkpoint's qkv_proj stacks q, k and v of unequal sizes), A whole. Rank shards put together give the whole."""
    import torch

    from engine.distributed.parallel import TensorParallel
    from engine.lora.provider import LoRAWeights
    from engine.lora.shards import LoRALayout, ModuleShard, sub_parts

    assert sub_parts([8, 4, 4], (8, 4, 4)) == [(8,), (4,), (4,)]
    assert sub_parts([16], (8, 4, 4)) == [(8, 4, 4)]
    with pytest.raises(ValueError, match="does not cover whole parts"):
        sub_parts([10, 6], (8, 4, 4))
    layout = LoRALayout({"o": ModuleShard(True), "qkv": ModuleShard(False, (8, 4, 4))})
    weights = LoRAWeights(torch.randn(3, 6), torch.randn(16, 3), 2.0)
    ranks = [TensorParallel(r, 2, group=object()) for r in range(2)]
    row = [layout.shard("o", weights, p) for p in ranks]
    assert torch.equal(torch.cat([s.lora_a for s in row], dim=1), weights.lora_a)
    assert all(torch.equal(s.lora_b, weights.lora_b) and s.scaling == 2.0 for s in row)
    column = [layout.shard("qkv", weights, p) for p in ranks]
    assert all(torch.equal(s.lora_a, weights.lora_a) for s in column)
    b = weights.lora_b
    assert torch.equal(column[0].lora_b, torch.cat([b[0:4], b[8:10], b[12:14]]))
    assert torch.equal(column[1].lora_b, torch.cat([b[4:8], b[10:12], b[14:16]]))
