"""What a PEFT LoRA adapter folder holds, and the errors that say what is wrong with an adapter.

Apart from lora_cache/adapter.py, which reads the tensors, so that the sources and the serving side's error
handling import them without torch (deployments/app.py is imported by Serve's build step, before any replica)."""

from __future__ import annotations

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


UNAVAILABLE_RETRY_AFTER_S = 5.0  # the Retry-After of a request refused for an unavailable adapter cache

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


class AdapterCacheUnavailableError(RuntimeError):
    """The cluster's adapter cache (a Ray actor) has stopped answering: the request can be retried later (HTTP 503
    with Retry-After), and other requests go on."""
    retry_after_s = UNAVAILABLE_RETRY_AFTER_S

    def __init__(self, adapter_id: str | None, reason: str):
        what = f"adapter {key_name(adapter_id)!r}: " if adapter_id is not None else ""
        super().__init__(f"{what}the adapter cache is unavailable: {reason}; retry later")
        self.adapter_id = adapter_id
        self.reason = reason

    def __reduce__(self):
        return type(self), (self.adapter_id, self.reason)
