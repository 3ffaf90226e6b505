"""Where adapters come from: an adapter id -> a local folder holding adapter_config.json and
adapter_model.safetensors.

A source only locates files; `load_adapter` validates them. Every source works offline here: the local
source reads a folder tree and the hub source reads an existing Hugging Face cache without downloading.
A remote source (S3, HTTP) is a small new class with the same `name` and `locate`: download the two adapter
files into a local staging folder (after `validate_adapter_id`) and return that folder.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Protocol

from lora_cache.adapter import CONFIG_FILE, WEIGHTS_FILE, AdapterError

MAX_ID_LENGTH = 256
_ID_PART = re.compile(r"[A-Za-z0-9._-]+")


def validate_adapter_id(adapter_id: str) -> str:
    """Return `adapter_id` if it is "name" or "org/name" of [A-Za-z0-9._-], else raise AdapterError.

    Ids become paths under a source's root, so anything that could leave that root is refused."""
    if not isinstance(adapter_id, str) or not adapter_id:
        raise AdapterError(str(adapter_id), "adapter id is empty")
    if len(adapter_id) > MAX_ID_LENGTH:
        raise AdapterError(adapter_id, f"adapter id is {len(adapter_id)} characters, over {MAX_ID_LENGTH}")
    if "\0" in adapter_id:
        raise AdapterError(adapter_id, "adapter id contains a NUL character")
    if "\\" in adapter_id:
        raise AdapterError(adapter_id, "adapter id contains a backslash")
    if adapter_id.startswith(("/", "~")) or os.path.isabs(adapter_id):
        raise AdapterError(adapter_id, "adapter id must be a name, not an absolute or home path")
    parts = adapter_id.split("/")
    if any(part in (".", "..") for part in parts):
        raise AdapterError(adapter_id, "adapter id must not contain '.' or '..' path parts")
    if len(parts) > 2 or not all(_ID_PART.fullmatch(part) for part in parts):
        raise AdapterError(adapter_id, "adapter id must be 'name' or 'org/name' made of letters, digits, "
                                       "'.', '_' and '-'")
    return adapter_id


class AdapterSource(Protocol):
    name: str

    def locate(self, adapter_id: str) -> Path:
        """A local folder holding the adapter's files; AdapterError if the adapter is absent."""
        ...


def _inside(path: Path, root: Path) -> bool:
    return path.resolve().is_relative_to(root.resolve())


def _check_contained(adapter_id: str, folder: Path, root: Path) -> Path:
    """`folder` and its adapter files must resolve inside `root`, so symlinks cannot reach other files."""
    paths = [folder] + [folder / f for f in (CONFIG_FILE, WEIGHTS_FILE) if (folder / f).exists()]
    for path in paths:
        if not _inside(path, root):
            raise AdapterError(adapter_id, f"{path} resolves outside {root}")
    return folder


class LocalSource:
    """Adapters as folders under a root: "name" -> root/name, "org/name" -> root/org/name."""

    name = "local"

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser()
        if not self.root.is_dir():
            raise ValueError(f"adapters root {self.root} is not a directory")

    def locate(self, adapter_id: str) -> Path:
        folder = self.root / validate_adapter_id(adapter_id)
        if not _inside(folder, self.root):
            raise AdapterError(adapter_id, f"{folder} resolves outside the adapters root {self.root}")
        if not folder.is_dir():
            raise AdapterError(adapter_id, f"not found in {self.root}")
        return _check_contained(adapter_id, folder, self.root)


def default_hub_cache() -> Path:
    """$HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub (the huggingface_hub defaults)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


class HubCacheSource:
    """Adapters already in a Hugging Face cache: "org/name" -> models--org--name/snapshots/<refs/main>.

    Offline only: it reads the cache layout and never downloads."""

    name = "hub"

    def __init__(self, cache_dir: str | Path | None = None):
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else default_hub_cache()

    def locate(self, adapter_id: str) -> Path:
        repo = self.cache_dir / ("models--" + validate_adapter_id(adapter_id).replace("/", "--"))
        snapshot = self._snapshot(adapter_id, repo)
        if snapshot is None or not snapshot.is_dir():
            raise AdapterError(adapter_id, f"not found in the Hugging Face cache {self.cache_dir}")
        return _check_contained(adapter_id, snapshot, repo)  # snapshot files link into repo/blobs

    @staticmethod
    def _snapshot(adapter_id: str, repo: Path) -> Path | None:
        ref = repo / "refs" / "main"
        if ref.is_file():
            commit = ref.read_text(encoding="utf-8").strip()
            if not _ID_PART.fullmatch(commit) or commit in (".", ".."):
                raise AdapterError(adapter_id, f"{ref} does not hold a commit hash")
            return repo / "snapshots" / commit
        snapshots = sorted(p for p in (repo / "snapshots").glob("*") if p.is_dir())
        if len(snapshots) > 1:
            raise AdapterError(adapter_id, f"{repo} has {len(snapshots)} snapshots and no refs/main to choose one")
        return snapshots[0] if snapshots else None


SOURCES = {"local": LocalSource, "hub": HubCacheSource}


def make_source(kind: str, adapters_root: str | Path | None = None,
                hub_cache: str | Path | None = None) -> AdapterSource:
    if kind == "local":
        if adapters_root is None:
            raise ValueError("the local adapter source needs an adapters root folder")
        return LocalSource(adapters_root)
    if kind == "hub":
        return HubCacheSource(hub_cache)
    raise ValueError(f"unknown adapter source {kind!r}; known: {', '.join(sorted(SOURCES))}")
