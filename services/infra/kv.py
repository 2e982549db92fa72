"""The key-value buckets of managed state and secrets, and reading many keys at once.

- `rp-state-head`: `<org>.<ws>` -> the workspace's current state version (JSON), moved
  with optimistic concurrency (`update(..., last=revision)`);
- `rp-state-locks`: `<org>.<ws>` -> the Terraform lock held on the workspace's state,
  taken with `create` so that only one holder can exist;
- `rp-secrets`: `<org>.<ws>.<name>` -> one secret variable's value, sealed (never clear).
"""

from __future__ import annotations

import json

import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE

from services.infra import replicas as rep

STATE_HEAD_BUCKET = "rp-state-head"
STATE_LOCKS_BUCKET = "rp-state-locks"
SECRETS_BUCKET = "rp-secrets"
BUCKETS = (STATE_HEAD_BUCKET, STATE_LOCKS_BUCKET, SECRETS_BUCKET)
_BATCH = 1000


class KvError(RuntimeError):
    """A bucket read failed; NATS may be back in a moment."""

    retryable = True


async def declare_buckets(nc: NATS, js: JetStreamContext, *, replicas: int) -> None:
    """Create the buckets unless they exist, and raise an existing one to `replicas`
    (never lower it). Safe from every process at every start."""
    for bucket in BUCKETS:
        try:
            await js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            await js.create_key_value(
                KeyValueConfig(
                    bucket=bucket,
                    history=1,
                    storage=StorageType.FILE,
                    replicas=replicas,
                    direct=True,
                )
            )
        else:
            await rep.raise_stream(nc, f"KV_{bucket}", replicas)


async def last_values(
    nc: NATS, bucket: str, pattern: str, *, timeout: float = 5.0
) -> dict[str, bytes]:
    """The current value of every key matching `pattern` (e.g. `acme.net.*`), in one request.

    A batched direct get of the last message per subject, so a workspace's keys are read
    without a consumer and without scanning the bucket. Deleted keys are left out.
    """
    prefix = f"$KV.{bucket}."
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    found: dict[str, bytes] = {}
    try:
        req = {"multi_last": [prefix + pattern], "batch": _BATCH}
        await nc.publish(f"$JS.API.DIRECT.GET.KV_{bucket}", json.dumps(req).encode(), reply=inbox)
        while True:
            msg = await sub.next_msg(timeout=timeout)
            hdrs = msg.headers or {}
            if status := hdrs.get("Status"):
                if status in ("204", "404"):
                    return found
                raise KvError(f"reading {bucket}: {status} {hdrs.get('Description', '')}")
            if hdrs.get(KV_OP) in (KV_DEL, KV_PURGE):
                continue
            found[hdrs["Nats-Subject"][len(prefix) :]] = msg.data
    except TimeoutError as e:
        raise KvError(f"reading {bucket} timed out") from e
    finally:
        await sub.unsubscribe()
