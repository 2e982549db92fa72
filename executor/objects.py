"""Files to and from the JetStream object store, streamed (never whole in memory).

nats-py's `ObjectStore.get()` into memory is quadratic in the object size, so downloads
always go through `writeinto=` a file; uploads read from an open file in chunks.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.object_store import ObjectStore

from executor.errors import ObjectStoreError
from services.infra.streams import LOGS_BUCKET, PLANS_BUCKET, STATE_BUCKET

__all__ = ["LOGS_BUCKET", "PLANS_BUCKET", "STATE_BUCKET", "Objects", "sha256_file"]

_NATS_ERRORS = (nats.errors.Error, nats.js.errors.Error, TimeoutError, OSError)


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

    async def upload(self, bucket: str, name: str, src: Path, *, attempts: int = 3) -> None:
        """Store `src` as object `name`, retrying a transient failure a few times."""
        for attempt in range(1, attempts + 1):
            try:
                store = await self._bucket(bucket)
                with src.open("rb") as f:
                    await store.put(name, f)
                return
            except _NATS_ERRORS as e:
                if attempt == attempts:
                    raise ObjectStoreError(f"uploading {bucket}/{name}: {e!r}") from e
                await asyncio.sleep(0.5 * attempt)
