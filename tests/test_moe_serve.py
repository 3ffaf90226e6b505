"""A mixture of experts through a real Ray Serve app: a tiny Qwen3-MoE with an attention adapter and one on
attention and the experts answers the OpenAI routes (the `openai` client) and LoRAX's (`lorax-client`), streamed,
with the offline engine's text."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from lora_cache.local_cache import local_adapters
from tests.helpers import PROMPTS, serving, write_tiny_adapters

pytestmark = pytest.mark.slow
ADAPTERS = (None, "alpha", "beta")
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def adapters_root(tiny_qwen3_moe_path, tmp_path_factory):
    root = write_tiny_adapters(tiny_qwen3_moe_path, tmp_path_factory.mktemp("moe-serve-adapters"), ADAPTERS[1:2])
    return write_tiny_adapters(tiny_qwen3_moe_path, root, ADAPTERS[2:], experts=True)


@pytest.fixture(scope="module")
def server(serve_cluster, tiny_qwen3_moe_path, adapters_root):
    from deployments.app import build_app

    engine = {"model": str(tiny_qwen3_moe_path), "log_stats": False, "max_loras": 2,
              "adapters_root": str(adapters_root)}
    with serving(serve_cluster, build_app({"engine": engine})) as url:
        yield url


def test_openai_and_lorax_routes_serve_a_mixture_of_experts_with_adapters(server, tiny_qwen3_moe_path,
                                                                         adapters_root):
    import openai
    from lorax import Client

    llm = LLM(str(tiny_qwen3_moe_path), adapters=local_adapters, max_loras=2, adapters_root=str(adapters_root),
              log_stats=False)
    prompts = [PROMPTS[1]] * len(ADAPTERS)  # one prompt: each adapter's text is its own
    expected = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0), use_tqdm=False,
                            adapters=list(ADAPTERS))
    client, lorax = openai.OpenAI(base_url=f"{server}/v1", api_key="unused"), Client(server)
    for prompt, adapter, want in zip(prompts, ADAPTERS, expected):
        streamed = client.completions.create(model=adapter or str(tiny_qwen3_moe_path), prompt=prompt,
                                             max_tokens=MAX_TOKENS, temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed) == want.text, adapter
        kwargs = {"adapter_id": adapter} if adapter else {}
        events = list(lorax.generate_stream(prompt, max_new_tokens=MAX_TOKENS, **kwargs))
        assert events[-1].generated_text == want.text, adapter
    assert len({out.text for out in expected}) > 1, "adapters must change outputs"
