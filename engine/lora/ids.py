"""Adapter ids, as requests and configs name adapters: "name" or "org/name", with an optional "@revision".

Ids become paths under a source's root (a folder, a bucket prefix, a Hub repo), so anything that could leave that
root is refused here, where every id enters: the engine's config, its requests and the adapter sources.
"""

from __future__ import annotations

import os
import re

from engine.errors import AdapterError

MAX_ID_LENGTH = 256
_ID_PART = re.compile(r"[A-Za-z0-9._-]+")


def validate_adapter_id(adapter_id: str) -> str:
    """Return `adapter_id` if it is "name" or "org/name" of [A-Za-z0-9._-], with an optional "@revision" of the
    same characters, else raise AdapterError.

    Ids become paths under a source's root, so anything that could leave that root is refused."""
    _check_characters(adapter_id)
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


def _check_characters(adapter_id: str) -> None:
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
