"""The green-list watermark: transformers' WatermarkLogitsProcessor token for token, and found by its detector."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, WatermarkDetector, WatermarkingConfig

from engine import LLM, SamplingParams, Watermark
from tests.helpers import PROMPTS, hf_greedy

LORAX = Watermark(greenlist_ratio=0.5, bias=2.0)  # LoRAX's and TGI's gamma and delta


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return LLM(str(smollm2_path), dtype="float32", log_stats=False, kv_cache_bytes=128 << 20)


@pytest.mark.parametrize("repetition_penalty", [1.0, 1.3])
def test_greedy_watermarked_text_equals_transformers(smollm2, smollm2_path, repetition_penalty):
    """Greedy decoding of the watermarked logits is transformers' generate with the same watermarking config,
    alone and after a repetition penalty (transformers applies its watermark after its other processors), in one
    batch with unwatermarked requests; and the watermark changes the text."""
    prompts = PROMPTS[:4]
    marked = SamplingParams(max_tokens=24, temperature=0, watermark=LORAX, repetition_penalty=repetition_penalty)
    plain = SamplingParams(max_tokens=24, temperature=0, repetition_penalty=repetition_penalty)
    outs = smollm2.generate(prompts + prompts, [marked] * 4 + [plain] * 4, use_tqdm=False)
    config = WatermarkingConfig(greenlist_ratio=LORAX.greenlist_ratio, bias=LORAX.bias)
    reference = hf_greedy(smollm2_path, prompts, 24, watermarking_config=config,
                          repetition_penalty=repetition_penalty)
    assert [o.token_ids for o in outs[:4]] == reference
    assert any(m.token_ids != p.token_ids for m, p in zip(outs[:4], outs[4:]))


def test_transformers_detector_finds_the_watermark_in_sampled_text(smollm2, smollm2_path):
    """Sampled text (temperature 1) with the watermark is found by the detector at its default threshold (a z-score
    of 3), each text of 128 tokens; the same prompts and seeds without it are not."""
    detector = WatermarkDetector(AutoConfig.from_pretrained(smollm2_path), "cpu", WatermarkingConfig(
        greenlist_ratio=LORAX.greenlist_ratio, bias=LORAX.bias))
    prompts = PROMPTS[:4]
    z_scores = {}
    for name, watermark in (("marked", LORAX), ("plain", None)):
        params = [SamplingParams(max_tokens=128, temperature=1.0, seed=seed, ignore_eos=True, watermark=watermark)
                  for seed in range(len(prompts))]
        outs = smollm2.generate(prompts, params, use_tqdm=False)
        # the detector scores each token against the one before it: the prompt's last token leads the output
        ids = torch.tensor([o.prompt_token_ids[-1:] + o.token_ids for o in outs])
        z_scores[name] = detector(ids, return_dict=True).z_score.tolist()
    assert min(z_scores["marked"]) > 3.0 > max(z_scores["plain"]), z_scores


def test_green_lists_are_transformers_and_bad_settings_are_refused():
    """The green list after a token is the first greenlist_ratio share of a permutation seeded by the key times
    that token, drawn on CPU, as transformers draws it; settings outside their ranges are refused by name."""
    from transformers.generation.logits_process import WatermarkLogitsProcessor

    reference = WatermarkLogitsProcessor(vocab_size=1000, device="cpu", greenlist_ratio=0.5)
    for token in (0, 7, 999):
        ours = Watermark(greenlist_ratio=0.5).green_list(token, 1000)
        assert ours.tolist() == reference._get_greenlist_ids(torch.tensor([3, token])).tolist()
    for kwargs, words in (({"greenlist_ratio": 1.0}, "greenlist_ratio"), ({"bias": float("nan")}, "bias"),
                          ({"hashing_key": 0}, "hashing_key")):
        with pytest.raises(ValueError, match=words):
            Watermark(**kwargs)
    with pytest.raises(ValueError, match="watermark must be a Watermark"):
        SamplingParams(watermark=True)
