"""Model folders for the GPU benchmark: typed-in configs of real shapes (SmolLM2-135M, Llama-3.2-1B, Llama-3-8B)
and tiny ones of the same architecture for a CPU smoke run, written as config.json plus a tokenizer's files.

No weights are written: the engine fills random ones (load_format "dummy") and the Hugging Face baselines build
theirs with `from_config`, which is all a speed measurement of a shape needs. The vocabulary sizes are the real
ones (128,256 for Llama 3) even though the tokenizer copied in is SmolLM2's (49,152 tokens): prompts are token ids
below the tokenizer's length, and the embedding and LM-head matrices keep their true size and read cost.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
          "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
          "rms_norm_eps": 1e-5, "use_cache": True, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192}

SHAPES: dict[str, dict] = {
    "smollm2-135m": {**_LLAMA, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
                     "max_position_embeddings": 8192, "rope_theta": 100000.0, "tie_word_embeddings": True},
    "llama-3.2-1b": {**_LLAMA, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
                     "max_position_embeddings": 131072, "rope_theta": 500000.0, "rope_scaling": _LLAMA3_ROPE,
                     "tie_word_embeddings": True, "bos_token_id": 128000, "eos_token_id": 128001},
    "llama-3-8b": {**_LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
                   "max_position_embeddings": 8192, "rope_theta": 500000.0, "tie_word_embeddings": False,
                   "bos_token_id": 128000, "eos_token_id": 128001},
}

# --tiny: same architectures, hidden 64, 2 layers. The "8b" stand-in has a vocabulary larger than the tokenizer's,
# as the real Llama shapes do, so the smoke run covers generated ids the tokenizer cannot spell.
_TINY = {**_LLAMA, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 2048, "rope_theta": 10000.0}
TINY_SHAPES: dict[str, dict] = {
    "smollm2-135m": {**_TINY, "vocab_size": 512, "tie_word_embeddings": True},
    "llama-3.2-1b": {**_TINY, "vocab_size": 1024, "tie_word_embeddings": True},
    "llama-3-8b": {**_TINY, "vocab_size": 50304, "tie_word_embeddings": False},
}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "tokenizer.model")


def shape(name: str, tiny: bool) -> dict:
    return dict((TINY_SHAPES if tiny else SHAPES)[name])


def build_model_dir(root: Path, name: str, tokenizer_dir: Path, tiny: bool = False) -> Path:
    """root/name with config.json (the typed-in shape) and the tokenizer's files copied in; no weights."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(shape(name, tiny), indent=2) + "\n")
    copied = [f for f in TOKENIZER_FILES if (tokenizer_dir / f).is_file()]
    if "tokenizer.json" not in copied and "tokenizer.model" not in copied:
        raise FileNotFoundError(f"{tokenizer_dir} holds no tokenizer.json / tokenizer.model")
    for file in copied:
        shutil.copy2(tokenizer_dir / file, folder / file)
    return folder


def decode_weight_bytes(config: dict, bytes_per_param: int = 2) -> int:
    """Bytes of weights one batch-1 decode step must read: every decoder layer, the final norm and the LM head.
    The input embedding is left out (one row of it is read), unless tied, when it is the LM head."""
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q = config["num_attention_heads"] * head_dim
    kv = config["num_key_value_heads"] * head_dim
    attention = hidden * q + 2 * hidden * kv + q * hidden
    mlp = 3 * hidden * inter
    per_layer = attention + mlp + 2 * hidden
    params = layers * per_layer + hidden + config["vocab_size"] * hidden
    return params * bytes_per_param


def kv_bytes_per_token(config: dict, bytes_per_value: int = 2) -> int:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * bytes_per_value
