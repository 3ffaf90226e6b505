"""Engine configuration: one typed dataclass, filled from keyword overrides or a YAML preset."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.lora.ids import validate_adapter_id
from engine.lora.provider import SOURCES, SourceConfig

if TYPE_CHECKING:
    import torch

# dtype names -> torch's names for them. torch is imported only where a torch dtype or device is asked for: the
# serving side validates an EngineConfig in Serve's build step, which must not import torch (engine/__init__.py)
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16",
          "fp16": "float16"}
LOAD_FORMATS = ("safetensors", "dummy")
QUANTIZATIONS = ("none", "int8", "nf4")  # bitsandbytes' (engine/layers/quantized.py)
CUDA_PREFILLS = ("sdpa", "triton", "flex")  # engine/layers/attention.py: cuda_prefill_kernel
CUDA_EXPERTS = ("per_expert", "grouped")  # engine/backends/cuda.py: _packing


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """An option with a closed set of values: an unknown one refused by name, the known ones listed."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def default_cache_dir() -> Path:
    """Where converted models live: $LORA_SERVE_CACHE, else ~/.cache/lora-serve."""
    env = os.environ.get("LORA_SERVE_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))
    return Path(xdg) / "lora-serve"


@dataclass
class EngineConfig:
    model: str = "smollm2-135m-instruct"  # a local Hugging Face model folder, or the embedded default's name
    dtype: str = "float32"  # the compute dtype; with quantization, that of everything not quantized
    quantization: str = "none"  # "none", "int8" or "nf4" (bitsandbytes) for the decoder layers' linears
    # "auto" picks CUDA when present, else CPU; $LORA_SERVE_DEVICE overrides the default (the test suite runs on
    # CPU in CI and on CUDA on a GPU machine from the same files)
    device: str = dataclasses.field(default_factory=lambda: os.environ.get("LORA_SERVE_DEVICE", "auto"))
    load_format: str = "safetensors"  # "dummy": random weights, no checkpoint read (speed tests of model shapes)
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps (they are captured per batch-size bucket)
    # a step's host work (scheduling step N+1, filling its inputs, reading back step N's tokens) overlapping the
    # device's work on step N (engine/llm_engine.py). Opt-in: it has not run on a GPU yet (docs/gpu.md), and on CPU
    # the model runs on the host's own cores, so there is nothing to overlap; refused under tensor parallelism
    async_scheduling: bool = False
    # CUDA prompt chunks' attention: "sdpa" (each chunk's blocks gathered, then SDPA), "triton" (one Triton call a
    # step reading the paged cache in place, engine/kernels/paged_prefill.py) or "flex" (its FlexAttention
    # variant). Only "sdpa" has run on a GPU yet (docs/gpu.md), so the others are opt-in
    cuda_prefill: str = "sdpa"
    # CUDA, a mixture of experts: "per_expert" (each expert's two linears, run expert by expert) or "grouped" (the
    # Triton grouped product over every expert at once, engine/kernels/grouped_gemm.py; not run on a GPU yet,
    # docs/gpu.md). The CPU always takes its C++ grouped operator where it builds
    cuda_experts: str = "per_expert"
    # CPU: the C++ operators (engine/kernels/cpu_ops.py, compiled once per machine): decode attention reading the
    # paged cache in place, RMSNorm and rotary; False keeps the pure-PyTorch paths (their references in tests)
    cpu_kernels: bool = True
    # CPU with the C++ operators: a step's decoder layers in one C++ call where the step allows it, the GIL released
    # throughout (engine/models/decoder_stack.py); False keeps the modules' path, its reference in tests
    decoder_stack: bool = True
    # CPU with the C++ operators (Linux): the weights and the KV cache on 2 MiB transparent huge pages
    # (engine/backends/huge_pages.py); False keeps them on the allocator's ordinary pages
    huge_pages: bool = True
    # CUDA: fused Triton element-wise operators (engine/kernels/cuda_ops.py: the residual addition with RMSNorm,
    # rotary, the K/V cache write, SiLU times up); False keeps the eager PyTorch ops (their references in tests)
    cuda_fused_ops: bool = True
    block_size: int = 16  # tokens per paged KV cache block (and per prefix-cache digest)
    kv_cache_bytes: int = 512 * 1024 * 1024  # memory budget for the paged KV cache (per tensor-parallel worker)
    # the KV cache's dtype: "auto" is the model's dtype (vLLM's meaning). Where a bf16 model computes in float32 (a
    # CPU without bf16 matrix math), "float32" keeps its keys and values unrounded at twice the bytes
    kv_cache_dtype: str = "auto"
    kv_cache_memory_fraction: float | None = None  # overrides kv_cache_bytes: this share of free device memory
    num_kv_blocks: int | None = None  # overrides kv_cache_bytes when set (tests use it to force preemption)
    max_num_seqs: int = 64  # sequences running at once; more wait in the queue
    enable_prefix_caching: bool = True  # reuse the K/V of full blocks of an already computed prefix
    max_num_batched_tokens: int = 4096  # per-step token budget (prefill + decode tokens)
    # steps sized by time too: a step's prompt tokens cut to what fits this many seconds beside its decodes, at the
    # costs the engine learns from its own steps (engine/step_cost.py), and waiting prompts ordered shortest first
    # with aging; None: steps sized by max_num_batched_tokens alone, first come first served
    step_time_target_s: float | None = 0.5
    max_model_len: int | None = None  # defaults to the model's context length
    max_tokens_limit: int | None = None  # a ceiling on any request's max_tokens, below what the context allows
    max_waiting_requests: int = 512  # a request beyond this many waiting ones is refused (EngineOverloadedError)
    num_threads: int | None = None  # torch CPU threads per worker; None = the cores, shared evenly by the workers
    # N workers each holding 1/N of every layer (engine/distributed/), over gloo on CPU and NCCL on CUDA (a GPU
    # each, run eager): rank 0 in the engine's process, the others local processes offline and Ray actors in the
    # replica's placement group under Serve (one bundle each: args.tensor_parallel); 1 = the model whole in the
    # engine's process. N must divide the model's heads, KV heads and MLP columns, and not exceed the node's GPUs;
    # adapters are sharded with the model (LoRA B by output rows in q/k/v and gate/up, A by input in o and down);
    # quantization, mixtures of experts, async scheduling and kv_cache_memory_fraction are refused above 1
    tensor_parallel_size: int = 1
    cache_dir: str | None = None  # where converted models live; default $LORA_SERVE_CACHE, else ~/.cache/lora-serve
    # Multi-LoRA: adapters in device slots per replica (0 disables LoRA), and where adapters come from.
    max_loras: int = 0
    max_lora_rank: int = 16  # the largest adapter rank a slot holds; a larger adapter is refused at load
    # a mixture of experts: slots hold adapters' weights on the experts too (PEFT's target_parameters), every
    # expert's, which for a large mixture is far more than its attention's (the memory plan shows the slots'
    # bytes); False keeps them off and refuses such adapters by name
    expert_lora: bool = True
    adapters_root: str | None = None  # "local": a folder of adapters; "s3": s3://bucket/prefix
    adapter_source: str = "local"  # "local", "hub" (the Hugging Face Hub, HF_ENDPOINT) or "s3" (AWS_ENDPOINT_URL)
    hub_cache: str | None = None  # a Hugging Face cache read when HF_HUB_OFFLINE is set or the Hub is unreachable
    adapter_disk_cache: str | None = None  # downloaded adapters (hub, s3); default <cache dir>/adapters
    adapter_disk_cache_bytes: int = 8 << 30  # LRU by bytes beyond this
    adapter_download_timeout_s: float = 30.0  # per connection and per read
    adapter_download_retries: int = 3  # further tries of a failed download (hub, s3)
    max_adapter_bytes: int = 1 << 30  # an adapter's files; a download stops here
    adapter_cache_timeout_s: float = 30.0  # in serving, the cache actor silent this long: adapter requests get 503
    max_adapter_wait_s: float = 1.0  # after this, a request whose adapter has no slot stops being passed
    # Loaded into the CPU tier and device slots when the engine starts (so into every replica added by scale-up):
    # their first requests find them warm. Pinned adapters also keep their slots for good.
    preload_adapters: tuple[str, ...] = ()
    pinned_adapters: tuple[str, ...] = ()  # preloaded, and holding their device slots for good
    seed: int = 0  # the seed of the generator that sampled requests without a seed of their own share
    log_stats: bool = True  # print the model's memory plan when the engine starts

    @classmethod
    def from_overrides(cls, model: str | None = None, **overrides) -> EngineConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        cfg = cls(**overrides) if model is None else cls(model=model, **overrides)
        cfg.validate()
        return cfg

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> EngineConfig:
        """Load a preset from configs/*.yaml (its `engine:` section, or the whole file), then apply overrides."""
        import yaml

        data = yaml.safe_load(Path(path).read_text()) or {}
        data = data.get("engine", data)
        return cls.from_overrides(**{**data, **overrides})

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        _check_choice("load_format", self.load_format, LOAD_FORMATS)
        _check_choice("quantization", self.quantization, QUANTIZATIONS)
        self._validate_kv_cache_dtype()
        _check_choice("cuda_prefill", self.cuda_prefill, CUDA_PREFILLS)
        _check_choice("cuda_experts", self.cuda_experts, CUDA_EXPERTS)
        if self.kv_cache_memory_fraction is not None and not 0 < self.kv_cache_memory_fraction < 1:
            raise ValueError(f"kv_cache_memory_fraction must be between 0 and 1, got {self.kv_cache_memory_fraction}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_waiting_requests",
                     "tensor_parallel_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras must be >= 0 and max_lora_rank >= 1, "
                             f"got {self.max_loras}, {self.max_lora_rank}")
        _check_choice("adapter_source", self.adapter_source, SOURCES)
        if self.adapter_download_timeout_s <= 0 or self.adapter_download_retries < 0:
            raise ValueError("adapter_download_timeout_s must be positive and adapter_download_retries >= 0")
        if self.adapter_cache_timeout_s <= 0:
            raise ValueError(f"adapter_cache_timeout_s must be positive, got {self.adapter_cache_timeout_s}")
        self._validate_preloads()
        self._validate_tensor_parallel()
        if self.step_time_target_s is not None and self.step_time_target_s <= 0:
            raise ValueError(f"step_time_target_s must be positive or None, got {self.step_time_target_s}")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise ValueError(f"max_tokens_limit must be >= 1, got {self.max_tokens_limit}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")

    def _validate_tensor_parallel(self) -> None:
        """What tensor parallelism does not run yet, refused by name (what needs the model or the device is refused
        when the engine starts: engine/executor/multiprocess.py)."""
        size = self.tensor_parallel_size
        if self.kv_cache_memory_fraction is not None and size > 1:
            raise ValueError(f"kv_cache_memory_fraction under tensor parallelism is not supported yet (each of the "
                             f"{size} workers would take that share of the free memory): set kv_cache_bytes, each "
                             f"worker's budget")

    def _validate_kv_cache_dtype(self) -> None:
        """'auto', the model's dtype, or float32 for a bf16 model (which takes it only where it computes in float32:
        the attention kernels read float32 queries over a bf16 cache, not the reverse)."""
        if self.kv_cache_dtype == "auto":
            return
        if self.kv_cache_dtype not in DTYPES:
            raise ValueError(f"kv_cache_dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.kv_cache_dtype!r}"
                             " (fp8 KV caches are not implemented)")
        wanted, model = DTYPES[self.kv_cache_dtype], DTYPES.get(self.dtype)
        if wanted != model and (wanted, model) != ("float32", "bfloat16"):
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} does not fit dtype {self.dtype!r}: use 'auto'"
                             " (the model's dtype), or float32 for a bfloat16 model on a CPU without bf16 matrix math")

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The KV cache's dtype. "auto" keeps it in the model's dtype even where a bf16 model computes in float32:
        half the bytes, so twice the tokens in the same budget, and a long context's decode attention reads half as
        much (the C++ kernels widen the cached bf16 as they load it). float32 is taken only where the model computes
        in it."""
        import torch

        if self.kv_cache_dtype == "auto":
            return self.torch_dtype
        wanted = getattr(torch, DTYPES[self.kv_cache_dtype])
        if wanted != self.torch_dtype and wanted != self.compute_dtype:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} needs a model that computes in it: this "
                             f"{self.dtype} model computes in {str(self.compute_dtype).removeprefix('torch.')} here")
        return wanted

    def _validate_preloads(self) -> None:
        self.preload_adapters, self.pinned_adapters = tuple(self.preload_adapters), tuple(self.pinned_adapters)
        if (self.preload_adapters or self.pinned_adapters) and not self.max_loras:
            raise ValueError("preload_adapters and pinned_adapters need LoRA: set max_loras > 0")
        if self.pinned_adapters and len(set(self.pinned_adapters)) >= self.max_loras:
            raise ValueError(f"{len(set(self.pinned_adapters))} pinned_adapters leave none of the {self.max_loras} "
                             f"device slots (max_loras) to other adapters")
        for adapter_id in self.preload_adapters + self.pinned_adapters:
            validate_adapter_id(adapter_id)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, DTYPES[self.dtype])

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the model runs in: torch_dtype, except where the platform computes it in another
        (engine/platform.py: bf16 on a CPU without bf16 matrix instructions). The weights keep torch_dtype's values
        there (engine/models load_model), and the linears their storage where a C++ kernel widens them
        (engine/layers/linear.py)."""
        from engine.platform import platform_of

        return platform_of(self.torch_device).compute_dtype(self.torch_dtype)

    @property
    def threads_per_worker(self) -> int:
        """num_threads, else the machine's cores shared evenly by the tensor-parallel workers."""
        return self.num_threads or max(1, (os.cpu_count() or 1) // self.tensor_parallel_size)

    @property
    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def adapter_sources(self) -> SourceConfig:
        """Where the adapter caches read adapters from, and how they download them."""
        disk_cache = self.adapter_disk_cache or str(default_cache_dir() / "adapters")
        return SourceConfig(self.adapter_source, self.adapters_root, self.hub_cache, disk_cache,
                            self.adapter_disk_cache_bytes, self.max_adapter_bytes, self.max_lora_rank,
                            self.adapter_download_timeout_s, self.adapter_download_retries)

    @property
    def model_cache_dir(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else default_cache_dir() / "models"
