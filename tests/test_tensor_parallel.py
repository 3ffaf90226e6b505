"""Tensor parallelism on CPU over gloo: N worker processes (spawned), each holding its rank's shard of the same
model (engine/distributed/), prefill a few prompts into a small paged KV cache of their own heads and decode
greedily, the steps' inputs built as the model runner builds them. Their greedy tokens equal the unsharded model's
(the same code at world size 1) and Hugging Face's, each chosen token's logprob within 1e-4 of both in float32
(the last prompt joins the others' decodes two steps late, as continuous batching admits it): on the C++
operators' path (the in-place attention kernel, the fused norms, rotary and cache writes) and on the PyTorch path
(SDPA prompts, gathered decodes)."""

from __future__ import annotations

import contextlib
import queue
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from engine.distributed.parallel import TensorParallel
from engine.free_ports import free_port
from engine.kernels import cpu_ops
from engine.layers.attention import (
    AttentionMetadata,
    GatheredAttention,
    InPlaceAttention,
    InPlaceQueries,
    PrefillSegment,
    block_rows,
)
from engine.models import check_tensor_parallel, load_model, use_fused_ops
from engine.models.packing import CppPacked, OneDnnPacked
from tests.helpers import PROMPTS

BLOCK = 16  # tokens a KV block holds (a multiple of the C++ kernel's vector width)
STEPS = 6  # tokens each prompt generates: its prefill's, then decodes
LATE_START = 2  # the step at which the last prompt joins the others' decodes, as continuous batching admits it
MAX_LEN = 128
TOLERANCE = 1e-4  # max |logprob difference| of any token a step chose, float32
WORKER_TIMEOUT_S = 240
KERNELS = cpu_ops.load() is not None


def _tensor(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def _metadata(chunks, tables, starts, slots, caches, ops) -> AttentionMetadata:
    """A step's attention metadata, as the step backend builds it (decodes first, then fresh prompts):
    with the C++ operators every chunk (all short here) attends in the in-place kernel; without, decodes attend over
    their gathered blocks and prompts through SDPA."""
    lens = [len(new) for new, _ in chunks]
    ends = [start + n for (_, start), n in zip(chunks, lens)]
    if ops is not None:
        queries = InPlaceQueries(_tensor(tables), _tensor(ends), _tensor(starts), _tensor(lens))
        return InPlaceAttention(slots, 0, [], ops.write_kv_cache, in_place=queries)
    decodes = sum(start > 0 for _, start in chunks)
    prefills = [PrefillSegment(row, n, n, None) for row, n in zip(starts[decodes:], lens[decodes:])]
    if not decodes:
        return GatheredAttention(slots, 0, prefills)
    block_tables, context_lens = _tensor(tables[:decodes]), _tensor(ends[:decodes])
    visible = torch.arange(block_tables.shape[1] * BLOCK)[None, :] < context_lens[:, None]
    mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))[:, None, None, :]
    k_cache = caches[0][0]
    return GatheredAttention(slots, decodes, prefills, decode_block_tables=block_tables, decode_mask=mask,
                             decode_rows=block_rows(block_tables, k_cache.shape[0], k_cache.shape[1]))


def _step(model, caches, chunks, tables, ops) -> torch.Tensor:
    """One flat batch of chunks (per sequence its new tokens and first position): the log-softmax of each
    sequence's last row of logits, [sequences, vocab]."""
    ids, positions, slots, starts = [], [], [], []
    for (new, start), table in zip(chunks, tables):
        starts.append(len(ids))
        ids += new
        positions += range(start, start + len(new))
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + len(new))]
    meta = _metadata(chunks, tables, starts, _tensor(slots), caches, ops)
    hidden = model(_tensor(ids), _tensor(positions), caches, meta)
    last = _tensor([row + len(new) - 1 for row, (new, _) in zip(starts, chunks)])
    return model.compute_logits(hidden[last]).float().log_softmax(-1)


def _load(path: str, parallel: TensorParallel, ops):
    from transformers import AutoConfig

    model = load_model(Path(path), AutoConfig.from_pretrained(path), torch.float32, torch.device("cpu"), MAX_LEN,
                       packing=CppPacked(ops) if ops is not None else OneDnnPacked(), parallel=parallel)
    if ops is not None:
        use_fused_ops(model, ops)
    return model


def _generate(path: str, parallel: TensorParallel, prompts: list[list[int]], kernels: bool):
    """This rank's greedy run, the last prompt joining at LATE_START: each prompt's tokens and the logprob rows
    they were chosen from, [prompts, STEPS, vocab]."""
    ops = cpu_ops.load() if kernels else None
    model = _load(path, parallel, ops)
    layers, kv_heads, head_dim = model.kv_shape
    whole = getattr(model.config, "num_key_value_heads", None) or model.config.n_head
    assert kv_heads * parallel.world_size == whole  # the cache of the rank's own KV heads alone
    per_seq = -(-MAX_LEN // BLOCK)
    cache = torch.zeros(layers, 2, kv_heads, per_seq * len(prompts), BLOCK, head_dim)
    caches = [(cache[i, 0], cache[i, 1]) for i in range(layers)]
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    joins = [0] * (len(prompts) - 1) + [LATE_START]
    tokens, rows = [[] for _ in prompts], [[] for _ in prompts]
    with torch.inference_mode():
        for step in range(LATE_START + STEPS):
            decoding = [i for i, out in enumerate(tokens) if 0 < len(out) < STEPS]
            starting = [i for i, out in enumerate(tokens) if not out and joins[i] == step]
            chunks = [([tokens[i][-1]], len(prompts[i]) + len(tokens[i]) - 1) for i in decoding]
            chunks += [(list(prompts[i]), 0) for i in starting]
            batch = decoding + starting
            for i, row in zip(batch, _step(model, caches, chunks, [tables[i] for i in batch], ops)):
                rows[i].append(row)
                tokens[i].append(int(row.argmax()))
    return tokens, torch.stack([torch.stack(r) for r in rows]).numpy()


def _worker(rank: int, world_size: int, port: int, runs, kernels: bool, results) -> None:
    """A spawned worker: join the gloo group, run each (model path, prompts) of `runs`, and put (rank, run, tokens,
    rows) on the queue for each (the rows from rank 0 alone), or (rank, -1, its traceback, None)."""
    from engine.distributed.process_group import join, leave

    torch.set_num_threads(1)
    parallel = join(rank, world_size, f"tcp://127.0.0.1:{port}", torch.device("cpu"))
    try:
        for index, (path, prompts) in enumerate(runs):
            tokens, rows = _generate(path, parallel, prompts, kernels)
            results.put((rank, index, tokens, rows if rank == 0 else None))
    except BaseException:
        results.put((rank, -1, traceback.format_exc(), None))
        raise
    finally:
        leave(parallel)


def _next_result(results, workers):
    """The next result a worker put, failing at once if a worker died without putting one (a crash in a
    collective, say) rather than after WORKER_TIMEOUT_S."""
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            return results.get(timeout=1)
        dead = [worker.exitcode for worker in workers if worker.exitcode not in (None, 0)]
        assert not dead, f"a worker died with exit code {dead[0]} before putting its results"
    raise TimeoutError(f"no worker result within {WORKER_TIMEOUT_S} s")


def _sharded(runs, world_size: int, kernels: bool) -> list:
    """Per (model path, prompts) of `runs`, rank 0's tokens and rows from world_size spawned workers; every rank
    chose the same tokens."""
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    workers = [ctx.Process(target=_worker, args=(rank, world_size, port, runs, kernels, results), daemon=True)
               for rank in range(world_size)]
    for worker in workers:
        worker.start()
    got: dict[tuple[int, int], tuple] = {}
    try:
        while len(got) < world_size * len(runs):
            rank, index, tokens, rows = _next_result(results, workers)
            assert index >= 0, f"rank {rank} failed:\n{tokens}"
            got[rank, index] = tokens, rows
    finally:
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
    for (_, index), (tokens, _) in got.items():
        assert tokens == got[0, index][0], f"the ranks chose different tokens in run {index}"
    return [got[0, index] for index in range(len(runs))]


def _hf_rows(path, prompts, tokens) -> np.ndarray:
    """Hugging Face's float32 logprob rows at the positions whose tokens the engine chose, [prompts, STEPS, vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.inference_mode():
        return np.stack([model(_tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1:].float().log_softmax(-1)
                         .numpy() for prompt, out in zip(prompts, tokens)])


def _chosen_difference(tokens, rows, reference_rows) -> float:
    """The largest |logprob difference| over the tokens chosen, each against the reference's row."""
    chosen = np.array(tokens)[..., None]  # [prompts, STEPS, 1]
    return float(np.abs(np.take_along_axis(rows, chosen, -1) - np.take_along_axis(reference_rows, chosen, -1)).max())


def _check_sharded(paths, tokenizer, world_size: int, kernels: bool, prompts=PROMPTS[:4]) -> None:
    """Each model sharded over world_size workers: the greedy tokens of the unsharded model and of Hugging Face,
    every chosen token's logprob within TOLERANCE of both."""
    ids = [tokenizer(prompt).input_ids for prompt in prompts]
    for path, (tokens, rows) in zip(paths, _sharded([(str(path), ids) for path in paths], world_size, kernels)):
        whole_tokens, whole_rows = _generate(str(path), TensorParallel.single(), ids, kernels)
        assert tokens == whole_tokens, f"{path}: sharded tokens differ from the unsharded model's"
        hf_rows = _hf_rows(path, ids, tokens)
        assert (hf_rows.argmax(-1) == np.array(tokens)).all(), f"{path}: greedy tokens differ from Hugging Face's"
        differences = {"unsharded": _chosen_difference(tokens, rows, whole_rows),
                       "hf": _chosen_difference(tokens, rows, hf_rows)}
        print(f"{Path(path).name} N={world_size} kernels={kernels}: max |logprob difference| of the chosen tokens "
              f"{differences}; over whole rows, unsharded {np.abs(rows - whole_rows).max():.2e}")
        assert max(differences.values()) <= TOLERANCE, (path, differences)


@pytest.mark.parametrize("kernels", [pytest.param(True, marks=pytest.mark.skipif(
    not KERNELS, reason="the C++ operators did not build")), False], ids=["cpu-kernels", "pytorch-paths"])
def test_tiny_llama_sharded_over_two_workers_matches_unsharded_and_hf(tiny_llama_path, tokenizer, kernels):
    _check_sharded([tiny_llama_path], tokenizer, 2, kernels)


def test_tiny_qwen2_sharded_over_two_workers_matches_unsharded_and_hf(tiny_qwen2_path, tokenizer):
    """Qwen2's q, k and v biases split with their heads; its tied LM head shares the embedding's vocabulary shard."""
    _check_sharded([tiny_qwen2_path], tokenizer, 2, KERNELS)


@pytest.mark.skipif(not KERNELS, reason="Gemma 2's capped scores and windows attend in the C++ kernel alone")
def test_llama_variants_sharded_over_two_workers_match_unsharded_and_hf(request, tokenizer):
    """How the variants depart from Llama survives the split: Qwen3's per-head query and key norms (head_dim apart
    from hidden / heads), Phi-3's q/k/v and gate/up fused in its checkpoint, Gemma 2's sandwich norms, capped
    scores, sliding window and capped logits, Granite's four multipliers, SmolLM3's layers without rotary."""
    names = ["tiny_qwen3_path", "tiny_phi3_path", "tiny_gemma2_path", "tiny_granite_path", "tiny_smollm3_path"]
    _check_sharded([request.getfixturevalue(name) for name in names], tokenizer, 2, KERNELS)


@pytest.fixture(scope="module")
def tiny_gpt2_odd_vocab_path(tmp_path_factory, tokenizer):
    """A GPT-2 whose vocabulary (one past the tokenizer's) two workers split only with a padded row."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(2)
    config = GPT2Config(vocab_size=len(tokenizer) + 1, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                        initializer_range=0.2, eos_token_id=tokenizer.eos_token_id,
                        bos_token_id=tokenizer.bos_token_id)
    path = tmp_path_factory.mktemp("tiny-gpt2-odd-vocab")
    GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_tiny_gpt2_with_a_padded_vocabulary_sharded_over_two_workers_matches(tiny_gpt2_odd_vocab_path, tokenizer):
    """GPT-2's fused c_attn split by heads, biases of the row-parallel c_proj added once after the sum, learned
    positions whole on every rank, the tied vocabulary padded to two equal shards."""
    _check_sharded([tiny_gpt2_odd_vocab_path], tokenizer, 2, KERNELS)


@pytest.mark.slow
def test_smollm2_sharded_over_three_workers_matches_unsharded_and_hf(smollm2_path, tokenizer):
    """SmolLM2-135M: 9 query heads and 3 KV heads, 3 query heads and one KV head a worker; tied embeddings."""
    _check_sharded([smollm2_path], tokenizer, 3, KERNELS, PROMPTS[:3])


def test_sizes_that_do_not_split_are_refused_naming_both_numbers(smollm2_path, tiny_llama_path):
    from transformers import AutoConfig, GPT2Config, Olmo2Config

    with pytest.raises(ValueError, match="tensor_parallel_size 2 does not divide num_attention_heads 9"):
        check_tensor_parallel(AutoConfig.from_pretrained(smollm2_path), 2)
    with pytest.raises(ValueError, match="tensor_parallel_size 4 does not divide num_key_value_heads 2"):
        check_tensor_parallel(AutoConfig.from_pretrained(tiny_llama_path), 4)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide intermediate_size 128"):
        check_tensor_parallel(AutoConfig.from_pretrained(tiny_llama_path, num_attention_heads=6,
                                                         num_key_value_heads=3), 3)
    with pytest.raises(ValueError, match="query and key norms over whole projections"):
        check_tensor_parallel(Olmo2Config(num_attention_heads=4, num_key_value_heads=2,
                                          architectures=["Olmo2ForCausalLM"]), 2)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide n_head 4"):
        check_tensor_parallel(GPT2Config(n_head=4, n_embd=64, architectures=["GPT2LMHeadModel"]), 3)
    check_tensor_parallel(AutoConfig.from_pretrained(smollm2_path), 3)


def test_one_worker_builds_the_model_unsharded(tiny_llama_path):
    """World size 1 holds no group and shards nothing: the model's modules are those of a load without it."""
    from transformers import AutoConfig

    with pytest.raises(ValueError, match="needs a process group"):
        TensorParallel(0, 2, None)
    with pytest.raises(ValueError, match="rank 2 is outside a tensor-parallel group of 2"):
        TensorParallel(2, 2, None)
    config = AutoConfig.from_pretrained(tiny_llama_path)
    plain = load_model(tiny_llama_path, config, torch.float32, torch.device("cpu"), MAX_LEN)
    single = load_model(tiny_llama_path, config, torch.float32, torch.device("cpu"), MAX_LEN,
                        parallel=TensorParallel.single())
    assert [type(m) for m in single.modules()] == [type(m) for m in plain.modules()]
    assert single.tensor_parallel is None and single.kv_shape == plain.kv_shape
