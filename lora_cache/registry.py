"""Adapters registered at run time (vLLM's load_lora_adapter and unload_lora_adapter), and versions as keys.

A name's generation counts how often it was registered or unregistered. The engine and every cache know an
adapter by its key: the bare name at generation 0 (never registered: the configured source is read), else
"name#generation". A reload is thus a new key: requests already running keep the device slot and the weights of
the old key, new requests resolve the name to the new key and load the new weights, and nothing cached under the
old key can answer for the new one. '#' is never part of a valid id (lora_cache/sources.py), so a key never
collides with a name.

The registry lives in the cluster's cache actor. Replicas hold a `RegistryView` and long-poll the actor for the
next one (`changed_since`), so a change reaches every replica within one actor call; a load or unload answers
once every live replica has applied it (`wait_applied`), or after a timeout. The registry is saved to a file
(written under a temporary name, then renamed) on every change, so an actor that Ray restarts keeps the names,
locations and generations.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import KEY_SEPARATOR, AdapterNotFoundError, key_name
from lora_cache.sources import AdapterLocation


def adapter_key(name: str, generation: int) -> str:
    return name if generation == 0 else f"{name}{KEY_SEPARATOR}{generation}"


def key_generation(key: str) -> int:
    _, sep, generation = key.partition(KEY_SEPARATOR)
    return int(generation) if sep else 0


@dataclass(frozen=True)
class RegistryView:
    """What a replica needs to turn a requested name into the current key."""
    version: int = 0
    generations: dict[str, int] = field(default_factory=dict)

    def key(self, name: str) -> str:
        return adapter_key(name, self.generations.get(name, 0))

    def is_current(self, key: str) -> bool:
        return self.key(key_name(key)) == key


@dataclass(frozen=True)
class Registration:
    """The answer to a load: the name, its new key, and the content id of the weights now served under it."""
    name: str
    key: str
    content_id: str
    version: int


class AdapterRegistry:
    def __init__(self, path: Path | None = None):
        self.path = path
        saved = json.loads(path.read_text()) if path is not None and path.is_file() else {}
        self.locations: dict[str, AdapterLocation] = {n: AdapterLocation.parse(p)
                                                      for n, p in saved.get("locations", {}).items()}
        self.generations: dict[str, int] = saved.get("generations", {})
        self.version: int = saved.get("version", 0)
        self.applied: dict[str, int] = {}  # replica -> the last version it applied
        self._changed = asyncio.Event()

    def location(self, name: str) -> AdapterLocation | None:
        return self.locations.get(name)

    def next_key(self, name: str) -> str:
        return adapter_key(name, self.generations.get(name, 0) + 1)

    def register(self, name: str, location: AdapterLocation) -> str:
        self.locations[name] = location
        return self._bump(name)

    def unregister(self, name: str) -> str:
        if name not in self.locations:
            raise AdapterNotFoundError(name, "was not loaded through load_lora_adapter, so it cannot be unloaded")
        del self.locations[name]
        return self._bump(name)

    def view(self) -> RegistryView:
        return RegistryView(self.version, dict(self.generations))

    async def changed_since(self, replica: str, version: int, timeout_s: float) -> RegistryView:
        """The view once it differs from `version` (which `replica` has applied), or after timeout_s."""
        self.applied[replica] = version
        if version == self.version:
            try:
                await asyncio.wait_for(self._changed.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        return self.view()

    async def wait_applied(self, version: int, replicas: list[str], timeout_s: float) -> list[str]:
        """Wait until these replicas have applied `version`; the ones that did not within timeout_s."""
        deadline = time.monotonic() + timeout_s
        while (late := [r for r in replicas if self.applied.get(r, -1) < version]) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return late

    def _bump(self, name: str) -> str:
        self.generations[name] = self.generations.get(name, 0) + 1
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()  # the next wait is for the next change
        self._save()
        return adapter_key(name, self.generations[name])

    def _save(self) -> None:
        if self.path is None:
            return
        state = {"version": self.version, "generations": self.generations,
                 "locations": {n: str(loc) for n, loc in self.locations.items()}}
        self.path.parent.mkdir(parents=True, exist_ok=True)  # a local-source server never made its disk cache
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        temporary.write_text(json.dumps(state))
        temporary.replace(self.path)
