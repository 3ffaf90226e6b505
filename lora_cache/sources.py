"""Where adapters come from: an adapter id -> a local folder holding adapter_config.json and
adapter_model.safetensors.

A source only locates files; `read_adapter` validates them. `local` reads a folder tree; `hub` downloads from the
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

from engine.errors import AdapterError, AdapterNotFoundError
from engine.lora.ids import validate_adapter_id
from lora_cache.adapter_folder import CONFIG_FILE, WEIGHTS_FILE

_COMMIT = re.compile(r"[A-Za-z0-9._-]+")  # a ref file's content, before it becomes a path part


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
            if not _COMMIT.fullmatch(commit) or commit in (".", ".."):
                raise AdapterError(adapter_id, f"its Hugging Face cache ref {revision or 'main'!r} does not hold a "
                                               "commit hash")
            return repo / "snapshots" / commit
        snapshots = sorted(p for p in (repo / "snapshots").glob("*") if p.is_dir())
        if len(snapshots) > 1:
            raise AdapterError(adapter_id, f"its Hugging Face cache has {len(snapshots)} snapshots and no refs/main "
                                           "to choose one")
        return snapshots[0] if snapshots else None


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
