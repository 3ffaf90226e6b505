"""API keys: who may call, and what each key reaches.

With no keys configured the server is open, as vLLM without --api-key. With keys, every route but /health
needs `Authorization: Bearer <key>`. A key is kept only as the SHA-256 of its text, and a presented key is hashed
and compared with every stored hash in constant time (hmac.compare_digest, no early exit), so neither the answer's
timing nor a log line gives a key away: keys never reach a log or an error message.

The serve config never holds a key in clear: Ray Serve logs an application's arguments when it builds the app
(the controller's build log, `serve run`'s output) and keeps the config it was given. A key entry gives the key
as its hash (`key_sha256`), or names where the key is: an environment variable of the process that builds the app
(`key_env`) or a file (`key_file`, e.g. a mounted secret), both read once, at build, and hashed there. An entry
with `key` in clear is refused at start, saying how to write it.

A key may be scoped (no peer offers per-adapter tenancy): `adapters` are glob patterns (fnmatch) over adapter
ids; `base_model: false` keeps the key off the base model; `manage_adapters` lets it load and unload adapters
(within its patterns). Limits per key live in deployments/gate/rate_limits.py.

    python -m deployments.gate.auth <key>    # prints the key's sha256, for a key file
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import Field, model_validator

from deployments.api.strict import StrictModel
from engine.sampling import PRIORITY

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


MIN_KEY_LENGTH = 16
CLEAR_KEY_REFUSED = ("a key in clear in the serve config reaches Ray's logs and stored config; give key_sha256 (python "
                     "-m deployments.gate.auth <key> prints it), key_env (an environment variable holding the key) or "
                     "key_file (a file holding it) instead")


class ApiKeyConfig(StrictModel):
    """One entry of `api_keys` in the app args or of an `api_keys_file` (YAML or JSON list): the key as its hash, or
    where to read it, exactly one of them."""
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$",
                      description="what operators and the metrics' tenant label see; never the key")
    key: str | None = Field(None, description="refused: " + CLEAR_KEY_REFUSED)
    key_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$", description="the key's SHA-256, in hex "
                                   "(python -m deployments.gate.auth <key> prints it)")
    key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                                description="an environment variable of the process that builds the app")
    key_file: str | None = Field(None, min_length=1, description="a file holding the key (surrounding whitespace "
                                 "is dropped)")
    adapters: list[str] = Field(default_factory=lambda: ["*"], max_length=256,
                                description="glob patterns of the adapter ids the key reaches")
    base_model: bool = Field(True, description="whether the key reaches the base model")
    manage_adapters: bool = Field(False, description="whether the key may load and unload adapters (within "
                                  "`adapters`)")
    min_priority: int | None = Field(None, **PRIORITY.field(),
                                     description="the most urgent vLLM priority its requests may ask for")
    requests_per_minute: int | None = Field(None, ge=1, description="a token bucket of requests")
    tokens_per_minute: int | None = Field(None, ge=1, description="a token bucket of prompt and generated tokens")
    max_concurrent: int | None = Field(None, ge=1, description="requests in flight at once, streams included")

    @model_validator(mode="after")
    def _one_secret(self):
        if self.key is not None:
            raise ValueError(f"api key {self.name!r}: {CLEAR_KEY_REFUSED}")
        if [self.key_sha256, self.key_env, self.key_file].count(None) != 2:
            raise ValueError(f"api key {self.name!r}: give key_sha256, key_env or key_file, exactly one")
        return self

    def to_key(self) -> ApiKey:
        """The key as the server keeps it: its hash, read from where the entry says (ValueError if it cannot)."""
        digest = bytes.fromhex(self.key_sha256) if self.key_sha256 else hash_key(self._read_secret())
        return ApiKey(self.name, digest, KeyScope(tuple(self.adapters), self.base_model, self.manage_adapters,
                                                   self.min_priority),
                      KeyLimits(self.requests_per_minute, self.tokens_per_minute, self.max_concurrent))

    def _read_secret(self) -> str:
        if self.key_env is not None:
            secret, where = os.environ.get(self.key_env), f"environment variable {self.key_env}"
        else:
            secret, where = _read_key_file(Path(self.key_file).expanduser()), f"key_file {self.key_file}"
        if secret is None:
            raise ValueError(f"api key {self.name!r}: {where} is not set")
        if len(secret.strip()) < MIN_KEY_LENGTH:
            raise ValueError(f"api key {self.name!r}: the key in {where} is shorter than {MIN_KEY_LENGTH} characters")
        return secret.strip()


def _read_key_file(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:  # its text is the path and the reason, never the file's content
        raise ValueError(f"key_file {path} cannot be read: {exc.strerror}") from None


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
    """A YAML or JSON list of key entries, as `api_keys` holds them (no key in clear)."""
    entries = yaml.safe_load(path.read_text()) or []
    if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
        raise ValueError(f"{path}: an api key file is a list of key entries")
    return [ApiKeyConfig(**entry) for entry in entries]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m deployments.gate.auth <key>")
    print(json.dumps({"key_sha256": hash_key(sys.argv[1]).hex()}))
