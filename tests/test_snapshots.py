"""Read-model snapshots (projections/snapshots.py) on a real nats-server: a new replica
restores the newest snapshot and tails from its sequence, and its read model is then the
full replay's, table for table; a snapshot that is corrupt, of another schema, of another
or reset stream, or forged without the deployment's key is refused with its reason, and
the replica replays instead. Writers keep the newest few; two at once corrupt nothing.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import struct
import tracemalloc
import zlib
from pathlib import Path

import pytest
import structlog
from nats.aio.client import Client as NATS
from nats.js import api

from infra import streams
from infra.crypto import KeyRing
from infra.eventstore import EventStore
from projections import schema, snapshot_file
from projections import snapshots as snapshots_module
from projections.readmodel import ReadModel
from projections.snapshot_file import unsynced
from projections.snapshots import Manifest, Snapshots, object_name, prefix, seq_of
from services.app.commands import App
from services.root.bootstrap import Plane
from tests.helpers import eventually
from tests.projection_support import settle
from tests.snapshot_support import (
    HOSTILE,
    after_the_snapshot,
    edited,
    full_replay,
    put_raw,
    several_orgs,
    signed_for,
    stored,
)


async def _snapshot(system: Plane, tmp_path: Path) -> Manifest:
    """A replica's read model of `several_orgs`, written as a snapshot."""
    async with system.projector(tmp_path / "writer.db") as writer:
        await several_orgs(system.app)
        await settle(writer, system.store)
        written = await system.snapshot_writer(writer).write_once(force=True)
    assert written is not None and written.seq == await system.store.last_seq()
    return written


async def _fresh_replica(system: Plane, store: EventStore, path: Path) -> tuple[int | None, int]:
    """A replica with no read model started and caught up: what it restored (None: it
    replayed) and how many events it took from the stream."""
    async with system.projector(path) as replica:
        await settle(replica, store)
        return replica.restored, replica.received


async def _falls_back(system: Plane, nc: NATS, tmp_path: Path, reason: str) -> None:
    """A fresh replica restores nothing, says `reason`, replays the whole stream, and
    its read model is the full replay's."""
    with structlog.testing.capture_logs() as logs:
        restored, received = await _fresh_replica(system, system.store, tmp_path / "new.db")
    assert restored is None
    said = [e["reason"] for e in logs if e["event"] == "snapshot_unusable"]
    assert said and reason in said[0], said
    assert received == await system.store.last_seq()  # from sequence 1
    assert await _dump(tmp_path / "new.db") == await full_replay(nc, tmp_path / "full.db")


async def _dump(path: Path) -> dict[str, list[tuple[object, ...]]]:
    async with await ReadModel.open(path) as read:
        return await read.dump()


async def test_a_restored_replica_answers_as_a_full_replay(
    system: Plane, nc: NATS, store: EventStore, tmp_path: Path
) -> None:
    """Several organizations, runs in every status, a tenant's hostile text, and events
    after the snapshot: the restored replica took only those from the stream, and every
    table equals the full replay's."""
    written = await _snapshot(system, tmp_path)
    await after_the_snapshot(system.app)
    last = await store.last_seq()
    restored, received = await _fresh_replica(system, store, tmp_path / "new.db")
    assert restored == written.seq
    assert received == last - written.seq  # it tailed from S+1, no replay
    rows = await _dump(tmp_path / "new.db")
    assert rows == await full_replay(nc, tmp_path / "full.db")
    statuses = {r[rows_index("status")] for r in rows["runs"]}
    assert {"applied", "awaiting_approval", "pending", "queued", "failed"} <= statuses
    assert any(HOSTILE in r for r in rows["runs"])


def rows_index(column: str) -> int:
    return schema.BY_NAME["runs"].names.index(column)


async def test_the_api_replica_restores_through_the_root_and_is_ready_once_caught_up(
    system: Plane, store: EventStore, tmp_path: Path
) -> None:
    """The root's projector restores; its /readyz target is the stream's end at its start,
    so a restored replica is not ready before it has tailed past the snapshot."""
    written = await _snapshot(system, tmp_path)
    await after_the_snapshot(system.app)
    last = await store.last_seq()
    async with system.projector(tmp_path / "new.db") as replica:
        async with replica.hold():  # nothing committed past the snapshot yet
            assert replica.restored == written.seq
            assert replica.seq == written.seq
            assert not await replica.wait_for(last, timeout=0.5)
        await settle(replica, store)
        assert replica.start_target == last and replica.seq == last


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("flipped", "sha256"),  # a row of the file changed, stored again under its manifest
        ("truncated", "sha256"),  # the object cut short
        ("garbage", "not a snapshot file"),  # a key holder's writer stored junk, hashed
    ],
)
async def test_a_corrupt_snapshot_falls_back_to_replay(
    system: Plane, nc: NATS, tmp_path: Path, damage: str, reason: str
) -> None:
    written = await _snapshot(system, tmp_path)
    snapshots = system.snapshots()
    name = object_name(written)
    manifest, path = await stored(snapshots, name, tmp_path / "copy.db")
    if damage == "flipped":
        body, _ = edited(path, lambda db: db.execute("UPDATE runs SET message = 'x'"))
    elif damage == "truncated":
        body = ((await (await snapshots.store()).get(name)).data or b"")[:-100]
    else:
        body = b"\x00\x00\x00\x10junk" * 1000
        manifest = signed_for(manifest, body, manifest.size)
    await put_raw(snapshots, name, body, manifest, system.keyring)
    await _falls_back(system, nc, tmp_path, reason)


async def test_a_snapshot_of_another_schema_version_is_not_used(
    system: Plane, nc: NATS, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An older runplane's snapshot: one filed under this version's name but of another
    is refused; after an upgrade (a newer schema) none of the older ones is even listed."""
    written = await _snapshot(system, tmp_path)
    snapshots = system.snapshots()
    manifest, path = await stored(snapshots, object_name(written), tmp_path / "copy.db")
    body, size = edited(path, lambda db: db.execute(f"PRAGMA user_version = {schema.VERSION - 1}"))
    older = signed_for(manifest, body, size, schema=schema.VERSION - 1, seq=manifest.seq - 1)
    await (await snapshots.store()).delete(object_name(written))
    await put_raw(snapshots, f"{prefix()}{older.seq:016d}-old", body, older, system.keyring)
    await _falls_back(system, nc, tmp_path, "schema version")

    monkeypatch.setattr(schema, "VERSION", schema.VERSION + 1)
    with structlog.testing.capture_logs() as logs:
        restored, _ = await _fresh_replica(system, system.store, tmp_path / "upgraded.db")
    assert restored is None
    assert [e["tried"] for e in logs if e["event"] == "snapshot_none_usable"] == [0]


async def test_a_snapshot_beyond_a_reset_stream_falls_back_to_replay(
    system: Plane, nc: NATS, tmp_path: Path
) -> None:
    """The stream was deleted and made again, shorter than the snapshot's sequence."""
    await _snapshot(system, tmp_path)
    await nc.jetstream().delete_stream(streams.EVENTS)
    await streams.declare(nc, nc.jetstream())
    await system.app.create_org("fresh", "admin")
    await _falls_back(system, nc, tmp_path, "beyond the stream")


async def test_a_snapshot_of_another_stream_is_not_used_even_within_its_length(
    system: Plane, nc: NATS, tmp_path: Path
) -> None:
    """A stream made again and filled past the snapshot's sequence is another stream
    (its creation time): the old snapshot's rows are not this history's."""
    written = await _snapshot(system, tmp_path)
    await nc.jetstream().delete_stream(streams.EVENTS)
    await streams.declare(nc, nc.jetstream())
    await system.app.create_org("other", "admin")
    for i in range(written.seq):
        await system.app.issue_token("other", f"u{i}", "viewer", "admin")
    await _falls_back(system, nc, tmp_path, "another stream")


async def test_attack_a_snapshot_forged_without_the_deployments_key_is_refused(
    system: Plane, nc: NATS, tmp_path: Path
) -> None:
    """Someone who can write the bucket (NATS access, not the encryption key) plants a
    read model in which their token is an admin of another organization, with every
    check a plain manifest could carry right: sha256, size, sequence, stream, the event
    at S. Sealed with their own key, it does not open: the replica replays, and the
    planted token is nowhere in its read model. (A manifest checked by its hash alone
    takes it: the restored file is the forgery.)"""
    written = await _snapshot(system, tmp_path)
    snapshots = system.snapshots()
    manifest, path = await stored(snapshots, object_name(written), tmp_path / "copy.db")
    planted = "f" * 64

    def plant(db: sqlite3.Connection) -> None:
        cols = schema.BY_NAME["tokens"].names
        values = {c: None for c in cols} | {
            "token_hash": planted, "token_id": "evil", "org": "acme", "user": "mallory",
            "role": "admin",
        }  # fmt: skip
        db.execute(schema.BY_NAME["tokens"].upsert, [values[c] for c in cols])

    body, size = edited(path, plant)
    forged = signed_for(manifest, body, size, writer="mallory")
    await (await snapshots.store()).delete(object_name(written))  # theirs is the only one
    await put_raw(snapshots, object_name(forged), body, forged, KeyRing.generate())
    await _falls_back(system, nc, tmp_path, "key")
    rows = await _dump(tmp_path / "new.db")
    assert all(planted not in r for r in rows["tokens"])


async def test_writers_keep_the_newest_few_and_two_at_once_corrupt_nothing(
    system: Plane, store: EventStore, app: App, tmp_path: Path
) -> None:
    """Two replicas writing at the same sequence at once make whole objects (their names
    differ), each restorable; one writing later at a sequence already stored writes
    nothing; as the history grows, only the newest `keep` remain; the newest restores."""
    keep = 2
    snapshots = Snapshots(system.nc, system.keyring, keep=keep)
    async with system.projector(tmp_path / "a.db") as a, system.projector(tmp_path / "b.db") as b:
        await several_orgs(app)
        await settle(a, store)
        await settle(b, store)
        both = await asyncio.gather(
            snapshots.write(a.db_path, "wa"), snapshots.write(b.db_path, "wb")
        )
        assert {m.seq for m in both if m} == {await store.last_seq()}
        for info in await snapshots.listed():
            restored, _ = await _fresh_replica(system, store, tmp_path / f"{info.name[-2:]}.db")
            assert restored == await store.last_seq()
            await (await snapshots.store()).delete(info.name)
        await snapshots.write(a.db_path, "wa")
        assert await snapshots.write(b.db_path, "wb") is None
        for i in range(3):
            await app.create_run("acme", "app", "plan", "alice", message=f"more {i}")
            await settle(a, store)
            assert await snapshots.write(a.db_path, "wa") is not None
    names = [i.name for i in await snapshots.listed()]
    assert len(names) == keep
    assert names[0].endswith(f"{await store.last_seq():016d}-wa")
    restored, received = await _fresh_replica(system, store, tmp_path / "new.db")
    assert restored == await store.last_seq() and received == 0


async def test_the_writer_loop_writes_once_caught_up_and_leaves_a_fresh_one_alone(
    system: Plane, store: EventStore, app: App, tmp_path: Path
) -> None:
    """Entered with an interval, a replica's writer stores a snapshot by itself; another
    replica's writer finds it fresh (written within half its interval) and adds none."""
    async with system.projector(tmp_path / "a.db") as a:
        await several_orgs(app)
        await settle(a, store)
        async with system.snapshot_writer(a, interval=0.3):
            listed = await eventually(system.snapshots().listed, timeout=30, what="a snapshot")
        assert seq_of(listed[0].name) == await store.last_seq()
        await app.create_run("acme", "app", "plan", "alice", message="one more")
        await settle(a, store)
        assert await system.snapshot_writer(a, interval=3600).write_once() is None
        assert len(await system.snapshots().listed()) == 1


async def test_a_restart_keeps_its_read_model_unless_the_restore_never_reached_the_disk(
    system: Plane, store: EventStore, tmp_path: Path
) -> None:
    """Restarted, a replica keeps the read model it has (no restore: it is not far
    behind); one whose restored file was never synced (its marker still there: the
    machine died first) is thrown away and restored again."""
    written = await _snapshot(system, tmp_path)
    db = tmp_path / "new.db"
    assert (await _fresh_replica(system, store, db))[0] == written.seq

    async def synced() -> bool:  # in the background: then its marker goes
        return not unsynced(db).exists()

    await eventually(synced, timeout=30, what="the restored file synced")
    await after_the_snapshot(system.app)
    restored, received = await _fresh_replica(system, store, db)
    assert (restored, received) == (None, await store.last_seq() - written.seq)
    unsynced(db).touch()
    with structlog.testing.capture_logs() as logs:
        restored, received = await _fresh_replica(system, store, db)
    assert "snapshot_discarded" in [e["event"] for e in logs]
    assert (restored, received) == (written.seq, await store.last_seq() - written.seq)


async def test_a_replica_far_behind_the_newest_snapshot_takes_it_over_its_own(
    system: Plane, nc: NATS, store: EventStore, app: App, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A read model more than RESTORE_GAIN events behind the newest snapshot (here 5) is
    replaced by it (its WAL folded and removed first), and tails from there."""
    monkeypatch.setattr(snapshots_module, "RESTORE_GAIN", 5)
    db = tmp_path / "old.db"
    async with system.projector(db) as old:
        await app.create_org("zeta", "admin")
        await settle(old, store)
    written = await _snapshot(system, tmp_path)  # many more events, then the snapshot
    await after_the_snapshot(app)
    restored, received = await _fresh_replica(system, store, db)
    assert (restored, received) == (written.seq, await store.last_seq() - written.seq)
    assert await _dump(db) == await full_replay(nc, tmp_path / "full.db")


async def test_attack_unsealed_objects_with_high_sequences_neither_stop_writers_nor_prune_real_ones(
    system: Plane, store: EventStore, app: App, tmp_path: Path
) -> None:
    """Someone who can write the bucket but has no key puts junk under the prefix, named
    at sequences far past the stream's end (and one at the real snapshot's). A writer
    judged "the newest snapshot already holds as much" and pruned by names alone: it
    never wrote again, and its prune deleted the real snapshots, keeping the junk, so
    every later replica replayed the whole stream. Only objects whose manifest opens
    count: the writer writes, the real snapshots stay, the junk is left as it is."""
    keep = 2
    snapshots = Snapshots(system.nc, system.keyring, keep=keep)
    async with system.projector(tmp_path / "a.db") as a:
        await several_orgs(app)
        await settle(a, store)
        first = await snapshots.write(a.db_path, "wa")
        assert first is not None
        junk = [f"{prefix()}{(10**16 - 1 - i):016d}-mallory" for i in range(keep + 1)]
        for name in junk:
            await (await snapshots.store()).put(name, b"junk")
        await app.create_run("acme", "app", "plan", "alice", message="more")
        await settle(a, store)
        second = await snapshots.write(a.db_path, "wa")
        assert second is not None and second.seq == await store.last_seq()
        names = {i.name for i in await snapshots.listed()}
        assert {object_name(first), object_name(second)} <= names  # not pruned for junk
        # the writer's loop: junk put just now is not "a snapshot written lately"
        for real in (first, second):
            await (await snapshots.store()).delete(object_name(real))
        await (await snapshots.store()).put(junk[0], b"junk again")
        looped = await system.snapshot_writer(a, interval=3600).write_once()
        assert looped is not None and looped.seq == second.seq
    names = {i.name for i in await snapshots.listed()}
    assert object_name(looped) in names
    assert set(junk) <= names  # not ours to judge: a key we lack may open them
    restored, received = await _fresh_replica(system, store, tmp_path / "new.db")
    assert restored == looped.seq and received == 0


async def test_attack_a_sealed_snapshots_object_grown_by_someone_without_the_key_is_cut_short(
    system: Plane, nc: NATS, tmp_path: Path
) -> None:
    """Someone who can write the bucket (no key) stores a real snapshot's object again
    under its name with its sealed header copied, and 24 MiB of junk behind its bytes
    (gigabytes, in earnest). The manifest opens, so the replica downloaded the whole
    object to its data directory (its patience grown with the object's size) and only
    then found the sha256 wrong: a full disk for any replica that starts. The download
    stops past what the manifest's file size can take compressed."""
    written = await _snapshot(system, tmp_path)
    snapshots = system.snapshots()
    store = await snapshots.store()
    name = object_name(written)
    info = await store.get_info(name)
    body = (await store.get(name)).data or b""
    await store.delete(name)
    meta = api.ObjectMeta(name=name, headers=dict(info.headers or {}))
    await store.put(name, body + os.urandom(24 << 20), meta=meta)
    await _falls_back(system, nc, tmp_path, "more than")


def test_attack_a_block_that_inflates_past_its_stated_length_is_refused_unread(
    tmp_path: Path,
) -> None:
    """A block stating 10 plain bytes whose zlib inflates to 256 MiB (a decompression bomb
    only the key's holder could store, but a restore should not take the replica's memory
    for it): refused at 11 bytes, the memory it took a few MiB, not the 256 MiB it hides."""
    bomb = zlib.compress(bytes(256 * 1024 * 1024), 9)
    packed = tmp_path / "bomb.packed"
    packed.write_bytes(struct.pack(">II", len(bomb), 10) + bomb)
    tracemalloc.start()
    try:
        with pytest.raises(snapshot_file.FileError, match="is 11 bytes, not 10"):
            snapshot_file.unpack(packed, tmp_path / "out.sqlite", 10)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 1024 * 1024, peak


@pytest.mark.parametrize("size", [2 * snapshot_file.BLOCK + 8192, 2 * snapshot_file.BLOCK + 1000])
def test_pack_and_unpack_give_back_the_file_byte_for_byte(tmp_path: Path, size: int) -> None:
    """Whole blocks inflate to the disk with O_DIRECT (here on the test's file system, if it
    takes it), a last block that is not a multiple of 4 KiB through the page cache: either
    way the file comes back byte for byte, over an older file of the same name."""
    plain = tmp_path / "plain.sqlite"
    plain.write_bytes(os.urandom(size // 2) + bytes(size - size // 2))
    packed = tmp_path / "plain.packed"
    _, plain_size = snapshot_file.pack(plain, packed)
    assert plain_size == size
    out = tmp_path / "out.sqlite"
    out.write_bytes(b"\xff" * (size + 4096))  # longer and different: must not show through
    snapshot_file.unpack(packed, out, size)
    assert out.read_bytes() == plain.read_bytes()
