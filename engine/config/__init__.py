"""The engine's configuration, one dataclass per concern (engine.py says how flat options map to them)."""

from engine.config.backend import CUDA_EXPERTS, CUDA_PREFILLS, BackendConfig
from engine.config.cache import CacheConfig
from engine.config.engine import OPTIONS, EngineConfig
from engine.config.model import LOAD_FORMATS, QUANTIZATIONS, ModelConfig
from engine.config.options import DTYPES, default_cache_dir
from engine.config.scheduler import SchedulerConfig

__all__ = ["CUDA_EXPERTS", "CUDA_PREFILLS", "DTYPES", "LOAD_FORMATS", "OPTIONS", "QUANTIZATIONS", "BackendConfig",
           "CacheConfig", "EngineConfig", "ModelConfig", "SchedulerConfig", "default_cache_dir"]
