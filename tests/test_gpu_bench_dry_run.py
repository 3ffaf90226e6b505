"""The GPU benchmark's figures against the hardware's bounds run end to end on CPU (`--device cpu --tiny`): the
yardsticks, decode at many sequences against its bandwidth bound, and prefill against the matmul rate, each with
its bound computed from the shape, as the device run computes them."""

from __future__ import annotations

import json
import math

from benchmarks.gpu import run_gpu
from benchmarks.gpu.gpu_bounds import prefill_flops
from benchmarks.gpu.gpu_models import shape


def test_bound_sections_dry_run(smollm2_path, tmp_path):
    run_gpu.main(["--device", "cpu", "--tiny", "--tokenizer", str(smollm2_path), "--work", str(tmp_path / "work"),
                  "--sections", "bandwidth,decode_bound,prefill", "--out", str(tmp_path / "out")])
    sections = json.loads((tmp_path / "out" / "gpu.json").read_text())["sections"]
    assert all(section["ok"] for section in sections.values()), sections
    assert sections["bandwidth"]["figures"]["matmul_tflop_s"] > 0
    decode = sections["decode_bound"]["figures"]
    assert set(decode) == {f"{model}{label}" for model in ("llama-3.2-1b", "llama-3-8b")
                           for label in ("", ", async scheduling")}
    for row in decode.values():  # a tiny model's step on a shared CPU is noise: its share of the bound is a number
        assert "error" not in row, row
        assert row["bound_ms"] > 0 and math.isfinite(row["of_bound"]) and row["kv_bytes"] > 0
    prefill = sections["prefill"]["figures"]
    assert set(prefill) == {"llama-3-8b, sdpa", "llama-3-8b, triton", "llama-3-8b, flex"}
    for row in prefill.values():
        assert "error" not in row and row["tflop_s"] > 0 and row["of_matmul"] > 0
    text = (tmp_path / "out" / "gpu.md").read_text()
    assert "against its bandwidth bound" in text and "against the bf16 matmul rate" in text


def test_prefill_flops_count_every_linear_of_the_model_attention_and_the_head():
    """Against the weights of the model transformers builds from the same config: 2 FLOPs per weight of every
    decoder linear per token, the LM head once per prompt, and 4 x heads x head_dim per causal query-key pair."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = shape("llama-3-8b", tiny=True)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config))
    linear = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    prompts, length = 3, 5
    attention = 4 * config["num_hidden_layers"] * config["num_attention_heads"] * config["head_dim"] * 15
    head = model.lm_head.weight.numel()
    assert prefill_flops(config, prompts, length) == prompts * (2 * linear * length + attention + 2 * head)
