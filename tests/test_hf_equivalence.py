"""Greedy fp32 output equals Hugging Face generate, token for token, under queueing and preemption."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from engine import LLM, SamplingParams
from engine.kernels import cpu_attention, cpu_ops
from engine.layers.attention import IN_PLACE_CHUNK
from engine.models import attention_window, context_limit
from tests.helpers import PROMPTS, hf_greedy

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
SMOLLM2_PROMPTS = PROMPTS[:10]  # twice its 5 running sequences; their KV nearly 3x the preempting engine's cache


def _check(llm: LLM, reference: list[list[int]], prompts=PROMPTS, params=GREEDY):
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out, ref in zip(prompts, outputs, reference):
        assert out.token_ids == ref, f"mismatch for {prompt!r}: got {out.token_ids}, want {ref}"
    assert llm.engine.block_manager.num_used_blocks == 0
    return outputs


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_path):
    return hf_greedy(smollm2_path, SMOLLM2_PROMPTS, GREEDY.max_tokens)


@pytest.mark.slow
@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["cpu-kernels", "pytorch-paths"])
def test_smollm2_queued_requests_match_hf(smollm2_path, smollm2_reference, cpu_kernels):
    llm = LLM(str(smollm2_path), max_num_seqs=5, log_stats=False, cpu_kernels=cpu_kernels)
    outputs = _check(llm, smollm2_reference, SMOLLM2_PROMPTS)
    assert any(o.finish_reason == "length" for o in outputs)


@pytest.mark.slow
def test_smollm2_under_preemption_matches_hf(smollm2_path, smollm2_reference):
    llm = LLM(str(smollm2_path), max_num_seqs=16, num_kv_blocks=14, block_size=8, log_stats=False)
    _check(llm, smollm2_reference, SMOLLM2_PROMPTS)
    assert llm.engine.scheduler.total_preemptions > 0


@pytest.mark.parametrize("name", ["tiny_llama_path", "tiny_qwen2_path", "tiny_qwen3_path", "tiny_mistral_path",
                                  "tiny_phi3_path", "tiny_phi4_path", "tiny_gemma_path", "tiny_smollm3_path",
                                  "tiny_granite_path", "tiny_olmo2_path", "tiny_gpt2_path"])
def test_tiny_models_match_hf_queued_and_preempted(request, name):
    path = request.getfixturevalue(name)
    params = SamplingParams(max_tokens=40, temperature=0.0)
    reference = hf_greedy(path, PROMPTS, params.max_tokens)
    _check(LLM(str(path), max_num_seqs=3, log_stats=False), reference, params=params)
    preempting = LLM(str(path), max_num_seqs=16, num_kv_blocks=20, block_size=4, log_stats=False)
    _check(preempting, reference, params=params)
    assert preempting.engine.scheduler.total_preemptions > 0


@pytest.mark.skipif(cpu_ops.load() is None, reason="windows past the default context need the C++ operators")
def test_a_sliding_window_is_the_default_context_and_computed_exactly_past_it(tiny_mistral_path, tiny_llama_path,
                                                                              tmp_path, tokenizer):
    """Mistral's attention here slides over 64 tokens, and a Qwen2's second layer over 24. Within its window full
    attention equals it, so the window is the default context, on every path. A max_model_len past it has the C++
    kernel compute the windows: greedy equals HF's generate token for token past them, short prompts decoding past
    and a long one, queued and prefilled in chunks, then again from the prefix cache. Where the kernel cannot serve,
    such a max_model_len is refused, saying why; one past the positions too."""
    assert LLM(str(tiny_mistral_path), cpu_kernels=False, log_stats=False).engine.max_model_len == 64
    with pytest.raises(ValueError, match="the limit is 63"):
        LLM(str(tiny_mistral_path), log_stats=False).generate([list(range(1, 65))], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"sliding-window layers \(64 tokens\), which only the C\+\+ CPU attention "
                                         r"kernel computes, and it cannot serve here: .*cpu_kernels"):
        LLM(str(tiny_mistral_path), max_model_len=65, cpu_kernels=False, log_stats=False)
    with pytest.raises(ValueError, match="max_model_len 513 is past this model's context of 512 tokens "
                                         ".max_position_embeddings"):
        LLM(str(tiny_llama_path), max_model_len=513, log_stats=False)

    torch.manual_seed(5)
    Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, use_sliding_window=True, sliding_window=24,
        max_window_layers=1, initializer_range=0.2, tie_word_embeddings=True, pad_token_id=0,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    prompts = PROMPTS[:3] + [" ".join(PROMPTS)]  # 127 tokens
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    for path in (str(tiny_mistral_path), str(tmp_path)):
        reference = hf_greedy(path, prompts, params.max_tokens)
        llm = LLM(path, max_model_len=256, max_num_batched_tokens=48, log_stats=False)
        _check(llm, reference, prompts, params)
        assert _check(llm, reference[3:], prompts[3:], params)[0].num_cached_tokens >= 64


@pytest.mark.skipif(cpu_ops.load() is None, reason="windows past the default context need the C++ operators")
def test_blocks_behind_every_layers_window_are_given_back(tiny_mistral_path):
    """Past Mistral's window (64 tokens here) no query reads a key older than it, so each sequence gives back the
    blocks behind its next token's window as it goes: 4 sequences of about 190 tokens (12 blocks each) run at once
    in 28 blocks, without a preemption, and greedy equals HF's generate token for token. Every block is free at the
    end, each given back once; a sequence holds at most the window's blocks and two more. In 16 blocks, sequences
    are preempted and recomputed, and greedy still equals HF's."""
    prompts = PROMPTS[:4]
    params = SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True)
    reference = hf_greedy(str(tiny_mistral_path), prompts, params.max_tokens)
    llm = LLM(str(tiny_mistral_path), max_model_len=256, num_kv_blocks=28, max_num_batched_tokens=48,
              log_stats=False)
    _check(llm, reference, prompts, params)
    assert llm.engine.scheduler.total_preemptions == 0
    assert set(llm.engine.block_manager.ref_counts) == {0}
    _check(llm, reference, prompts, params)  # again, from what the prefix cache kept
    seq, held = llm.engine.add_request("held", prompts[0], params), []
    while llm.engine.has_unfinished():
        llm.engine.step()
        held.append(len(seq.block_table) - seq.num_released_blocks)
    assert max(held) <= 64 // 16 + 2  # the window's blocks, the one being written, the last keyed one
    preempting = LLM(str(tiny_mistral_path), max_model_len=256, num_kv_blocks=16, max_num_batched_tokens=48,
                     log_stats=False)
    _check(preempting, reference, prompts, params)  # too few blocks even so: preempted sequences start over
    assert preempting.engine.scheduler.total_preemptions > 0 and set(preempting.engine.block_manager.ref_counts) == {0}


def test_which_configs_slide():
    """Mistral 7B v0.1's window bounds its context; Qwen2's only with use_sliding_window; Llama's never; Gemma 2's
    and 3's neither, since the C++ kernel computes their windows."""
    assert context_limit(MistralConfig(max_position_embeddings=32768, sliding_window=4096), None) == 4096
    assert attention_window(MistralConfig(sliding_window=None)) is None  # Mistral 7B v0.2 and later
    assert attention_window(Qwen2Config(sliding_window=4096)) is None
    assert attention_window(Qwen2Config(use_sliding_window=True, sliding_window=1024)) == 1024
    assert attention_window(LlamaConfig()) is None
    assert context_limit(LlamaConfig(max_position_embeddings=2048), 1024) == 1024
    assert context_limit(Gemma2Config(max_position_embeddings=8192, sliding_window=4096), None) == 8192
    assert context_limit(Gemma3TextConfig(max_position_embeddings=32768, sliding_window=512), None) == 32768


def test_an_embedding_gemma_is_refused_by_name(tmp_path, tiny_gemma3_path):
    """Gemma 3 with bidirectional attention (EmbeddingGemma) is an embedding model: refused at load, naming why,
    rather than served causally."""
    config = json.loads((tiny_gemma3_path / "config.json").read_text())
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_gemma3_path / name).read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({**config, "use_bidirectional_attention": True}))
    with pytest.raises(ValueError, match="bidirectional attention .use_bidirectional_attention: an embedding model"):
        LLM(str(tmp_path), log_stats=False)


def test_granite_logits_are_scaled_as_hf_scales_them(tiny_granite_path, tokenizer):
    """Granite divides its logits by logits_scaling: greedy choices cannot show it, the logprobs do."""
    _assert_first_token_scores_match_hf(LLM(str(tiny_granite_path), log_stats=False), tiny_granite_path, tokenizer)


def _assert_first_token_scores_match_hf(llm: LLM, path, tokenizer) -> None:
    """The first token's logprob and top 5 equal HF's float32 log-softmax at the prompt's end (scalings of the
    logits that greedy choices cannot show)."""
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1, temperature=0, logprobs=5), use_tqdm=False)[0]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.inference_mode():
        expected = hf(tokenizer(PROMPTS[0], return_tensors="pt").input_ids).logits[0, -1].log_softmax(-1)
    assert out.logprobs[0] == pytest.approx(expected[out.token_ids[0]].item(), abs=1e-4)
    assert list(out.top_logprobs[0]) == expected.topk(5).indices.tolist()


def test_longrope_switches_to_its_long_factors_as_hf_does(tmp_path, tokenizer):
    """A longrope rotary embedding (Phi-3's 128k models) turns a sequence with its short factors while it fits in the
    original context (64 tokens here), with its long ones once longer; transformers' Phi-3 then drops its cache and
    computes the sequence again. Greedy equals HF's generate token for token: a short prompt decoding past the
    switch (restarted there, not counted as a preemption), a long prompt, both queued together, under preemption, and
    a long prompt prefilled in chunks, then again from the prefix cache; a long prompt never takes the blocks a
    short one cached with the short factors. The context is the model's positions (256)."""
    torch.manual_seed(7)
    half = 8  # head_dim 16
    config = Phi3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        original_max_position_embeddings=64, sliding_window=None, initializer_range=0.2,
                        pad_token_id=0, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                         "short_factor": [1.0 + i / half for i in range(half)],
                                         "long_factor": [4.0] * half, "original_max_position_embeddings": 64})
    Phi3ForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    short, long = PROMPTS[0], " ".join(PROMPTS)  # 5 and 127 tokens
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)  # the short one crosses at its 60th
    reference = hf_greedy(tmp_path, [short, long], params.max_tokens)

    llm = LLM(str(tmp_path), log_stats=False)
    assert llm.engine.max_model_len == 256
    # the long prompt's first 40 tokens, short of the switch: 2 blocks of 16 cached with the short factors
    llm.generate([tokenizer(long).input_ids[:40]], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert _check(llm, reference[1:], [long], params)[0].num_cached_tokens == 0  # same tokens, other factors
    assert _check(llm, reference[1:], [long], params)[0].num_cached_tokens >= 64  # its own, with the long ones
    ids = tokenizer(long).input_ids  # a router's digests of both prompts' blocks, as the engine keyed them
    long_keys, short_keys = llm.engine.prompt_digests(ids, None), llm.engine.prompt_digests(ids[:40], None)
    assert set(long_keys + short_keys) <= llm.engine.cached_prefix_digests() and long_keys[:2] != short_keys
    _check(llm, reference[:1], [short], params)
    assert llm.engine.scheduler.total_preemptions == 0
    _check(LLM(str(tmp_path), log_stats=False), reference, [short, long], params)
    preempting = LLM(str(tmp_path), max_num_seqs=8, num_kv_blocks=16, log_stats=False)
    _check(preempting, reference * 3, [short, long] * 3, params)
    assert preempting.engine.scheduler.total_preemptions > 0

    chunked = LLM(str(tmp_path), max_num_batched_tokens=32, log_stats=False)
    _check(chunked, reference[1:], [long], params)
    assert _check(chunked, reference[1:], [long], params)[0].num_cached_tokens >= 64


@pytest.mark.skipif(cpu_ops.load() is None, reason="Gemma 2's and 3's attention needs the C++ operators")
@pytest.mark.parametrize("name, needs", [
    ("tiny_gemma2_path", r"soft-capped attention scores \(attn_logit_softcapping 4.0\)"),
    ("tiny_gemma3_path", r"sliding-window layers \(24 tokens\)")])
def test_windowed_gemmas_match_hf_queued_preempted_and_in_long_chunks(request, tokenizer, name, needs):
    """Gemma 2 soft-caps its attention scores, and Gemma 2 and 3 attend over sliding windows in some layers, which
    only the C++ kernel computes, so every token attends there, long prompt chunks too: greedy equals HF token for
    token past the window (24 tokens here), queued, preempted, and for a prompt prefilled in chunks of 80 tokens,
    then again from the prefix cache.
    Gemma 2's logits are soft-capped too, which only the logprobs show. Where the kernel cannot read the cache
    (blocks of 4 tokens), the model is refused, saying why."""
    path = str(request.getfixturevalue(name))
    params = SamplingParams(max_tokens=40, temperature=0.0)
    reference = hf_greedy(path, PROMPTS, params.max_tokens)
    _check(LLM(path, max_num_seqs=3, log_stats=False), reference, params=params)
    preempting = LLM(path, max_num_seqs=16, num_kv_blocks=6, log_stats=False)
    _check(preempting, reference, params=params)
    assert preempting.engine.scheduler.total_preemptions > 0

    long_prompt = " ".join(PROMPTS + PROMPTS[:4])  # chunks of 80: fresh, after cached, then the rest
    assert 80 + IN_PLACE_CHUNK < len(tokenizer(long_prompt).input_ids)
    chunked = LLM(path, max_num_batched_tokens=80, log_stats=False)
    long_reference = hf_greedy(path, [long_prompt], 16)
    _check(chunked, long_reference, [long_prompt], SamplingParams(max_tokens=16, temperature=0))
    again = _check(chunked, long_reference, [long_prompt], SamplingParams(max_tokens=16, temperature=0))
    assert again[0].num_cached_tokens >= 128  # its prefix's blocks from the prefix cache, past the window

    _assert_first_token_scores_match_hf(chunked, path, tokenizer)

    with pytest.raises(ValueError, match=f"this model's attention has {needs}, which only the C\\+\\+ CPU attention "
                                         f"kernel computes, and it cannot serve here: .*block_size 4"):
        LLM(path, block_size=4, log_stats=False)


@pytest.mark.parametrize("name", ["tiny_llama_path", "tiny_phi3_path", "tiny_gemma_path", "tiny_gemma2_path",
                                  "tiny_gemma3_path", "tiny_granite_path", "tiny_olmo2_path"])
def test_tiny_bf16_runs_and_mostly_agrees(request, name):
    """bf16 rounds differently from HF's float32 reference, so most first tokens agree, not all."""
    path = request.getfixturevalue(name)
    reference = hf_greedy(path, PROMPTS[:4], 8)
    outputs = LLM(str(path), dtype="bfloat16", log_stats=False).generate(
        PROMPTS[:4], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    first_tokens_equal = sum(o.token_ids[0] == r[0] for o, r in zip(outputs, reference))
    assert first_tokens_equal >= 3


def test_token_id_prompts_and_chunked_prefill(tiny_llama_path, tokenizer):
    """A prompt longer than the per-step token budget is prefilled in chunks, with the same result."""
    prompt = " ".join(PROMPTS)
    reference = hf_greedy(tiny_llama_path, [prompt], 16)[0]
    llm = LLM(str(tiny_llama_path), max_num_batched_tokens=32, log_stats=False)
    out = llm.generate([tokenizer(prompt).input_ids], SamplingParams(max_tokens=16, temperature=0.0),
                       use_tqdm=False)[0]
    assert len(tokenizer(prompt).input_ids) > 32
    assert out.token_ids == reference


@pytest.mark.slow
def test_smollm2_bf16_keeps_real_answers(smollm2_path):
    """bf16 must stay close enough to fp32 that the instruct model still answers (a precision regression test)."""
    llm = LLM(str(smollm2_path), dtype="bfloat16", log_stats=False)
    questions = ["What is the capital of France?", "What is the capital of Japan?"]
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                 add_generation_prompt=True) for q in questions]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    assert "Paris" in outs[0].text and "Tokyo" in outs[1].text, [o.text for o in outs]


def _teacher_forced_logprobs(model_path, outputs, dtype: torch.dtype, device) -> list[torch.Tensor]:
    """Transformers' logprob of each token the engine generated, teacher-forced on the engine's tokens."""
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    wanted = []
    for out in outputs:
        ids = torch.tensor([out.prompt_token_ids + out.token_ids], device=device)
        with torch.inference_mode():
            logprobs = hf(ids).logits[0].float().log_softmax(-1)
        rows = torch.arange(len(out.prompt_token_ids) - 1, ids.shape[1] - 1, device=device)
        wanted.append(logprobs[rows, torch.tensor(out.token_ids, device=device)])
    return wanted


def _largest_gap(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(got, want))


def _teacher_forced_gap(llm: LLM, model_path, outputs) -> float:
    """The largest gap between the engine's logprob of each generated token and transformers' in bf16."""
    device = llm.engine.config.backend.torch_device
    got = [torch.tensor(out.logprobs, device=device) for out in outputs]
    return _largest_gap(got, _teacher_forced_logprobs(model_path, outputs, torch.bfloat16, device))


def test_bf16_logprobs_match_hf_bf16(tiny_llama_path):
    """bf16 on the engine's device (CPU in CI, CUDA on a GPU machine) against transformers in bf16 on the same
    device: the log-probability of every generated token, teacher-forced, within bf16's rounding."""
    llm = LLM(str(tiny_llama_path), dtype="bfloat16", log_stats=False)
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, ignore_eos=True)
    outputs = llm.generate(PROMPTS[:8], params, use_tqdm=False)
    assert _teacher_forced_gap(llm, tiny_llama_path, outputs) < 0.1


def test_bf16_long_prompts_in_chunks_as_close_to_hf_float32_as_hf_bf16(tmp_path, tokenizer):
    """Prompts of 200-400 tokens in chunks of 128 (fresh, after cached tokens, and a short tail) at SmolLM2's head
    dim: on a CPU with AVX-512 BF16 they attend in a C++ prompt kernel, elsewhere in SDPA. Every generated token's
    logprob, teacher-forced, is as close to transformers in float32 as transformers' own bf16 is (within 0.1).
    Not within 0.1 of transformers' bf16: this random model (weights of std 0.2) turns one bf16 rounding into
    tenths of a nat, so two roundings of equal accuracy drift apart (transformers' bf16 is 0.57-0.63 from its
    float32 here, the AVX-512 and AMX kernels 0.45-0.57), while a wrong mask, position or block is nats away."""
    torch.manual_seed(4)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=192, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                         initializer_range=0.2, tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="bfloat16", max_num_batched_tokens=128, log_stats=False)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in (200, 300, 400)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True),
                           use_tqdm=False)
    on_cpu = llm.engine.runner.device.type == "cpu"
    assert llm.engine.runner.backend.prompt_kernel == (on_cpu and cpu_attention.prompt_kernel_usable(torch.bfloat16, 64, 16))
    device = llm.engine.config.backend.torch_device
    got = [torch.tensor(out.logprobs, device=device) for out in outputs]
    truth = _teacher_forced_logprobs(tmp_path, outputs, torch.float32, device)
    hf_bf16 = _teacher_forced_logprobs(tmp_path, outputs, torch.bfloat16, device)
    assert _largest_gap(got, truth) < _largest_gap(hf_bf16, truth) + 0.1


def test_bf16_without_bf16_matrix_math_computes_bf16_weights_in_float32(tiny_llama_path, tokenizer, tmp_path):
    """On a CPU without bf16 matrix instructions (an AVX2 EPYC), dtype bfloat16 computes in float32 on the model's
    weights rounded to bf16. With kv_cache_dtype float32: token for token what transformers gives in float32 on
    those rounded weights. Where the C++ operators widen bf16 weights, the linears store them in bf16, half the
    bytes. By default ("auto") the KV cache is bf16 too: half the bytes a token, twice the blocks in one budget, and
    every generated token's logprob, teacher-forced, within 0.1 of that float32 reference."""
    from engine.config import EngineConfig
    from engine.kernels import cpu_ops
    from engine.platform import cpu_has_native_bf16

    if EngineConfig.from_overrides(str(tiny_llama_path)).backend.torch_device.type != "cpu" or cpu_has_native_bf16():
        pytest.skip("bf16 computes natively here")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.bfloat16).float()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    params = SamplingParams(max_tokens=40, temperature=0.0)
    reference = hf_greedy(tmp_path, PROMPTS, params.max_tokens)
    exact = LLM(str(tiny_llama_path), dtype="bfloat16", kv_cache_dtype="float32", max_num_seqs=3, log_stats=False)
    _check(exact, reference, params=params)
    if cpu_ops.load() is not None and cpu_ops.load().simd_linear_widens_bf16():
        stored = {b.dtype for name, b in exact.engine.runner.model.named_buffers() if name.endswith("own_weight")}
        assert stored == {torch.bfloat16}
    llm = LLM(str(tiny_llama_path), dtype="bfloat16", max_num_seqs=3, log_stats=False)
    assert {cache.dtype for pair in llm.engine.runner.kv_caches for cache in pair} == {torch.bfloat16}
    assert llm.engine.runner.dtype == torch.float32
    assert llm.engine.runner.layout.num_blocks == 2 * exact.engine.runner.layout.num_blocks
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0, logprobs=0, ignore_eos=True),
                           use_tqdm=False)
    got = [torch.tensor(out.logprobs) for out in outputs]
    assert _largest_gap(got, _teacher_forced_logprobs(tmp_path, outputs, torch.float32, "cpu")) < 0.1


def test_kv_cache_dtype_is_checked_against_the_model():
    """kv_cache_dtype: 'auto', the model's dtype, or float32 for a bf16 model; anything else refused by name."""
    from engine.config import EngineConfig

    assert EngineConfig.from_overrides(dtype="bf16", kv_cache_dtype="fp32").cache.kv_cache_dtype == "fp32"
    with pytest.raises(ValueError, match="fp8 KV caches are not implemented"):
        EngineConfig.from_overrides(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype 'bfloat16' does not fit dtype 'float32'"):
        EngineConfig.from_overrides(kv_cache_dtype="bfloat16")
    with pytest.raises(ValueError, match="kv_cache_dtype 'float32' does not fit dtype 'float16'"):
        EngineConfig.from_overrides(dtype="float16", kv_cache_dtype="float32")
