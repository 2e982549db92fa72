"""The key-value buckets of managed state and secrets, and reading many keys at once.

- `rp-state-head`: `<org>.<ws>` -> the workspace's current state version (JSON), moved
  with optimistic concurrency (`update(..., last=revision)`);
- `rp-state-locks`: `<org>.<ws>` -> the Terraform lock held on the workspace's state,
  taken with `create` so that only one holder can exist;
- `rp-secrets`: `<org>.<ws>.<name>` -> one secret variable's value, sealed (never clear).
"""

from __future__ import annotations

import json

import nats.errors
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
    """The current value of every key matching `pattern` (e.g. `acme.net.*`), at least as
    new as every write acknowledged before the call. Deleted keys are left out.

    A batched direct get of the last message per subject (one request, no consumer, no
    scan of the bucket), which any replica may answer: its answer counts only if the
    sequence it was read at (`Nats-UpTo-Sequence`) is at or past the stream's last
    sequence as its leader had it just before. Otherwise the keys are read from the
    leader: a follower that is behind would hand a dispatch an old secret, or none.
    """
    need = await _leader_last_seq(nc, f"KV_{bucket}", timeout)
    found, upto = await direct_last_values(nc, bucket, pattern, timeout=timeout)
    if upto >= need:
        return found
    return await _leader_last_values(nc, bucket, pattern, timeout)


async def _leader_last_seq(nc: NATS, stream: str, timeout: float) -> int:
    """A stream's last sequence from its leader (who answers stream info)."""
    try:
        resp = await nc.request(f"$JS.API.STREAM.INFO.{stream}", b"", timeout=timeout)
    except (TimeoutError, nats.errors.Error) as e:
        raise KvError(f"reading {stream}'s last sequence: {e!r}") from e
    answer = json.loads(resp.data)
    if "error" in answer:
        raise KvError(f"reading {stream}: {answer['error'].get('description')}")
    return int(answer["state"]["last_seq"])


async def _leader_last_values(
    nc: NATS, bucket: str, pattern: str, timeout: float
) -> dict[str, bytes]:
    """The keys matching `pattern` from the stream's leader, one message get each (the
    buckets keep one revision per key, so each key's message is its current value)."""
    prefix = f"$KV.{bucket}."
    js = nc.jetstream(timeout=timeout)
    found: dict[str, bytes] = {}
    seq = 1
    while True:
        try:
            raw = await js.get_msg(f"KV_{bucket}", seq=seq, subject=prefix + pattern, next=True)
        except nats.js.errors.NotFoundError:
            return found
        except (TimeoutError, nats.errors.Error) as e:
            raise KvError(f"reading {bucket} from the stream leader: {e!r}") from e
        key = str(raw.subject)[len(prefix) :]
        if (raw.headers or {}).get(KV_OP) in (KV_DEL, KV_PURGE):
            found.pop(key, None)
        else:
            found[key] = raw.data or b""
        seq = int(raw.seq or seq) + 1


async def direct_last_values(
    nc: NATS, bucket: str, pattern: str, *, timeout: float = 5.0
) -> tuple[dict[str, bytes], int]:
    """The batched direct get alone, from whichever replica answers, and the sequence
    that replica read at (0 if it did not say)."""
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
                    return found, int(hdrs.get("Nats-UpTo-Sequence") or 0)
                raise KvError(f"reading {bucket}: {status} {hdrs.get('Description', '')}")
            if hdrs.get(KV_OP) in (KV_DEL, KV_PURGE):
                continue
            found[hdrs["Nats-Subject"][len(prefix) :]] = msg.data
    except TimeoutError as e:
        raise KvError(f"reading {bucket} timed out") from e
    finally:
        await sub.unsubscribe()
