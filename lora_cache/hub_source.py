"""Adapters from the Hugging Face Hub: "org/name" or "org/name@revision", downloaded into the disk tier.

huggingface_hub resolves each file (`get_hf_file_metadata`: the revision's commit, the file's size, where to fetch
it, with `HF_TOKEN` and `HF_ENDPOINT` honoured) and fetches it with its retrying HTTP client; the bytes go
through the disk tier's bounded files, so a download stops at `max_adapter_bytes` and a short one is refused. The
entry is keyed by the commit: a new commit on a branch is a new download, a cached commit is never fetched again.
Only `adapter_config.json` and `adapter_model.safetensors` are fetched; a repository with only pickled
`adapter_model.bin` weights is refused. With `HF_HUB_OFFLINE=1` nothing is downloaded: adapters are read from the
local Hugging Face cache (`HubCacheSource`), as they are when the Hub cannot be reached (as huggingface_hub does).
"""

from __future__ import annotations

import os
from urllib.parse import urlparse

from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
from huggingface_hub.utils import build_hf_headers, http_stream_backoff

from engine.errors import AdapterError, AdapterNotFoundError
from lora_cache.adapter_folder import CONFIG_FILE, WEIGHTS_FILE
from lora_cache.disk_tier import BoundedFile, DiskTier, check_announced, entry_name
from lora_cache.sources import HubCacheSource, split_revision

FILES = (CONFIG_FILE, WEIGHTS_FILE)
CHUNK_BYTES = 1 << 20


class HubUnreachable(AdapterError):
    """The Hub did not answer (network, timeout, a 5xx after retries): the local cache may still hold the adapter."""


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it, from the environment at this moment."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


class HubSource:
    name = "hub"

    def __init__(self, tier: DiskTier, cache_dir: str | None = None, timeout_s: float = 30.0, retries: int = 3):
        self.tier = tier
        self.offline_cache = HubCacheSource(cache_dir)
        self.endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
        self.token = os.environ.get("HF_TOKEN") or None
        self.timeout_s = timeout_s
        self.retries = retries

    def locate(self, adapter_id: str):
        if hub_offline():
            return self.offline_cache.locate(adapter_id)
        repo, revision = split_revision(adapter_id)
        try:
            metadata = {name: self._metadata(adapter_id, repo, revision, name) for name in FILES}
        except HubUnreachable as unreachable:
            try:
                return self.offline_cache.locate(adapter_id)
            except AdapterError:
                raise unreachable from None
        check_announced(adapter_id, [m.size for m in metadata.values()], self.tier.max_adapter_bytes)
        commit = metadata[WEIGHTS_FILE].commit_hash or metadata[WEIGHTS_FILE].etag
        entry = entry_name(self.name, repo, commit)
        return self.tier.lookup(entry) or self.tier.fill(
            adapter_id, entry, lambda open_file: self._download(adapter_id, metadata, open_file))

    def _metadata(self, adapter_id: str, repo: str, revision: str | None, filename: str):
        url = hf_hub_url(repo, filename, revision=revision, endpoint=self.endpoint)
        try:
            return get_hf_file_metadata(url, token=self.token, timeout=self.timeout_s, endpoint=self.endpoint,
                                        retry_on_errors=True)
        except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
            reason = f"not found on the Hub ({self.endpoint}): {_first_line(exc)}"
            raise AdapterNotFoundError(adapter_id, reason) from None
        except EntryNotFoundError:
            hint = "; pickled adapter_model.bin weights are never downloaded" if filename == WEIGHTS_FILE else ""
            raise AdapterError(adapter_id, f"the Hub repository {repo!r} has no {filename}{hint}") from None
        except HfHubHTTPError as exc:
            raise AdapterError(adapter_id, f"the Hub ({self.endpoint}) refused {filename}: {_first_line(exc)}") \
                from None
        except Exception as exc:  # httpx2's transport errors and timeouts, after huggingface_hub's retries
            raise HubUnreachable(adapter_id, f"the Hub ({self.endpoint}) did not answer for {filename}: "
                                             f"{_first_line(exc)}") from None

    def _download(self, adapter_id: str, metadata: dict, open_file) -> None:
        for name in FILES:
            meta = metadata[name]
            with open_file(name) as file:
                self._fetch(adapter_id, meta.location, file)
                file.finish(meta.size)

    def _fetch(self, adapter_id: str, url: str, file: BoundedFile) -> None:
        headers = build_hf_headers(token=self.token) if self._same_host(url) else {}
        headers["Accept-Encoding"] = "identity"  # the announced size is the size on the wire
        try:
            with http_stream_backoff("GET", url, headers=headers, timeout=self.timeout_s, max_retries=self.retries,
                                     follow_redirects=True) as response:
                response.raise_for_status()
                for chunk in response.iter_bytes(CHUNK_BYTES):
                    file.write(chunk)
        except AdapterError:
            raise
        except Exception as exc:  # httpx2's transport and status errors: the download failed, say why
            raise AdapterError(adapter_id, f"download from {urlparse(url).netloc} failed: {_first_line(exc)}") \
                from None

    def _same_host(self, url: str) -> bool:
        """The token goes only to the Hub's own host, not to a CDN it redirects to."""
        return urlparse(url).netloc == urlparse(self.endpoint).netloc


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
