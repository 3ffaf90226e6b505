"""Mixtures of experts (engine/models/moe.py): tiny random Qwen3-MoE, Mixtral and OLMoE models in float32 give
Hugging Face generate's greedy tokens, queued, preempted and prefilled in chunks, with logprobs within 1e-4 of
transformers' teacher-forced ones; bf16 within the dense models' tolerance of transformers' bf16; checkpoints in
transformers 5's fused expert layout; batches of base and attention-adapter requests equal to PEFT's merged
models; and what is not built yet (experts sharded, quantized or targeted by adapters, the router targeted) refused
by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.errors import AdapterError
from engine.kernels import cpu_ops
from engine.lora.expert_linear import ExpertLoRA
from engine.lora.merge_spec import MergeSpec
from engine.models import experts
from engine.models.experts import Experts
from engine.models.packing import CppPacked
from lora_cache.adapter import read_adapter
from lora_cache.local_cache import local_adapters
from lora_cache.merge import merge_adapters
from tests.helpers import GREEDY, PROMPTS, _hf_model, hf_greedy, lora_shapes_of, peft_adapters, write_tiny_adapters

MODELS = ["tiny_qwen3_moe_path", "tiny_mixtral_path", "tiny_olmoe_path"]
TOLERANCE = 1e-4


def _check(llm: LLM, prompts, reference, params):
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out, ref in zip(prompts, outputs, reference):
        assert out.token_ids == ref, f"mismatch for {prompt!r}: got {out.token_ids}, want {ref}"
    assert llm.engine.block_manager.num_used_blocks == 0
    return outputs


@pytest.mark.parametrize("name", MODELS)
def test_tiny_moe_models_match_hf_queued_preempted_and_chunked(request, name):
    """On the C++ grouped expert kernel (where this machine builds the operators), and expert by expert on
    PyTorch's linears without them."""
    path = request.getfixturevalue(name)
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=0)
    reference = hf_greedy(path, PROMPTS, params.max_tokens)
    grouped = LLM(str(path), max_num_seqs=3, log_stats=False)
    assert _grouped(grouped) == (grouped.engine.runner.device.type == "cpu" and cpu_ops.load() is not None)
    outputs = _check(grouped, PROMPTS, reference, params)
    preempting = LLM(str(path), max_num_seqs=16, num_kv_blocks=20, block_size=4, max_num_batched_tokens=24,
                     log_stats=False)
    _check(preempting, PROMPTS, reference, params)
    assert preempting.engine.scheduler.total_preemptions > 0
    assert _logprob_gap(path, outputs) < TOLERANCE
    per_expert = LLM(str(path), max_num_seqs=3, cpu_kernels=False, log_stats=False)
    assert not _grouped(per_expert)
    assert _logprob_gap(path, _check(per_expert, PROMPTS, reference, params)) < TOLERANCE


@pytest.mark.parametrize("name", MODELS)
def test_the_triton_grouped_experts_match_hf(request, name, monkeypatch):
    """cuda_experts="grouped": every expert of a layer in one Triton grouped product. On CUDA the option chooses it;
    on CPU, where the C++ operator always serves, it is forced in place of that one, in Triton's interpreter."""
    path = request.getfixturevalue(name)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)
    if not torch.cuda.is_available():
        pytest.importorskip("triton")
        kernel = experts.triton_grouped_kernel()
        monkeypatch.setattr(CppPacked, "grouped_experts", lambda *args: kernel)
    llm = LLM(str(path), max_num_seqs=3, cuda_experts="grouped", log_stats=False)
    assert _grouped(llm)
    outputs = _check(llm, PROMPTS[:3], hf_greedy(path, PROMPTS[:3], params.max_tokens), params)
    assert _logprob_gap(path, outputs) < TOLERANCE


def _grouped(llm: LLM) -> bool:
    """Whether every layer's experts run on the grouped kernel (else each expert's linears of their own)."""
    experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, Experts)]
    assert experts
    return all(m.kernel is not None for m in experts)


@torch.no_grad()
def _teacher_forced(model, outputs) -> torch.Tensor:
    """Transformers' logprob of each generated token, teacher-forced over prompt and output, all outputs in a row."""
    found = []
    for out in outputs:
        ids = torch.tensor([out.prompt_token_ids + out.token_ids])
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        start = len(out.prompt_token_ids) - 1
        found.append(logprobs[start:start + len(out.token_ids)].gather(1, torch.tensor(out.token_ids)[:, None])[:, 0])
    return torch.cat(found)


def _logprob_gap(path, outputs) -> float:
    """The largest gap between the engine's logprob of a generated token and transformers' float32 one."""
    engine = torch.cat([torch.tensor(out.logprobs) for out in outputs])
    return (engine - _teacher_forced(_hf_model(str(path)), outputs)).abs().max().item()


def test_transformers_5_fused_expert_tensors_load_as_the_per_expert_ones(tiny_qwen3_moe_path, tmp_path):
    """The same experts saved as transformers 5 holds them ([E, 2I, H] gate/up and [E, H, I] down per layer) give
    the same tokens."""
    fused = tmp_path / "fused"
    shutil.copytree(tiny_qwen3_moe_path, fused)
    tensors = load_file(str(fused / "model.safetensors"))
    save_file(_fused_experts(tensors), str(fused / "model.safetensors"))
    params = SamplingParams(max_tokens=12, temperature=0.0)
    per_expert = LLM(str(tiny_qwen3_moe_path), log_stats=False).generate(PROMPTS[:4], params, use_tqdm=False)
    stacked = LLM(str(fused), log_stats=False).generate(PROMPTS[:4], params, use_tqdm=False)
    assert [o.token_ids for o in stacked] == [o.token_ids for o in per_expert]


def _fused_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {name: t for name, t in tensors.items() if ".experts." not in name}
    for layer in sorted({name.split(".experts.")[0] for name in tensors if ".experts." in name}):
        experts = range(len({n for n in tensors if n.startswith(f"{layer}.experts.") and n.endswith("down_proj.weight")}))
        weights = {proj: [tensors[f"{layer}.experts.{e}.{proj}.weight"] for e in experts]
                   for proj in ("gate_proj", "up_proj", "down_proj")}
        out[f"{layer}.experts.gate_up_proj"] = torch.stack([torch.cat(pair) for pair in zip(weights["gate_proj"],
                                                                                           weights["up_proj"])])
        out[f"{layer}.experts.down_proj"] = torch.stack(weights["down_proj"])
    return out


@pytest.mark.parametrize("name", MODELS)
def test_bf16_logprobs_are_as_close_to_float32_as_transformers_bf16(request, name):
    """bf16, teacher-forced: a token whose router ranks two experts within bf16's rounding may take the other one, in
    transformers' bf16 as here, which moves its logprob past the dense models' tolerance (0.1) however exact the
    rest; so the mean gap is what compares: near transformers computing as the engine does here, and to float32 no
    further than transformers' bf16 is. A CPU without bf16 matrix math computes in float32 on the weights rounded to
    bf16 (tests/test_hf_equivalence.py), so transformers does that for the first comparison there."""
    path = request.getfixturevalue(name)
    llm = LLM(str(path), dtype="bfloat16", log_stats=False)
    outputs = llm.generate(PROMPTS[:8], SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, ignore_eos=True),
                           use_tqdm=False)
    engine = torch.cat([torch.tensor(out.logprobs) for out in outputs])
    bf16_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    hf_bf16 = _teacher_forced(bf16_model, outputs)
    hf_float32 = _teacher_forced(_hf_model(str(path)), outputs)
    alike = hf_bf16 if llm.engine.runner.dtype == torch.bfloat16 else _teacher_forced(bf16_model.float(), outputs)
    assert (engine - alike).abs().mean() < 0.05
    assert (engine - hf_float32).abs().mean() <= 1.1 * (hf_bf16 - hf_float32).abs().mean() + 0.005


ATTENTION_ADAPTERS = {"attn-r4": (4, ["q_proj", "v_proj"]), "attn-r16": (16, ["q_proj", "k_proj", "v_proj", "o_proj"]),
                      "o-r8": (8, ["o_proj"])}


@pytest.mark.parametrize("name", MODELS)
def test_mixed_attention_adapter_batches_match_peft_merged(request, tmp_path_factory, name):
    path = request.getfixturevalue(name)
    root = tmp_path_factory.mktemp(f"moe-adapters-{name}")
    references = peft_adapters(path, root, ATTENTION_ADAPTERS, seed=30)
    llm = LLM(str(path), adapters=local_adapters, max_loras=2, adapters_root=str(root), log_stats=False)
    base = llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
    prompts = [p for p in PROMPTS[:4] for _ in range(len(ATTENTION_ADAPTERS) + 1)]
    adapters = [a for _ in PROMPTS[:4] for a in (None, *ATTENTION_ADAPTERS)]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, adapters=adapters)
    for i, (out, adapter) in enumerate(zip(outputs, adapters)):
        want = base[i // 4].token_ids if adapter is None else references[adapter][i // 4]
        assert out.token_ids == want, f"{adapter} on {prompts[i]!r}"
    assert any(references[a][0] != base[0].token_ids for a in ATTENTION_ADAPTERS), "adapters must change outputs"
    assert llm.engine.adapter_slots.evictions > 0


EXPERT_ADAPTERS = {  # PEFT's target_parameters: the stacked gate/up and down of every layer's experts
    "experts-r4": (4, ["q_proj"], ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    "down-r8": (8, [], ["mlp.experts.down_proj"]),
    "all-r16": (16, ["q_proj", "k_proj", "v_proj", "o_proj"], ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
}


@pytest.mark.parametrize("name", MODELS)
def test_mixed_expert_adapter_batches_match_peft_merged(request, tmp_path_factory, name):
    """Adapters on the experts (and on attention), of ranks 4-16, mixed with attention-only adapters and the base
    in batches over 2 slots for 4 adapters, on the grouped kernel; and on the per-expert path for one model."""
    path = request.getfixturevalue(name)
    root = tmp_path_factory.mktemp(f"moe-expert-adapters-{name}")
    specs = {**EXPERT_ADAPTERS, "attn-r4": ATTENTION_ADAPTERS["attn-r4"]}
    references = peft_adapters(path, root, specs, seed=40)
    kernel_paths = [True, False] if name == MODELS[0] else [True]
    for cpu_kernels in kernel_paths:
        llm = LLM(str(path), adapters=local_adapters, max_loras=2, adapters_root=str(root), cpu_kernels=cpu_kernels,
                  log_stats=False)
        base = llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
        prompts = [p for p in PROMPTS[:4] for _ in range(len(specs) + 1)]
        adapters = [a for _ in PROMPTS[:4] for a in (None, *specs)]
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False, adapters=adapters)
        for i, (out, adapter) in enumerate(zip(outputs, adapters)):
            want = base[i // (len(specs) + 1)].token_ids if adapter is None else references[adapter][i // (len(specs) + 1)]
            assert out.token_ids == want, f"{adapter} on {prompts[i]!r} (cpu_kernels {cpu_kernels})"
    assert references["down-r8"][0] != base[0].token_ids, "an adapter on the experts alone must change outputs"


def test_an_expert_adapter_is_sized_by_its_real_bytes(tmp_path, tiny_qwen3_moe_path):
    """Each expert's A and B of both stacked parameters, in every layer that has experts, and the attention
    modules': what the cache counts against its budget."""
    peft_adapters(tiny_qwen3_moe_path, tmp_path, {"experts-r4": EXPERT_ADAPTERS["experts-r4"]}, seed=50)
    adapter = read_adapter("experts-r4", tmp_path / "experts-r4", lora_shapes_of(tiny_qwen3_moe_path))
    experts, hidden, inter, rank, layers = 8, 64, 32, 4, 2  # layers 0 and 2 have experts (1 is dense)
    per_layer = experts * rank * ((hidden + 2 * inter) + (inter + hidden)) + rank * (hidden + 4 * 16)
    assert adapter.nbytes == 4 * (layers * per_layer + rank * (hidden + 4 * 16))  # q_proj in the dense layer too
    assert set(adapter.layers[0]) == {"self_attn.q_proj", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    assert set(adapter.layers[1]) == {"self_attn.q_proj"}
    with pytest.raises(AdapterError, match="has weights on a mixture of experts' experts \\(target_parameters\\): "
                                           "merging such adapters is not supported"):
        merge_adapters("a~b", [adapter, adapter], MergeSpec(("a", "b"), (0.5, 0.5)), ["self_attn.q_proj"])


def test_expert_lora_off_keeps_no_expert_slots_and_refuses_adapters_on_experts(tmp_path, tiny_qwen3_moe_path):
    """expert_lora false: the slots hold attention weights alone, and an adapter on the experts is refused by name,
    not served without its expert weights."""
    write_tiny_adapters(tiny_qwen3_moe_path, tmp_path, ["attention"])
    write_tiny_adapters(tiny_qwen3_moe_path, tmp_path, ["experts"], experts=True)
    llm = LLM(str(tiny_qwen3_moe_path), adapters=local_adapters, max_loras=2, adapters_root=str(tmp_path),
              expert_lora=False, log_stats=False)
    assert not any(isinstance(m, ExpertLoRA) for m in llm.engine.runner.model.modules())
    assert llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, adapters=["attention"])[0].token_ids
    with pytest.raises(AdapterError, match="serves no adapters on experts \\(a dense base, or expert_lora off\\)"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, adapters=["experts"])


def test_what_moe_does_not_run_yet_is_refused_by_name(tiny_qwen3_moe_path, tiny_llama_path, tmp_path):
    with pytest.raises(ValueError, match="tensor parallelism does not split qwen3_moe's experts"):
        LLM(str(tiny_qwen3_moe_path), tensor_parallel_size=2, log_stats=False)
    with pytest.raises(ValueError, match="quantization 'int8' of a mixture of experts"):
        LLM(str(tiny_qwen3_moe_path), quantization="int8", log_stats=False)
    experts = lora_shapes_of(tiny_qwen3_moe_path)
    for module, fan_in, fan_out, parameters, reason in ADAPTER_REFUSALS:
        folder = _adapter_with(tmp_path / reason[:12], f"base_model.model.model.layers.{module}", fan_in, fan_out,
                               target_parameters=parameters)
        with pytest.raises(AdapterError, match=reason):
            read_adapter("refused", folder, experts)
    with pytest.raises(AdapterError, match="LoRA on raw parameters \\(target_parameters\\) 'mlp.experts.down_proj' is "
                                           "not supported; supported: none: this server serves no adapters on "
                                           "experts \\(a dense base, or expert_lora off\\)"):
        read_adapter("refused", folder, lora_shapes_of(tiny_llama_path))


# (module, lora_A's input, lora_B's output, target_parameters, why): rank 4 in every config
ADAPTER_REFUSALS = [
    ("0.mlp.gate", 64, 8, None, "mlp.gate' is a mixture of experts' router"),
    ("0.self_attn.q_proj", 64, 64, ["mlp.gate.weight"],
     "target parameter 'mlp.gate.weight' is a mixture of experts' router"),
    ("0.self_attn.q_proj", 64, 64, ["mlp.experts.up_proj"],
     ("target_parameters\\) 'mlp.experts.up_proj' is not supported; supported: mlp.experts.down_proj, "
      "mlp.experts.gate_up_proj")),
    ("1.mlp.experts", 32, 64, ["mlp.experts.down_proj"], "targets experts in layer 1, whose MLP is dense"),
    ("0.mlp.experts", 32, 64, ["mlp.experts.down_proj"], "rank 4 in config over 8 experts needs lora_A of 32 rows"),
]


def _adapter_with(folder, module: str, fan_in: int, fan_out: int, **config):
    folder.mkdir()
    save_file({f"{module}.lora_A.weight": torch.zeros(4, fan_in), f"{module}.lora_B.weight": torch.zeros(fan_out, 4)},
              str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                            "target_modules": ["x"], **config}))
    return folder
