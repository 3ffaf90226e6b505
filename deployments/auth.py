"""API keys: who may call, and what each key reaches.

With no keys configured the server is open, as vLLM without --api-key. With keys, every route but /health
needs `Authorization: Bearer <key>`. A key is kept only as the SHA-256 of its text (a key file holds nothing
else), and a presented key is hashed and compared with every stored hash in constant time (hmac.compare_digest,
no early exit), so neither the answer's timing nor a log line gives a key away: keys never reach a log or an
error message.

A key may be scoped (no peer offers per-adapter tenancy): `adapters` are glob patterns (fnmatch) over adapter
ids; `base_model: false` keeps the key off the base model; `manage_adapters` lets it load and unload adapters
(within its patterns). Limits per key live in deployments/rate_limits.py.

    python -m deployments.auth <key>    # prints the key's sha256, for a key file
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import Field, model_validator

from deployments.strict import StrictModel
from engine.sampling import PRIORITY_MAX, PRIORITY_MIN

BEARER = "bearer "


class Unauthorized(Exception):
    """No key, or not a key this server knows (HTTP 401)."""


@dataclass(frozen=True)
class KeyLimits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None  # prompt and generated tokens
    max_concurrent: int | None = None  # requests in flight at once (streams included)


@dataclass(frozen=True)
class KeyScope:
    adapters: tuple[str, ...] = ("*",)  # fnmatch patterns over adapter ids
    base_model: bool = True
    manage_adapters: bool = False  # /v1/load_lora_adapter and /v1/unload_lora_adapter, for names in `adapters`
    min_priority: int | None = None  # the most urgent vLLM priority its requests may ask for (lower is more urgent)

    def allows_adapter(self, adapter_id: str) -> bool:
        return any(fnmatch.fnmatchcase(adapter_id, pattern) for pattern in self.adapters)


@dataclass(frozen=True)
class ApiKey:
    name: str  # the metrics label and what operators see; never the key
    sha256: bytes = field(repr=False)
    scope: KeyScope = KeyScope()
    limits: KeyLimits = KeyLimits()


OPEN = ApiKey("anonymous", b"", KeyScope(manage_adapters=True))  # every caller of a server without keys


class ApiKeyConfig(StrictModel):
    """One entry of `api_keys` in the app args or of an `api_keys_file` (YAML or JSON list)."""
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    key: str | None = Field(None, min_length=16, description="the key itself (app args only)")
    key_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    adapters: list[str] = Field(default_factory=lambda: ["*"], max_length=256)
    base_model: bool = True
    manage_adapters: bool = False
    min_priority: int | None = Field(None, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    max_concurrent: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _one_secret(self):
        if (self.key is None) == (self.key_sha256 is None):
            raise ValueError(f"api key {self.name!r}: give key or key_sha256, exactly one")
        return self

    def to_key(self) -> ApiKey:
        digest = bytes.fromhex(self.key_sha256) if self.key_sha256 else hash_key(self.key)
        return ApiKey(self.name, digest, KeyScope(tuple(self.adapters), self.base_model, self.manage_adapters,
                                                   self.min_priority),
                      KeyLimits(self.requests_per_minute, self.tokens_per_minute, self.max_concurrent))


def hash_key(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyRing:
    """The server's keys; authenticate() answers which one a request presents."""

    def __init__(self, keys: list[ApiKey]):
        names = [k.name for k in keys]
        if len(set(names)) != len(names):
            raise ValueError(f"api key names must be unique, got {sorted(n for n in names if names.count(n) > 1)}")
        if len({k.sha256 for k in keys}) != len(keys):
            raise ValueError("two api keys have the same secret")
        self.keys = tuple(keys)

    @classmethod
    def from_config(cls, entries: list[ApiKeyConfig], key_file: str | None) -> KeyRing:
        file_entries = load_key_file(Path(key_file).expanduser()) if key_file else []
        return cls([entry.to_key() for entry in entries + file_entries])

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def authenticate(self, authorization: str | None) -> ApiKey:
        if not self.keys:
            return OPEN
        if not authorization or not authorization.lower().startswith(BEARER):
            raise Unauthorized("this server needs an API key: send Authorization: Bearer <key>")
        digest = hash_key(authorization[len(BEARER):].strip())
        found = None
        for key in self.keys:  # every comparison runs: the time taken does not depend on which key matched
            if hmac.compare_digest(key.sha256, digest):
                found = key
        if found is None:
            raise Unauthorized("the API key is not valid")
        return found


def load_key_file(path: Path) -> list[ApiKeyConfig]:
    """A YAML or JSON list of keys, each given by its key_sha256 (a file holds no keys in clear)."""
    entries = yaml.safe_load(path.read_text()) or []
    if not isinstance(entries, list):
        raise ValueError(f"{path}: an api key file is a list of keys")
    parsed = [ApiKeyConfig(**entry) for entry in entries]
    clear = [entry.name for entry in parsed if entry.key is not None]
    if clear:
        raise ValueError(f"{path}: keys {clear} are in clear; a key file holds key_sha256 only "
                         f"(python -m deployments.auth <key> prints it)")
    return parsed


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m deployments.auth <key>")
    print(json.dumps({"key_sha256": hash_key(sys.argv[1]).hex()}))
