"""Multi-LoRA in one batch: every greedy output equals PEFT's merged model for that adapter alone."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from lora_cache.local_cache import local_adapters
from tests.helpers import GREEDY, PROMPTS, peft_adapters, write_tiny_adapters

LLAMA_ADAPTERS = {  # name -> (rank, target modules)
    "attn-r4": (4, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp-r8": (8, ["gate_proj", "up_proj", "down_proj"]),
    "all-r16": (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "qv-r8": (8, ["q_proj", "v_proj"]),
}
PHI3_ADAPTERS = {  # Phi-3's linears are fused in its checkpoints, and its adapters target them so
    "attn-r4": (4, ["qkv_proj", "o_proj"]),
    "mlp-r8": (8, ["gate_up_proj", "down_proj"]),
    "all-r16": (16, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    "qkv-r8": (8, ["qkv_proj"]),
}
GPT2_ADAPTERS = {
    "attn-r4": (4, ["c_attn"]),
    "proj-r8": (8, ["c_proj"]),
    "all-r16": (16, ["c_attn", "c_proj", "c_fc"]),
    "fc-r8": (8, ["c_fc"]),
}
@pytest.mark.parametrize("base_fixture, specs", [("tiny_llama_path", LLAMA_ADAPTERS),
                                                 ("tiny_qwen3_path", LLAMA_ADAPTERS),  # head_dim != hidden / heads
                                                 ("tiny_phi3_path", PHI3_ADAPTERS),
                                                 ("tiny_phi4_path", PHI3_ADAPTERS),  # partial rotary, tied
                                                 ("tiny_gemma_path", LLAMA_ADAPTERS),
                                                 ("tiny_gemma2_path", LLAMA_ADAPTERS),  # soft-capped, sandwich norms
                                                 ("tiny_gemma3_path", LLAMA_ADAPTERS),  # windows, two rotary tables
                                                 ("tiny_smollm3_path", LLAMA_ADAPTERS),  # layers without rotary
                                                 ("tiny_granite_path", LLAMA_ADAPTERS),  # Granite's multipliers
                                                 ("tiny_olmo2_path", LLAMA_ADAPTERS),  # post-norms, whole q/k norms
                                                 ("tiny_gpt2_path", GPT2_ADAPTERS)])
@pytest.mark.parametrize("max_loras", [4, 2])  # 2 < 4 adapters: slots are evicted and requests wait for one
def test_mixed_adapter_batch_matches_peft_merged(request, tmp_path_factory, base_fixture, specs, max_loras):
    base_path = request.getfixturevalue(base_fixture)
    root = tmp_path_factory.mktemp(f"adapters-{base_fixture}-{max_loras}")
    references = peft_adapters(base_path, root, specs, seed=10)
    llm = LLM(str(base_path), adapters=local_adapters, max_loras=max_loras, adapters_root=str(root), log_stats=False)
    base_outputs = llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)

    prompts, adapters, expected = [], [], []
    for i, prompt in enumerate(PROMPTS[:4]):
        prompts.append(prompt)
        adapters.append(None)
        expected.append(base_outputs[i].token_ids)
        for name in specs:
            prompts.append(prompt)
            adapters.append(name)
            expected.append(references[name][i])
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, adapters=adapters)
    for prompt, adapter, out, want in zip(prompts, adapters, outputs, expected):
        assert out.token_ids == want, f"adapter {adapter} on {prompt!r}"
    assert any(references[name][0] != base_outputs[0].token_ids for name in specs), "adapters must change outputs"
    assert llm.engine.block_manager.num_used_blocks == 0
    assert all(p == 0 for p in llm.engine.adapter_slots.pins)
    if max_loras < len(specs):
        assert llm.engine.adapter_slots.evictions > 0


def test_unknown_or_bad_adapter_fails_only_that_request(tiny_llama_path, tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "adapter_config.json").write_text("{not json")
    llm = LLM(str(tiny_llama_path), adapters=local_adapters, max_loras=2, adapters_root=str(tmp_path), log_stats=False)
    for adapter, words in (("missing", "not found"), ("broken", "broken"), ("../etc", "..")):
        with pytest.raises(ValueError, match=words):
            llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, adapters=[adapter])
    assert not llm.engine.has_unfinished()
    assert llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].finish_reason in ("length", "eos")


def test_adapter_requires_lora_enabled(tiny_llama_path):
    llm = LLM(str(tiny_llama_path), log_stats=False)
    with pytest.raises(ValueError, match="max_loras"):
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, adapters=["any"])


def _step_until_done(engine, request_id, feed, max_steps=300):
    """Step the engine, calling feed() before every step; returns the step at which request_id finished."""
    for step in range(max_steps):
        feed()
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return step
    return None


@pytest.mark.parametrize("max_wait, bounded", [(float("inf"), False), (0.0, True)])
def test_skewed_load_cannot_starve_a_cold_adapter(tiny_llama_path, tmp_path, max_wait, bounded):
    write_tiny_adapters(tiny_llama_path, tmp_path, ("hot", "cold"))
    llm = LLM(str(tiny_llama_path), adapters=local_adapters, max_loras=1, max_num_seqs=4, adapters_root=str(tmp_path),
              max_adapter_wait_s=max_wait, log_stats=False)
    engine = llm.engine
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    hot = iter(range(10 ** 6))

    def keep_hot_queue_full():  # staggered lengths, so some hot request always holds the only slot
        while len(engine.scheduler.waiting) < 6:
            n = next(hot)
            engine.add_request(f"hot-{n}", PROMPTS[0], SamplingParams(max_tokens=4 + n % 7, temperature=0.0,
                                                                      ignore_eos=True), "hot")

    keep_hot_queue_full()
    engine.step()
    engine.add_request("cold", PROMPTS[1], params, "cold")
    engine.step()
    assert engine.stats().waiting_for_adapter == 1  # visible as "loading adapter"
    finished_at = _step_until_done(engine, "cold", keep_hot_queue_full)
    if bounded:
        assert finished_at is not None and finished_at < 40
    else:
        assert finished_at is None, "without the bound the popular adapter starves the cold one"


def test_adapter_stats_report_usage_and_residence(tiny_llama_path, tmp_path):
    write_tiny_adapters(tiny_llama_path, tmp_path, ("a", "b", "c"))
    llm = LLM(str(tiny_llama_path), adapters=local_adapters, max_loras=2, adapters_root=str(tmp_path), log_stats=False)
    llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False, adapters=["a", "a", "b", None])
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, adapters=["c"])  # evicts the least recently used: a
    stats = llm.engine.adapter_stats()
    assert stats["a"].requests == 2 and stats["a"].generated_tokens == 2 * GREEDY.max_tokens
    assert stats["a"].residence == "cpu" and stats["c"].residence == "device"
    assert stats["b"].source_loads == 1 and stats["b"].mean_load_s > 0
    assert sorted(llm.engine.stats().resident_adapters) == ["b", "c"]


def test_preloaded_adapters_are_warm_and_pinned_ones_keep_their_slots(tiny_llama_path, tmp_path):
    root = write_tiny_adapters(tiny_llama_path, tmp_path, ("warm", "pinned", "other1", "other2"))
    llm = LLM(str(tiny_llama_path), adapters=local_adapters, max_loras=2, adapters_root=str(root), log_stats=False,
              preload_adapters=["warm"], pinned_adapters=["pinned"])
    engine = llm.engine
    assert sorted(engine.adapter_slots.resident()) == ["pinned", "warm"]  # before any request
    params = SamplingParams(max_tokens=4, temperature=0)
    llm.generate([PROMPTS[0]], params, use_tqdm=False, adapters=["warm"])
    stats = engine.adapter_stats()
    assert stats["warm"].source_loads == 1 and stats["warm"].slot_loads == 1  # nothing loaded on request
    for adapter in ("other1", "other2", "other1"):  # two adapters take turns in the one free slot
        llm.generate([PROMPTS[1]], params, use_tqdm=False, adapters=[adapter])
    assert "pinned" in engine.adapter_slots.resident() and engine.adapter_stats()["pinned"].slot_loads == 1
    with pytest.raises(ValueError, match="leave none of the 2 device slots"):
        LLM(str(tiny_llama_path), adapters=local_adapters, max_loras=2, adapters_root=str(root),
            pinned_adapters=["warm", "pinned"])
    with pytest.raises(ValueError, match="not found"):
        LLM(str(tiny_llama_path), adapters=local_adapters, max_loras=2, adapters_root=str(root), log_stats=False,
            preload_adapters=["nope"])


def test_an_adapter_loaded_ahead_serves_from_its_slot_and_unloads_only_when_idle(tiny_llama_path, tmp_path):
    """load_adapter and unload_adapter, as a replica preloads a hot adapter and drops it (deployments/routing/
    replication.py): the slot is filled before any request, and a slot that a running request pins stays."""
    root = write_tiny_adapters(tiny_llama_path, tmp_path, ("hot", "busy"))
    llm = LLM(str(tiny_llama_path), adapters=local_adapters, max_loras=1, adapters_root=str(root), log_stats=False)
    engine = llm.engine
    assert engine.load_adapter("hot") and engine.adapter_slots.resident() == ["hot"]
    expected = LLM(str(tiny_llama_path), adapters=local_adapters, max_loras=1, adapters_root=str(root),
                   log_stats=False).generate([PROMPTS[0]], GREEDY, use_tqdm=False, adapters=["hot"])
    out = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, adapters=["hot"])
    assert out[0].token_ids == expected[0].token_ids
    assert engine.adapter_stats()["hot"].slot_loads == 1  # the request found it there
    assert engine.unload_adapter("hot") and engine.adapter_slots.resident() == []
    engine.add_request("r", PROMPTS[1], SamplingParams(max_tokens=8, ignore_eos=True), adapter_id="busy")
    engine.step()  # admitted: its slot is pinned now
    assert not engine.unload_adapter("busy") and not engine.load_adapter("hot")  # the one slot is pinned
    assert engine.adapter_slots.resident() == ["busy"]
