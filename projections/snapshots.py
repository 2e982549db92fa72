"""Snapshots of the read model in the object store, so a new replica starts from one.

A replica (the api's `SnapshotWriter`, every `--snapshot-interval` seconds) copies its
read model with `VACUUM INTO` (one read transaction: every table, the checkpoint's
sequence S among them, as one commit left them), empties the board's tables in the copy
(a restored replica folds RP_HEARTBEATS from its start, as a fresh one does), and stores
it compressed (projections/snapshot_file.py) in `rp-snapshots` as
`readmodel/v<schema>/<S>-<writer>`. Its manifest (S, the schema version, the stream's
name and creation time, a digest of the event at S, the sha256 of the stored form and
the file's size) travels in the object's headers, sealed with the deployment's key: only
a holder of the key makes a snapshot a replica takes, so NATS access alone (or a hash
recomputed over a forged file) cannot plant a read model.

A replica starting with no read model (or one of another schema, or more than
`RESTORE_GAIN` events behind the newest snapshot) restores the newest snapshot that
opens with its key, has its own schema version, names this very stream (its creation
time, and the event at S the same), has S at most the stream's last sequence, and whose
file has the sealed sha256; then the projector tails from S+1. Anything else is logged
with its reason and the next older one tried; none usable: the replay from the read
model's own checkpoint (0 for none), as before snapshots. Writers never share an object
name (S and the writer's id), so two at once corrupt nothing; each prunes all but the
newest `keep` of its schema.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import os
import sqlite3
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.js import api
from nats.js.object_store import ObjectStore

from infra.crypto import CryptoError, KeyRing
from infra.streams import EVENTS, SNAPSHOTS_BUCKET
from projections import schema
from projections.snapshot_file import (
    FileError,
    HashingSink,
    discard_unsynced,
    pack,
    put_in_place,
    settle,
    stored_bound,
    unpack,
)

log = structlog.get_logger(__name__)

HEADER = "Rp-Snapshot"  # the sealed manifest, base64
CHUNK = 512 * 1024  # object chunks (under the server's default 1 MiB max payload)
RESTORE_GAIN = 50_000  # events: a local read model closer than this to a snapshot replays
STALL_S = 30.0  # a download's time: this plus a second per MIN_RATE compressed bytes
MIN_RATE = 2 * 1024 * 1024
_NATS_ERRORS = (nats.errors.Error, nats.js.errors.Error, TimeoutError, OSError)


class SnapshotError(RuntimeError):
    """A snapshot cannot be written or used; the message says why."""

    retryable = False


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    """What a snapshot is, sealed with the deployment's key in its object's headers."""

    seq: int  # the last stream sequence folded into the file (its checkpoint)
    schema: int  # projections/schema.py VERSION of the file
    stream: str
    stream_created: str  # the stream's creation time: a recreated stream is another
    anchor: str  # sha256 of the event at `seq` (empty at 0)
    sha256: str  # of the object as stored (projections/snapshot_file.py)
    size: int  # of the SQLite file
    written_at: str
    writer: str


def prefix(version: int | None = None) -> str:
    """Where the snapshots of a schema version (default: this one's) are named."""
    return f"readmodel/v{schema.VERSION if version is None else version}/"


def object_name(m: Manifest) -> str:
    return f"{prefix(m.schema)}{m.seq:016d}-{m.writer}"


def seq_of(name: str) -> int:
    """The sequence in an object's name (-1: not a snapshot's name)."""
    head = name.rpartition("/")[2].partition("-")[0]
    return int(head) if head.isdigit() else -1


class Snapshots:
    """The snapshot bucket of one deployment: write, list, restore, prune."""

    def __init__(
        self,
        nc: NATS,
        keyring: KeyRing,
        *,
        stream: str = EVENTS,
        bucket: str = SNAPSHOTS_BUCKET,
        keep: int = 3,
    ) -> None:
        self.nc = nc
        self.keyring = keyring
        self.stream = stream
        self.bucket = bucket
        self.keep = keep
        self._store: ObjectStore | None = None
        self._settling: asyncio.Task[None] | None = None  # a restored file's fsync

    async def store(self) -> ObjectStore:
        if self._store is None:
            self._store = await self.nc.jetstream().object_store(self.bucket)
        return self._store

    def context(self, name: str) -> str:
        return f"{self.bucket}/{name}"

    # ------------------------------------------------------------ the stream

    async def identity(self) -> tuple[int, str]:
        """The stream's last sequence and its creation time, from its leader."""
        info = await self.nc.jetstream().stream_info(self.stream)
        created = info.created.isoformat() if info.created else ""
        return int(info.state.last_seq or 0), created

    async def anchor(self, seq: int) -> str:
        """sha256 of the event stored at `seq` (asked of the leader: a follower behind
        would not have it yet)."""
        if seq <= 0:
            return ""
        msg = await self.nc.jetstream().get_msg(self.stream, seq=seq)
        return hashlib.sha256(msg.data or b"").hexdigest()

    # ------------------------------------------------------------ listing

    async def listed(self, version: int | None = None) -> list[api.ObjectInfo]:
        """The snapshots of a schema version, newest (highest S) first."""
        store = await self.store()
        try:
            infos = await store.list()
        except nats.js.errors.NotFoundError:
            return []
        mine = [
            i
            for i in infos
            if not i.deleted and i.name.startswith(prefix(version)) and seq_of(i.name) >= 0
        ]
        return sorted(mine, key=lambda i: (seq_of(i.name), i.name), reverse=True)

    async def sealed(self, version: int | None = None) -> list[tuple[api.ObjectInfo, Manifest]]:
        """The snapshots of a schema version whose manifest opens with the key, newest
        first. Only these count for whether a new one is worth writing and for which
        are kept: an object anyone with NATS access put under the prefix (a name at a
        sequence past the stream's end) neither stops the writers nor has the real ones
        pruned. Such an object is left alone (a newer key this replica lacks may open
        it), as the restore skips it."""
        out = []
        for info in await self.listed(version):
            try:
                manifest = self.manifest(info)
            except SnapshotError:
                continue
            if object_name(manifest) == info.name:
                out.append((info, manifest))
        return out

    def manifest(self, info: api.ObjectInfo) -> Manifest:
        """The object's manifest, opened with the key (SnapshotError: not sealed by it)."""
        sealed = (info.headers or {}).get(HEADER)
        if not sealed:
            raise SnapshotError("no manifest")
        try:
            plain = self.keyring.open(base64.b64decode(sealed), self.context(info.name))
            return msgspec.json.decode(plain, type=Manifest)
        except (CryptoError, ValueError, msgspec.DecodeError) as e:
            raise SnapshotError(f"manifest does not open with this deployment's key: {e}") from e

    # ------------------------------------------------------------ writing

    async def write(self, db_path: Path, writer: str) -> Manifest | None:
        """Copy the read model at `db_path` into the bucket; its manifest, or None when
        the newest snapshot already holds as much."""
        fd, name = tempfile.mkstemp(dir=db_path.parent, prefix=f".{db_path.name}.", suffix=".snap")
        os.close(fd)
        copy = Path(name)
        packed = copy.with_suffix(".snap.z")
        try:
            copy.unlink()  # VACUUM INTO wants a new file
            seq, version = await asyncio.to_thread(copy_readmodel, db_path, copy)
            newest = await self.sealed(version)
            if newest and newest[0][1].seq >= seq:
                return None
            digest, size = await asyncio.to_thread(pack, copy, packed)
            last, created = await self.identity()
            if seq > last:
                raise SnapshotError(f"read model at {seq} is past the stream's end {last}")
            manifest = Manifest(
                seq=seq, schema=version, stream=self.stream, stream_created=created,
                anchor=await self.anchor(seq), sha256=digest, size=size,
                written_at=datetime.now(UTC).isoformat(), writer=writer,
            )  # fmt: skip
            await self._put(manifest, packed)
        finally:
            copy.unlink(missing_ok=True)
            packed.unlink(missing_ok=True)
        await self.prune(manifest.schema)
        log.info("snapshot_written", seq=manifest.seq, bytes=manifest.size, writer=writer)
        return manifest

    async def _put(self, manifest: Manifest, packed: Path) -> None:
        name = object_name(manifest)
        sealed = self.keyring.seal(msgspec.json.encode(manifest), self.context(name))
        meta = api.ObjectMeta(
            name=name,
            headers={HEADER: base64.b64encode(sealed).decode()},
            options=api.ObjectMetaOptions(max_chunk_size=CHUNK),
        )
        store = await self.store()
        with packed.open("rb") as f:
            await store.put(name, f, meta=meta)

    async def prune(self, version: int | None = None) -> int:
        """Delete all but the newest `keep` snapshots of `version`; how many went."""
        gone = 0
        store = await self.store()
        for info, _ in (await self.sealed(version))[self.keep :]:
            with contextlib.suppress(nats.js.errors.NotFoundError):  # another pruner's
                await store.delete(info.name)
                gone += 1
        return gone

    # ------------------------------------------------------------ restoring

    async def restore(self, db_path: Path) -> int | None:
        """Put the newest usable snapshot at `db_path` if it is worth it; its sequence,
        or None (the read model left as it was: the projector replays)."""
        if await asyncio.to_thread(discard_unsynced, db_path):
            log.warning("snapshot_discarded", db=str(db_path), reason="restored, never synced")
        local = await asyncio.to_thread(local_seq, db_path)
        try:
            last, created = await self.identity()
            candidates = await self.listed()
        except _NATS_ERRORS as e:
            log.warning("snapshot_restore_skipped", reason=f"NATS: {e!r}", fallback="replay")
            return None
        for info in candidates:
            try:
                manifest = self.manifest(info)
                self._check(manifest, last, created)
                if local is not None and manifest.seq <= local + RESTORE_GAIN:
                    log.info("snapshot_not_needed", local_seq=local, snapshot_seq=manifest.seq)
                    return None
                if await self.anchor(manifest.seq) != manifest.anchor:
                    raise SnapshotError(f"the event at {manifest.seq} is not the snapshot's")
                took = await self._fetch(info, manifest, db_path)
            except Exception as e:  # noqa: BLE001 - whatever is wrong, the next or the replay
                log.warning("snapshot_unusable", object=info.name, reason=str(e) or repr(e))
                continue
            log.info(
                "snapshot_restored", object=info.name, seq=manifest.seq, stream_last=last,
                bytes=manifest.size, stored=info.size, **took,
            )  # fmt: skip
            return manifest.seq
        log.info("snapshot_none_usable", tried=len(candidates), local_seq=local, fallback="replay")
        return None

    async def _settle(self, db_path: Path) -> None:
        try:
            await asyncio.to_thread(settle, db_path)
        except OSError as e:  # the marker stays: the next start restores again
            log.warning("snapshot_sync_failed", db=str(db_path), error=repr(e))

    def _check(self, m: Manifest, last: int, created: str) -> None:
        if m.schema != schema.VERSION:
            raise SnapshotError(f"schema version {m.schema}, this replica's is {schema.VERSION}")
        if m.seq > last:
            raise SnapshotError(f"sequence {m.seq} is beyond the stream's last {last} (reset?)")
        if m.stream != self.stream or m.stream_created != created:
            raise SnapshotError(f"of another stream ({m.stream} created {m.stream_created})")

    async def _fetch(self, info: api.ObjectInfo, m: Manifest, db_path: Path) -> dict[str, float]:
        """Download, inflate, check and swap in; SnapshotError if anything is off. The
        seconds each took."""
        clock = time.perf_counter
        took: dict[str, float] = {}
        t = clock()
        fd, name = tempfile.mkstemp(dir=db_path.parent, prefix=f".{db_path.name}.", suffix=".rst")
        os.close(fd)
        scratch = Path(name)
        packed = scratch.with_suffix(".rst.z")
        try:
            # Bounded by the sealed size, not the object's own (anyone with NATS access
            # may store a sealed header again in front of gigabytes): the download stops
            # there, and its patience is the bound's.
            most = stored_bound(m.size)
            with packed.open("wb") as f:
                sink = HashingSink(f, most)
                patience = STALL_S + min(info.size or 0, most) / MIN_RATE
                store = await self.store()
                await asyncio.wait_for(store.get(info.name, writeinto=sink), patience)  # type: ignore[arg-type]  # nats-py calls only .write
            digest = sink.h.hexdigest()
            if digest != m.sha256:
                raise SnapshotError(f"the stored file's sha256 {digest} is not the manifest's")
            took["download_s"], t = round(clock() - t, 3), clock()
            await asyncio.to_thread(unpack, packed, scratch, m.size)
            await asyncio.to_thread(check_file, scratch, m.seq)
            took["inflate_s"], t = round(clock() - t, 3), clock()
            await asyncio.to_thread(put_in_place, scratch, db_path)
            took["swap_s"] = round(clock() - t, 3)
            # On disk in the background: the marker guards the file until then.
            self._settling = asyncio.create_task(self._settle(db_path))
            return took
        except FileError as e:
            raise SnapshotError(f"not a snapshot file: {e}") from e
        finally:
            scratch.unlink(missing_ok=True)
            packed.unlink(missing_ok=True)


# ---------------------------------------------------------------- files (worker threads)


def copy_readmodel(db_path: Path, copy: Path) -> tuple[int, int]:
    """A consistent copy of the read model (VACUUM INTO reads in one transaction), its
    board's tables emptied; the copy's checkpoint sequence and schema version."""
    src = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        src.execute("PRAGMA busy_timeout = 5000")
        src.execute("VACUUM INTO ?", (str(copy),))
    finally:
        src.close()
    with _connection(copy) as dst:
        seq = int(dst.execute("SELECT seq FROM checkpoint WHERE id = 1").fetchone()[0])
        version = int(dst.execute("PRAGMA user_version").fetchone()[0])
        dst.execute("BEGIN")
        for table in schema.BOARD_TABLES:
            dst.execute(f"DELETE FROM {table.name}")
        dst.execute(f"INSERT INTO {schema.BOARD_TABLES[0].name} (id, seq) VALUES (1, 0)")
        dst.execute("COMMIT")
    return seq, version


def local_seq(db_path: Path) -> int | None:
    """The checkpoint of the read model at `db_path` if it is of this schema version;
    None when there is none, another version, or it cannot be read."""
    if not db_path.exists():
        return None
    try:
        with _connection(db_path, readonly=True) as db:
            if int(db.execute("PRAGMA user_version").fetchone()[0]) != schema.VERSION:
                return None
            row = db.execute("SELECT seq FROM checkpoint WHERE id = 1").fetchone()
            return int(row[0]) if row else None
    except sqlite3.Error:
        return None


def check_file(path: Path, seq: int) -> None:
    """The restored file opens as a read model of this version at `seq`."""
    try:
        with _connection(path) as db:
            version = int(db.execute("PRAGMA user_version").fetchone()[0])
            row = db.execute("SELECT seq FROM checkpoint WHERE id = 1").fetchone()
    except sqlite3.Error as e:
        raise SnapshotError(f"the file is not a readable read model: {e}") from e
    if version != schema.VERSION or not row or int(row[0]) != seq:
        raise SnapshotError(f"the file is version {version} at {row}, not {seq}")


@contextlib.contextmanager
def _connection(path: Path, *, readonly: bool = False) -> Iterator[sqlite3.Connection]:
    uri = f"file:{path}?mode=ro" if readonly else f"file:{path}"
    db = sqlite3.connect(uri, uri=True, isolation_level=None)
    try:
        yield db
    finally:
        db.close()
