"""Adapters in S3-compatible object storage: adapters_root "s3://bucket/prefix", adapter "org/name" ->
s3://bucket/prefix/org/name/{adapter_config.json, adapter_model.safetensors}, downloaded into the disk tier.

boto3 does the talking: the endpoint comes from AWS_ENDPOINT_URL (so MinIO, Ceph, R2 and GCS's S3 endpoint work
as well as AWS), credentials from its usual chain, timeouts and bounded retries from botocore's Config. A HEAD of
both objects gives their ETags and sizes; the disk-tier entry is keyed by the ETags, so an object rewritten under
the same key is a new download and a cached one is never fetched again. The GETs are conditional on those ETags
(an object replaced between HEAD and GET fails the download instead of mixing versions) and stream through the
disk tier's bounded files.
"""

from __future__ import annotations

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from engine.errors import AdapterError, AdapterNotFoundError
from lora_cache.adapter_folder import CONFIG_FILE, WEIGHTS_FILE
from lora_cache.disk_tier import DiskTier, check_announced, entry_name
from lora_cache.sources import split_revision, split_s3_url

FILES = (CONFIG_FILE, WEIGHTS_FILE)
CHUNK_BYTES = 1 << 20
_MISSING = ("404", "NoSuchKey", "NotFound", "NoSuchBucket")


class S3Source:
    name = "s3"

    def __init__(self, tier: DiskTier, root: str | None, timeout_s: float = 30.0, retries: int = 3):
        """root: s3://bucket/prefix for ids; None for a source that only fetches whole locations (`fetch`)."""
        self.tier = tier
        self.bucket, self.prefix = split_s3_url(root) if root is not None else (None, "")
        config = Config(connect_timeout=timeout_s, read_timeout=timeout_s,
                        retries={"max_attempts": retries, "mode": "standard"})
        self.client = boto3.client("s3", config=config)

    def locate(self, adapter_id: str):
        name, revision = split_revision(adapter_id)
        if revision is not None:
            raise AdapterError(adapter_id, "an S3 adapter has no revisions ('@'): its version is its objects' ETags")
        if self.bucket is None:
            raise AdapterError(adapter_id, "this S3 source has no adapters_root to find ids under")
        return self.fetch(adapter_id, self.bucket, "/".join(p for p in (self.prefix, name) if p))

    def fetch(self, adapter_id: str, bucket: str, prefix: str):
        """The adapter whose two files are under s3://bucket/prefix/, as a disk-tier folder."""
        keys = {file: f"{prefix}/{file}" for file in FILES}
        heads = {file: self._head(adapter_id, bucket, key) for file, key in keys.items()}
        check_announced(adapter_id, [h["ContentLength"] for h in heads.values()], self.tier.max_adapter_bytes)
        version = "+".join(heads[file]["ETag"].strip('"') for file in FILES)
        entry = entry_name(self.name, f"{bucket}/{prefix}", version)
        return self.tier.lookup(entry) or self.tier.fill(
            adapter_id, entry, lambda open_file: self._download(adapter_id, bucket, keys, heads, open_file))

    def _head(self, adapter_id: str, bucket: str, key: str) -> dict:
        try:
            return self.client.head_object(Bucket=bucket, Key=key)
        except ClientError as exc:
            if _code(exc) in _MISSING:
                raise AdapterNotFoundError(adapter_id, f"{_file(key)} not found in S3") from None
            raise AdapterError(adapter_id, f"S3 refused {_file(key)}: {_code(exc)}") from None
        except BotoCoreError as exc:
            raise AdapterError(adapter_id, f"S3 did not answer for {_file(key)}: {type(exc).__name__}") from None

    def _download(self, adapter_id: str, bucket: str, keys: dict, heads: dict, open_file) -> None:
        for file in FILES:
            with open_file(file) as out:
                try:
                    body = self.client.get_object(Bucket=bucket, Key=keys[file], IfMatch=heads[file]["ETag"])["Body"]
                    for chunk in body.iter_chunks(CHUNK_BYTES):
                        out.write(chunk)
                except (ClientError, BotoCoreError) as exc:
                    raise AdapterError(adapter_id, f"download of {file} from S3 failed: {type(exc).__name__}") \
                        from None
                out.finish(heads[file]["ContentLength"])


# A refusal reaches the client: it names the adapter's file, never the bucket and prefix the operator configured
def _file(key: str) -> str:
    return key.rsplit("/", 1)[-1]


def _code(exc: ClientError) -> str:
    """S3's error code (NoSuchKey, AccessDenied, ...)."""
    return exc.response.get("Error", {}).get("Code") or "an error"
