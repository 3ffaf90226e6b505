"""The disk tier: adapters downloaded from remote sources (Hub, S3), kept in one folder, LRU by bytes.

Each downloaded adapter is a folder `<root>/<entry>/` with its two files; `entry` names the source, the adapter id
and the remote version (a Hub commit, the S3 objects' ETags), so a retrained adapter lands in a new entry and a
cached one never answers for newer weights. A download is written into a staging folder `<root>/.staging/<pid>-*`
and renamed into place only once every file is complete and within its size: a crash or a killed process never
leaves half an adapter that a later load would accept, and the staging folders of dead processes are removed when
the tier opens. Each entry's folder modification time records its last use; past `capacity_bytes` the least
recently used entries go, never the one just filled.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.errors import AdapterError

STAGING = ".staging"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass
class ByteBudget:
    """The bytes one adapter's download may write, in all its files (max_adapter_bytes)."""
    adapter_id: str
    limit: int
    used: int = 0

    def take(self, nbytes: int) -> None:
        self.used += nbytes
        if self.used > self.limit:
            raise AdapterError(self.adapter_id, f"download passed max_adapter_bytes ({self.limit} bytes); aborted")


class BoundedFile:
    """A file being downloaded: every write is charged to the adapter's budget, so a download past the limit stops
    at the limit, not after the server is done sending."""

    def __init__(self, path: Path, budget: ByteBudget):
        self.path = path
        self.budget = budget
        self._file = path.open("wb")

    def write(self, data: bytes) -> int:
        self.budget.take(len(data))
        return self._file.write(data)

    def __getattr__(self, name):  # tell, seek, truncate, flush: what a downloader may call on a file
        return getattr(self._file, name)

    def __enter__(self) -> BoundedFile:
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()

    def finish(self, expected_size: int | None) -> None:
        """Flush to disk and close; a file shorter or longer than the size its server announced is refused."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        size = self.path.stat().st_size
        if expected_size is not None and size != expected_size:
            raise AdapterError(self.budget.adapter_id, f"{self.path.name} is truncated or damaged: {size} bytes "
                                                       f"arrived of the {expected_size} announced")


# A download fills a staging folder: it writes each file through the BoundedFile the opener gives it.
Download = Callable[[Callable[[str], BoundedFile]], None]


def check_announced(adapter_id: str, sizes: list[int | None], limit: int) -> None:
    """Refuse before downloading when the sizes a server announces already pass the limit."""
    total = sum(size or 0 for size in sizes)
    if total > limit:
        raise AdapterError(adapter_id, f"its files announce {total} bytes, over max_adapter_bytes ({limit})")


def entry_name(kind: str, adapter_id: str, version: str) -> str:
    """A folder name for one version of one adapter: readable, and unique through a hash of all three parts."""
    digest = hashlib.sha256(f"{kind}\0{adapter_id}\0{version}".encode()).hexdigest()[:16]
    return f"{kind}--{_UNSAFE.sub('_', adapter_id)[:96]}--{digest}"


class DiskTier:
    def __init__(self, root: str | Path, capacity_bytes: int, max_adapter_bytes: int):
        self.root = Path(root).expanduser()
        self.capacity_bytes = capacity_bytes
        self.max_adapter_bytes = max_adapter_bytes
        (self.root / STAGING).mkdir(parents=True, exist_ok=True)
        self._remove_dead_staging()

    def lookup(self, entry: str) -> Path | None:
        """The entry's folder if it is complete here (and now the most recently used), else None."""
        folder = self.root / entry
        if not folder.is_dir():
            return None
        os.utime(folder)
        return folder

    def fill(self, adapter_id: str, entry: str, download: Download) -> Path:
        """Run `download` into a staging folder, then move it into place as `entry` and evict beyond capacity."""
        staging = self.root / STAGING / f"{os.getpid()}-{uuid.uuid4().hex}"
        staging.mkdir()
        budget = ByteBudget(adapter_id, self.max_adapter_bytes)
        try:
            download(lambda name: BoundedFile(staging / name, budget))
            folder = self.root / entry
            try:
                staging.rename(folder)
            except OSError:  # another process filled the same entry first: its copy is as good
                if not folder.is_dir():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        os.utime(folder)
        self._evict(keep=folder)
        return folder

    def entries(self) -> list[Path]:
        return [p for p in self.root.iterdir() if p.is_dir() and p.name != STAGING]

    def _evict(self, keep: Path) -> None:
        entries = sorted(self.entries(), key=lambda p: p.stat().st_mtime)
        total = sum(_size(p) for p in entries)
        for folder in entries:
            if total <= self.capacity_bytes:
                break
            if folder != keep:
                total -= _size(folder)
                self._remove(folder)

    def _remove(self, folder: Path) -> None:
        """Out of sight at once (a rename), then deleted: a reader never sees a half-deleted entry."""
        doomed = self.root / STAGING / f"{os.getpid()}-evicted-{uuid.uuid4().hex}"
        try:
            folder.rename(doomed)
        except OSError:  # another process removed it
            return
        shutil.rmtree(doomed, ignore_errors=True)

    def _remove_dead_staging(self) -> None:
        for path in (self.root / STAGING).iterdir():
            pid = path.name.split("-", 1)[0]
            if not pid.isdigit() or not _alive(int(pid)):
                shutil.rmtree(path, ignore_errors=True)


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True

