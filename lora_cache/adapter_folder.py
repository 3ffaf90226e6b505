"""What a PEFT LoRA adapter folder holds, and the errors that say what is wrong with an adapter.

Apart from lora_cache/adapter.py, which reads the tensors, so that the sources and the serving side's error
handling import them without torch (deployments/app.py is imported by Serve's build step, before any replica)."""

from __future__ import annotations

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


# A registered adapter's key is "name#generation" (lora_cache/registry.py); '#' is never part of a valid id
SEPARATOR = "#"


def key_name(key: str) -> str:
    return key.partition(SEPARATOR)[0]


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the adapter as requested (not its key's generation)
    and the reason."""

    def __init__(self, adapter_id: str, reason: str):
        name = key_name(adapter_id)
        shown = name if len(name) <= 100 else name[:100] + "..."
        super().__init__(f"adapter {shown!r}: {reason}")
        self.adapter_id = adapter_id
        self.reason = reason

    def __reduce__(self):  # exceptions cross Ray process boundaries pickled; rebuild from both fields
        return type(self), (self.adapter_id, self.reason)


class AdapterNotFoundError(AdapterError):
    """No such adapter where it was looked for (HTTP 404); other AdapterErrors are bad adapters (HTTP 400)."""
