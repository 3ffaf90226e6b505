"""Where adapters come from: an adapter id -> a local folder holding adapter_config.json and
adapter_model.safetensors.

A source only locates files; `load_adapter` validates them. `local` reads a folder tree; `hub` downloads from the
Hugging Face Hub (lora_cache/hub_source.py), or with HF_HUB_OFFLINE reads an existing Hugging Face cache
(`HubCacheSource`); `s3` reads S3-compatible object storage (lora_cache/s3_source.py). The remote sources download
into the disk tier (lora_cache/disk_tier.py) and return its folder.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

from lora_cache.adapter_folder import CONFIG_FILE, WEIGHTS_FILE, AdapterError, AdapterNotFoundError

MAX_ID_LENGTH = 256
_ID_PART = re.compile(r"[A-Za-z0-9._-]+")


def split_revision(adapter_id: str) -> tuple[str, str | None]:
    """ "org/name@rev" -> ("org/name", "rev"); "org/name" -> ("org/name", None). Both parts validated."""
    name, at, revision = validate_adapter_id(adapter_id).partition("@")
    return name, (revision if at else None)


def split_s3_url(url: str) -> tuple[str, str]:
    """ "s3://bucket/some/prefix" -> ("bucket", "some/prefix"); ValueError for anything else."""
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"an S3 location looks like s3://bucket/prefix, got {url!r}")
    return parsed.netloc, parsed.path.strip("/")


def validate_adapter_id(adapter_id: str) -> str:
    """Return `adapter_id` if it is "name" or "org/name" of [A-Za-z0-9._-], with an optional "@revision" of the
    same characters, else raise AdapterError.

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
    name, at, revision = adapter_id.partition("@")
    if at and (not _ID_PART.fullmatch(revision) or revision in (".", "..")):
        raise AdapterError(adapter_id, "adapter id revision (after '@') must be made of letters, digits, '.', "
                                       "'_' and '-'")
    parts = name.split("/")
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
            raise AdapterError(adapter_id, "a file of its folder resolves outside the folder it was looked for in "
                                           "(a symbolic link?)")
    return folder


class LocalSource:
    """Adapters as folders under a root: "name" -> root/name, "org/name" -> root/org/name."""

    name = "local"

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser()
        if not self.root.is_dir():
            raise ValueError(f"adapters root {self.root} is not a directory")

    def locate(self, adapter_id: str) -> Path:
        name, revision = split_revision(adapter_id)
        if revision is not None:
            raise AdapterError(adapter_id, "a local adapter has no revisions ('@'); revisions are for the hub source")
        folder = self.root / name
        if not _inside(folder, self.root):
            raise AdapterError(adapter_id, "its folder resolves outside the adapters root")
        if not folder.is_dir():
            raise AdapterNotFoundError(adapter_id, "not found in the adapters root")
        return _check_contained(adapter_id, folder, self.root)


def default_hub_cache() -> Path:
    """$HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub (the huggingface_hub defaults)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


class HubCacheSource:
    """Adapters already in a Hugging Face cache: "org/name[@rev]" -> models--org--name/snapshots/<refs/rev>, where
    rev is a branch or tag under refs/ (main by default) or a commit hash with a snapshot.

    Offline: it reads the cache layout and never downloads."""

    name = "hub"

    def __init__(self, cache_dir: str | Path | None = None):
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else default_hub_cache()

    def locate(self, adapter_id: str) -> Path:
        name, revision = split_revision(adapter_id)
        repo = self.cache_dir / ("models--" + name.replace("/", "--"))
        snapshot = self._snapshot(adapter_id, repo, revision)
        if snapshot is None or not snapshot.is_dir():
            raise AdapterNotFoundError(adapter_id, "not found in the Hugging Face cache")
        return _check_contained(adapter_id, snapshot, repo)  # snapshot files link into repo/blobs

    @staticmethod
    def _snapshot(adapter_id: str, repo: Path, revision: str | None) -> Path | None:
        if revision is not None and (repo / "snapshots" / revision).is_dir():
            return repo / "snapshots" / revision  # a commit hash
        ref = repo / "refs" / (revision or "main")
        if revision is not None and not ref.is_file():
            return None
        if ref.is_file():
            commit = ref.read_text(encoding="utf-8").strip()
            if not _ID_PART.fullmatch(commit) or commit in (".", ".."):
                raise AdapterError(adapter_id, f"its Hugging Face cache ref {revision or 'main'!r} does not hold a "
                                               "commit hash")
            return repo / "snapshots" / commit
        snapshots = sorted(p for p in (repo / "snapshots").glob("*") if p.is_dir())
        if len(snapshots) > 1:
            raise AdapterError(adapter_id, f"its Hugging Face cache has {len(snapshots)} snapshots and no refs/main "
                                           "to choose one")
        return snapshots[0] if snapshots else None


SOURCES = ("hub", "local", "s3")


@dataclass(frozen=True)
class SourceConfig:
    """Where a cache reads adapters from, how it downloads them, and the limits every adapter it reads meets (the
    engine's adapter_* options, max_adapter_bytes and max_lora_rank)."""
    kind: str = "local"  # "local", "hub" or "s3"
    adapters_root: str | None = None  # local: a folder; s3: s3://bucket/prefix
    hub_cache: str | None = None  # hub offline (HF_HUB_OFFLINE) or unreachable: this Hugging Face cache
    disk_cache: str | None = None  # the disk tier of downloaded adapters
    disk_cache_bytes: int = 8 << 30
    max_adapter_bytes: int = 1 << 30
    max_lora_rank: int | None = None
    download_timeout_s: float = 30.0
    download_retries: int = 3


def make_source(config: SourceConfig) -> AdapterSource:
    if config.kind == "local":
        if config.adapters_root is None:
            raise ValueError("the local adapter source needs an adapters root folder")
        return LocalSource(config.adapters_root)
    if config.kind not in SOURCES:
        raise ValueError(f"unknown adapter source {config.kind!r}; known: {', '.join(SOURCES)}")
    if config.kind == "s3" and config.adapters_root is None:
        raise ValueError("the s3 adapter source needs adapters_root: s3://bucket/prefix")
    return remote_source(config.kind, config, config.adapters_root)


def remote_source(kind: str, config: SourceConfig, root: str | None) -> AdapterSource:
    """The hub or s3 source, downloading into the disk tier of `config`; an s3 source without a root fetches only
    whole locations (S3Source.fetch)."""
    from lora_cache.disk_tier import DiskTier  # the remote sources' libraries load only when one is used

    if config.disk_cache is None:
        raise ValueError(f"the {kind} adapter source needs a disk cache folder (adapter_disk_cache)")
    tier = DiskTier(config.disk_cache, config.disk_cache_bytes, config.max_adapter_bytes)
    if kind == "hub":
        from lora_cache.hub_source import HubSource

        return HubSource(tier, config.hub_cache, config.download_timeout_s, config.download_retries)
    from lora_cache.s3_source import S3Source

    return S3Source(tier, root, config.download_timeout_s, config.download_retries)


@dataclass(frozen=True)
class AdapterLocation:
    """Where an adapter registered at run time lives (vLLM's `lora_path`): an absolute local folder,
    s3://bucket/prefix (the folder holding the two files) or hf://org/name[@revision]."""
    scheme: str  # "local", "s3" or "hub"
    path: str  # the folder; "bucket/prefix"; "org/name[@revision]"

    @classmethod
    def parse(cls, lora_path: str) -> AdapterLocation:
        if lora_path.startswith("s3://"):
            bucket, prefix = split_s3_url(lora_path)
            if not prefix:
                raise ValueError(f"lora_path {lora_path!r}: an S3 location is s3://bucket/prefix")
            return cls("s3", f"{bucket}/{prefix}")
        if lora_path.startswith("hf://"):
            repo = lora_path[len("hf://"):]
            split_revision(repo)  # AdapterError names what is wrong with it
            return cls("hub", repo)
        if "://" in lora_path:
            raise ValueError(f"lora_path {lora_path!r}: known schemes are s3:// and hf://, or an absolute local path")
        if not os.path.isabs(lora_path):
            raise ValueError(f"lora_path {lora_path!r}: a local path must be absolute")
        return cls("local", os.path.normpath(lora_path))

    def __str__(self) -> str:
        return {"local": "{}", "s3": "s3://{}", "hub": "hf://{}"}[self.scheme].format(self.path)
