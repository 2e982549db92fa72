"""Files to and from the JetStream object store, streamed (never whole in memory).

nats-py's `ObjectStore.get()` into memory is quadratic in the object size, so downloads
always go through `writeinto=` a file; uploads read from an open file in chunks.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import uuid
from datetime import UTC, datetime
from pathlib import Path

import nats.errors
import nats.js.errors
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
from services.infra.streams import LOGS_BUCKET, PLANS_BUCKET, STATE_BUCKET

__all__ = ["LOGS_BUCKET", "PLANS_BUCKET", "STATE_BUCKET", "Objects", "sha256_file"]

_NATS_ERRORS = (nats.errors.Error, nats.js.errors.Error, TimeoutError, OSError)
# Files up to this size are read whole on the event loop (no thread hop per chunk).
SMALL_OBJECT = 1024 * 1024


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

    async def download(self, bucket: str, name: str, dest: Path) -> bool:
        """Write object `name` to `dest`; False (and no file) if there is no such object.

        The object lands in a temporary file first, so `dest` is either whole or untouched.
        """
        part = dest.with_name(f".{dest.name}.part")
        try:
            store = await self._bucket(bucket)
            with part.open("wb") as f:
                await store.get(name, writeinto=f)
        except nats.js.errors.ObjectNotFoundError:
            part.unlink(missing_ok=True)
            return False
        except _NATS_ERRORS as e:
            part.unlink(missing_ok=True)
            raise ObjectStoreError(f"downloading {bucket}/{name}: {e!r}") from e
        os.replace(part, dest)
        return True

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
        the same chunks and meta message, read back by any object-store client."""
        nuid = uuid.uuid4().hex
        chunks = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=nuid)
        size = OBJ_DEFAULT_CHUNK_SIZE
        try:
            for offset in range(0, len(data), size):
                await self.js.publish(chunks, data[offset : offset + size])
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
            await self.js.publish(
                meta,
                json.dumps(info.as_dict()).encode(),
                headers={api.Header.ROLLUP: MSG_ROLLUP_SUBJECT},
            )
        except Exception:
            if data:  # as nats-py does: no chunks left behind without their meta
                stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
                try:
                    await self.js.purge_stream(stream, subject=chunks)
                except _NATS_ERRORS:
                    pass
            raise
