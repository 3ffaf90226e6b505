"""The decoder stack (engine/models/decoder_stack.py): the layers in one C++ call give the same bits as the modules'
path, on every step it takes, and the steps it does not take go the modules' way."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from benchmarks.lora_adapters import write_random_adapter
from engine import LLM, SamplingParams
from engine.kernels import cpu_ops
from engine.layers.linear import CppLinearKernels
from lora_cache.local_cache import local_adapters
from tests.helpers import PROMPTS, write_tiny_adapters

pytestmark = pytest.mark.skipif(cpu_ops.load() is None, reason="the C++ CPU operators do not build here")


def _has_own_kernel(dtype: torch.dtype) -> bool:
    """Whether this CPU's linears of `dtype` run on an own kernel, as the stack needs (on an AMX CPU only bf16's:
    oneDNN keeps the float32 linears there, engine/layers/linear.py)."""
    ops = cpu_ops.load()
    return ops is not None and CppLinearKernels(ops).for_weight(torch.zeros(64, 64, dtype=dtype)) is not None


# the dtype the stack serves for the tests of other things than dtypes: float32 where it can, else bf16
STACK_DTYPE = "float32" if _has_own_kernel(torch.float32) else "bfloat16"

SCORED = SamplingParams(max_tokens=16, temperature=0.0, logprobs=3, ignore_eos=True)
LONG_PROMPT = " ".join(PROMPTS) * 3  # past IN_PLACE_CHUNK tokens: its prefill takes the modules' path


def _stack_calls(llm: LLM, monkeypatch) -> list[int]:
    """The tokens of each step the stack ran, observed around its run method."""
    stack = llm.engine.runner.model.decoder_stack
    assert stack is not None, "the stack must be built where the C++ operators are"
    calls: list[int] = []
    run = type(stack).run

    def observed(self, h, tables, meta):
        calls.append(h.shape[0])
        return run(self, h, tables, meta)

    # on the class: an instance attribute closing over the instance's own method would be a reference cycle, and
    # the engine's caches would outlive the test until the collector's next full pass
    monkeypatch.setattr(type(stack), "run", observed)
    return calls


def _scores(outputs) -> list[tuple]:
    return [(o.token_ids, o.logprobs, o.top_logprobs) for o in outputs]


# qwen2: q/k/v with biases; qwen3: per-head q/k norms; phi3: fused checkpoints; phi4: a rotary over half of each
# head; smollm3: a layer without the rotary embedding; granite: its attention scale and residual multiplier;
# gemma: GELU (tanh) and float32 norm scales; gemma2: sandwich norms, capped scores, sliding windows; gemma3: per-head
# q/k norms and a rotary table per kind of layer; olmo2: norms after each sublayer only, q/k norms per projection
@pytest.mark.parametrize("name", ["tiny_llama_path", "tiny_qwen2_path", "tiny_qwen3_path", "tiny_phi3_path",
                                  "tiny_phi4_path", "tiny_smollm3_path", "tiny_granite_path", "tiny_gemma_path",
                                  "tiny_gemma2_path", "tiny_gemma3_path", "tiny_olmo2_path"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stack_gives_the_modules_bits(request, monkeypatch, name, dtype):
    if not _has_own_kernel(getattr(torch, dtype)):
        pytest.skip(f"{dtype} linears have no own kernel on this CPU, so no stack")
    path = str(request.getfixturevalue(name))
    prompts = PROMPTS[:6] + [LONG_PROMPT]
    stacked = LLM(path, dtype=dtype, max_num_seqs=4, log_stats=False)
    calls = _stack_calls(stacked, monkeypatch)
    got = stacked.generate(prompts, SCORED, use_tqdm=False)
    want = LLM(path, dtype=dtype, max_num_seqs=4, decoder_stack=False, log_stats=False).generate(
        prompts, SCORED, use_tqdm=False)
    assert _scores(got) == _scores(want)
    assert len(calls) > SCORED.max_tokens and max(calls) > 1, "decode steps of several sequences run in the stack"
    assert stacked.engine.block_manager.num_used_blocks == 0


# gemma2 and olmo2: the adapters' deltas inside sandwich norms and before post norms
@pytest.mark.parametrize("name", ["tiny_llama_path", "tiny_gemma2_path", "tiny_olmo2_path"])
def test_adapter_steps_give_the_lora_linears_bits(request, name, tmp_path, monkeypatch):
    """Base and adapter requests in one batch, two adapters of different ranks and targets in slots: tokens and
    logprobs as the LoRA linears give them, every step in the stack."""
    path = request.getfixturevalue(name)
    root = write_tiny_adapters(path, tmp_path, ["a"])  # rank 4 on q, k, v, o
    write_random_adapter(root / "b", AutoConfig.from_pretrained(path), rank=8, seed=5,
                         targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    prompts, adapters = PROMPTS[:6], ["a", None, "b", "a", None, "b"]
    options = {"adapters": local_adapters, "max_loras": 2, "adapters_root": str(root), "dtype": STACK_DTYPE,
               "log_stats": False}
    stacked = LLM(str(path), **options)
    calls = _stack_calls(stacked, monkeypatch)
    got = stacked.generate(prompts, SCORED, use_tqdm=False, adapters=adapters)
    modules = LLM(str(path), decoder_stack=False, **options)
    want = modules.generate(prompts, SCORED, use_tqdm=False, adapters=adapters)
    base = modules.generate(prompts[:1], SCORED, use_tqdm=False)
    assert _scores(got) == _scores(want)
    assert got[0].token_ids != base[0].token_ids, "the adapter must change the output"
    assert len(calls) >= SCORED.max_tokens


def test_long_prompt_chunk_takes_the_modules_path(tiny_llama_path, monkeypatch):
    llm = LLM(str(tiny_llama_path), dtype=STACK_DTYPE, log_stats=False)
    calls = _stack_calls(llm, monkeypatch)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    llm.generate([PROMPTS[0]], params, use_tqdm=False)
    assert len(calls) == params.max_tokens, "a short prompt runs every step in the stack"
    calls.clear()
    llm.generate([LONG_PROMPT], SamplingParams(max_tokens=1), use_tqdm=False)
    assert calls == [], "a prompt chunk past the in-place kernel's is not the stack's"


def test_stack_is_built_only_where_every_linear_has_an_own_kernel(tiny_gpt2_path, tiny_llama_path):
    assert LLM(str(tiny_gpt2_path), log_stats=False).engine.runner.model.decoder_stack is None
    assert LLM(str(tiny_llama_path), cpu_kernels=False, log_stats=False).engine.runner.model.decoder_stack is None
    assert LLM(str(tiny_llama_path), decoder_stack=False, log_stats=False).engine.runner.model.decoder_stack is None


def test_operator_refuses_a_malformed_stack():
    ops = cpu_ops.load()
    h, index, rope = torch.zeros(1, 64), torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, 16)
    caches = [torch.zeros(2, 1, 16, 16)] * 2
    weights = [h] * 15

    def call(weights, caches, loras, rope_tables=(), windows=(), activation=0, qk_norm=0):
        ops.decoder_stack(h, weights, caches, [rope], [rope], index, index.view(1, 1), index, index, index, 4, 2, 0,
                          1e-6, loras, index, 4, torch.tensor(rope_tables, dtype=torch.long),
                          torch.tensor(windows, dtype=torch.long), 0.0, 0.0, 0.0, activation, qk_norm)

    with pytest.raises(RuntimeError, match="weights must be 14 tensors per layer"):
        call([h], caches, [])
    with pytest.raises(RuntimeError, match="a key and a value cache per layer"):
        call(weights, caches[:1], [])
    with pytest.raises(RuntimeError, match="loras must be none or 16 tensors per layer"):
        call(weights, caches, [h])
    with pytest.raises(RuntimeError, match="rope_tables must be empty or one int64 per layer: 1, not 2"):
        call(weights, caches, [], rope_tables=[0, 0])
    with pytest.raises(RuntimeError, match="windows must be empty or one int64 per layer: 1, not 2"):
        call(weights, caches, [], windows=[8, 0])
    with pytest.raises(RuntimeError, match="rope_tables: layer 0 names table 1 of 1"):
        call(weights, caches, [], rope_tables=[1])
    with pytest.raises(RuntimeError, match="activation must be 0"):
        call(weights, caches, [], activation=3)
    with pytest.raises(RuntimeError, match="qk_norm must be 0"):
        call(weights, caches, [], qk_norm=-1)
