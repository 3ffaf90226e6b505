"""lora-serve engine: continuous batching over a paged KV cache."""

from engine.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError
from engine.config import EngineConfig
from engine.llm_engine import LLM, EngineStats, LLMEngine, RequestOutput
from engine.model_files import ModelNotFoundError
from engine.sampling import ResponseFormat, SamplingParams

__all__ = ["LLM", "AsyncEngine", "EngineConfig", "EngineDeadError", "EngineOverloadedError", "EngineStats",
           "LLMEngine", "ModelNotFoundError", "RequestOutput", "ResponseFormat", "SamplingParams"]
