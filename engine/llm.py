"""The offline API: LLM(model, **engine options).generate(prompts, params) steps an LLMEngine until every prompt
is done, as vLLM's LLM does."""

from __future__ import annotations

import itertools
from typing import Self

from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, Prompt
from engine.lora.merge_spec import MergeSpec
from engine.lora.provider import AdapterProviderFactory
from engine.outputs import RequestOutput
from engine.sampling import SamplingParams


class LLM:
    """Offline batch generation: LLM("smollm2-135m-instruct", dtype="bfloat16").generate(prompts, params)."""

    def __init__(self, model: str = "smollm2-135m-instruct", adapters: AdapterProviderFactory | None = None,
                 **overrides):
        """adapters: where LoRA adapters come from when max_loras > 0; by default lora_cache's, which reads them from
        the config's adapter_source in this process (engine/lora/provider.py)."""
        self.engine = LLMEngine(EngineConfig.from_overrides(model, **overrides), adapters)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's tensor-parallel workers, if any (idempotent; interpreter exit does it too)."""
        self.engine.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def merge_adapters(self, spec: MergeSpec) -> str:
        """An id for `adapters=[...]` that serves the merge of spec's adapters (LoRAX's merged_adapters)."""
        if self.engine.adapters is None:
            raise ValueError("merging adapters needs LoRA: start the engine with max_loras > 0")
        return self.engine.adapters.merge(spec)

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, adapters: list[str | None] | None = None) -> list[RequestOutput]:
        """adapters: one LoRA adapter id (or None for the base model) per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        adapters = adapters or [None] * len(prompts)
        if len(adapters) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(adapters)} adapters")
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        prepared = [self.engine.prepare_request(i, prompt, p, a)
                    for i, prompt, p, a in zip(ids, prompts, params, adapters)]
        for request in prepared:  # validated all first: a bad prompt leaves nothing behind
            self.engine.add_prepared(request)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(prompts), desc="generate", disable=not use_tqdm or len(prompts) < 2) as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        return [finished[i] for i in ids]
