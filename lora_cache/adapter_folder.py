"""What a PEFT LoRA adapter folder holds, and the refusal of a cache that stopped answering (the engine's own
adapter refusals, AdapterError and AdapterNotFoundError, are in engine/errors.py).

Apart from lora_cache/adapter.py, which reads the tensors, so that the sources and the serving side's error
handling import them without torch (deployments/app.py is imported by Serve's build step, before any replica)."""

from __future__ import annotations

from engine.errors import RefusalKind, Refuses, key_name

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


UNAVAILABLE_RETRY_AFTER_S = 5.0  # the Retry-After of a request refused for an unavailable adapter cache

class AdapterCacheUnavailableError(Refuses, RuntimeError):
    """The cluster's adapter cache (a Ray actor) has stopped answering: the request can be retried later (HTTP 503
    with Retry-After), and other requests go on."""
    refusal_kind = RefusalKind.UNAVAILABLE
    retry_after_s = UNAVAILABLE_RETRY_AFTER_S

    def __init__(self, adapter_id: str | None, reason: str):
        what = f"adapter {key_name(adapter_id)!r}: " if adapter_id is not None else ""
        super().__init__(f"{what}the adapter cache is unavailable: {reason}; retry later")
        self.adapter_id = adapter_id
        self.reason = reason

    def __reduce__(self):
        return type(self), (self.adapter_id, self.reason)
