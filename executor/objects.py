"""Files to and from the JetStream object store, streamed (never whole in memory).

nats-py's `ObjectStore.get()` into memory is quadratic in the object size, so downloads
always go through `writeinto=` a file; uploads read from an open file in chunks.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import itertools
import json
import os
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors
import structlog
from nats.js import JetStreamContext, api
from nats.js.kv import MSG_ROLLUP_SUBJECT
from nats.js.object_store import (
    OBJ_CHUNKS_PRE_TEMPLATE,
    OBJ_DEFAULT_CHUNK_SIZE,
    OBJ_DIGEST_TEMPLATE,
    OBJ_META_PRE_TEMPLATE,
    OBJ_STREAM_TEMPLATE,
    ObjectStore,
)

from executor.errors import ObjectStoreError
from infra.streams import LOGS_BUCKET, PLANS_BUCKET, STATE_BUCKET

__all__ = ["LOGS_BUCKET", "PLANS_BUCKET", "STATE_BUCKET", "Objects", "sha256_file"]

log = structlog.get_logger(__name__)
_NATS_ERRORS = (nats.errors.Error, nats.js.errors.Error, TimeoutError, OSError)
# Files up to this size are read whole on the event loop (no thread hop per chunk).
SMALL_OBJECT = 1024 * 1024
DOWNLOAD_PATIENCE_S = 30.0  # a bucket's leader election after a node died: seconds
# One read of an object may take this long plus a second per MIN_RATE bytes: nats-py's
# `get` waits without end for chunks that an object's deletion (a sweep, a retention
# pass) purged between its read of the meta and its subscription to them.
STALL_S = 10.0
MIN_RATE = 4 * 1024 * 1024


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1024 * 1024):
            h.update(chunk)
    return h.hexdigest()


def plan_object(run_id: str) -> str:
    return f"{run_id}.tfplan"


def log_object(run_id: str, phase: str, step: str) -> str:
    """A step's finished log. The phase is part of the name: both phases have a `checkout`."""
    return f"{run_id}/{phase}/{step}.log"


class Objects:
    """The object-store buckets of one JetStream context, bound lazily and kept."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js
        self._buckets: dict[str, ObjectStore] = {}

    async def _bucket(self, name: str) -> ObjectStore:
        if name not in self._buckets:
            self._buckets[name] = await self.js.object_store(name)
        return self._buckets[name]

    async def download(
        self, bucket: str, name: str, dest: Path, *, patience: float = DOWNLOAD_PATIENCE_S
    ) -> bool:
        """Write object `name` to `dest`; False (and no file) if there is no such object.

        The object lands in a temporary file first, so `dest` is either whole or untouched.
        A transient failure is tried again for up to `patience` seconds: on a cluster the
        bucket's stream has no leader for a few seconds after its node died, and an apply
        must not fail for that (its saved plan is still there).
        """
        deadline = asyncio.get_running_loop().time() + patience
        for attempt in itertools.count(1):
            try:
                return await self._download_once(bucket, name, dest)
            except ObjectStoreError:
                if asyncio.get_running_loop().time() >= deadline:
                    raise
                log.warning("download_retry", bucket=bucket, object=name, attempt=attempt)
                await asyncio.sleep(min(0.25 * attempt, 2.0))
        raise AssertionError("unreachable")  # pragma: no cover  # the loop returns or raises

    async def _download_once(self, bucket: str, name: str, dest: Path) -> bool:
        part = dest.with_name(f".{dest.name}.part")
        with part.open("wb") as f:  # a local failure here is not the store's: not retried
            try:
                await self._get(await self._bucket(bucket), name, f)
            except nats.js.errors.ObjectNotFoundError:
                found = False
            except _NATS_ERRORS as e:
                found = None
                error: BaseException = e
            else:
                found = True
        if found is True:
            os.replace(part, dest)
            return True
        part.unlink(missing_ok=True)
        if found is None:
            self._buckets.pop(bucket, None)  # bound again next time
            raise ObjectStoreError(f"downloading {bucket}/{name}: {error!r}") from error
        return False

    @staticmethod
    async def _get(store: ObjectStore, name: str, into: io.BufferedIOBase) -> None:
        """nats-py's `get` of `name` into a file, bounded by its size (STALL_S): an
        object deleted while it was read is not found; one still there, an error (tried
        again). A timed-out read's ordered consumer is left to its server's inactivity."""
        info = await store.get_info(name)
        try:
            await asyncio.wait_for(
                store.get(name, writeinto=into), STALL_S + (info.size or 0) / MIN_RATE
            )
        except TimeoutError:
            await store.get_info(name)  # ObjectNotFoundError: deleted under the read
            raise

    async def upload(
        self, bucket: str, name: str, src: Path, *, attempts: int = 3, fresh: bool = False
    ) -> None:
        """Store `src` as object `name`, retrying a transient failure a few times.

        `fresh`: the caller knows no object `name` was stored before (a step's log), so
        the first attempt skips nats-py's lookup of a version to replace; a retry does
        not (the failed attempt may have stored one).
        """
        for attempt in range(1, attempts + 1):
            try:
                store = await self._bucket(bucket)
                if src.stat().st_size > SMALL_OBJECT:
                    with src.open("rb") as f:
                        await store.put(name, f)
                elif fresh and attempt == 1:
                    await self._put_new(bucket, name, src.read_bytes())
                else:
                    await store.put(name, src.read_bytes())
                return
            except _NATS_ERRORS as e:
                if attempt == attempts:
                    raise ObjectStoreError(f"uploading {bucket}/{name}: {e!r}") from e
                await asyncio.sleep(0.5 * attempt)

    async def _put_new(self, bucket: str, name: str, data: bytes) -> None:
        """nats-py's `ObjectStore.put` of bytes, less its lookup of an object to replace:
        the same chunks and meta message, read back by any object-store client.

        The chunks and the meta go out together and their acknowledgements are awaited
        together (one write to the socket, one wait, not one per message): the object is
        new, so nobody reads it before this returns (its name reaches an event only
        then), and the order in which the stream stores them does not matter. Should any
        be refused, what did land is purged: chunks without their meta, or a meta
        without all of its chunks."""
        nuid = uuid.uuid4().hex
        chunks = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=nuid)
        size = OBJ_DEFAULT_CHUNK_SIZE
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()
        info = api.ObjectInfo(
            name=name,
            bucket=bucket,
            nuid=nuid,
            size=len(data),
            chunks=(len(data) + size - 1) // size,
            mtime=datetime.now(UTC).isoformat(),
            digest=OBJ_DIGEST_TEMPLATE.format(digest=digest),
            options=api.ObjectMetaOptions(max_chunk_size=size),
        )
        meta = OBJ_META_PRE_TEMPLATE.format(
            bucket=bucket, obj=base64.urlsafe_b64encode(name.encode()).decode()
        )
        sends = [
            self.js.publish(chunks, data[offset : offset + size])
            for offset in range(0, len(data), size)
        ]
        rollup: dict[str, Any] = {api.Header.ROLLUP: MSG_ROLLUP_SUBJECT}
        sends.append(self.js.publish(meta, json.dumps(info.as_dict()).encode(), headers=rollup))
        acks = await asyncio.gather(*sends, return_exceptions=True)
        failed = [a for a in acks if isinstance(a, BaseException)]
        if not failed:
            return
        stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
        purge = [chunks] if data else []
        if not isinstance(acks[-1], BaseException):
            purge.append(meta)  # a fresh name: the meta is this attempt's alone
        for subject in purge:
            try:
                await self.js.purge_stream(stream, subject=subject)
            except _NATS_ERRORS:
                pass
        raise failed[0]
