"""Driving the read-model snapshot tests (projections/snapshots.py): a history of several
organizations with runs in every status, the full replay to compare with, and a snapshot
object rewritten the way an attacker or a broken disk would. Holds no tests itself."""

from __future__ import annotations

import base64
import hashlib
import sqlite3
from collections.abc import Callable
from pathlib import Path

import msgspec
from nats.aio.client import Client as NATS
from nats.js import api

from events.run import Workspace
from infra.crypto import KeyRing
from projections import replay
from projections.readmodel import ReadModel
from projections.snapshot_file import pack, unpack
from projections.snapshots import HEADER, Manifest, Snapshots
from services.app.commands import App
from tests.projection_support import varied_history

Dump = dict[str, list[tuple[object, ...]]]
# A tenant's own text, as hostile as it likes: it stays data in every table.
HOSTILE = "'); DROP TABLE runs; -- \x00 \u202e snapshot"


async def several_orgs(app: App) -> dict[str, str]:
    """`varied_history`'s organization (every status) and two more, one of them writing
    hostile text into what it owns; run ids by status."""
    runs = await varied_history(app)
    for org in ("beta", "gamma"):
        await app.create_org(org, "admin")
        await app.issue_token(org, "carol", "admin", "admin")
        config = Workspace(repository="/repo", variables={"note": HOSTILE})
        await app.create_workspace(org, "web", config, "carol")
        await app.create_run(org, "web", "apply", "carol", message=HOSTILE)
        await app.admit_next(org, "web")
    return runs


async def after_the_snapshot(app: App) -> None:
    """Events written after a snapshot was taken, in two organizations."""
    await app.create_run("acme", "net", "plan", "alice", message="after")
    await app.create_run("beta", "web", "plan", "carol", message="after")
    await app.create_workspace("gamma", "db", Workspace(repository="/repo"), "carol")


async def full_replay(nc: NATS, path: Path) -> Dump:
    """The read model rebuilt from sequence 1, every table's rows."""
    await replay(nc, path)
    async with await ReadModel.open(path) as read:
        return await read.dump()


async def stored(snapshots: Snapshots, name: str, into: Path) -> tuple[Manifest, Path]:
    """A snapshot's manifest (opened with the right key) and its file, inflated."""
    store = await snapshots.store()
    info = await store.get_info(name)
    packed = into.with_suffix(".z")
    with packed.open("wb") as f:
        await store.get(name, writeinto=f)
    manifest = snapshots.manifest(info)
    unpack(packed, into, manifest.size)
    return manifest, into


async def put_raw(
    snapshots: Snapshots, name: str, body: bytes, manifest: Manifest, keyring: KeyRing
) -> None:
    """Store `body` (in the stored form, or not) as snapshot `name` with `manifest`
    sealed by `keyring` (the deployment's, or an attacker's own)."""
    sealed = keyring.seal(msgspec.json.encode(manifest), snapshots.context(name))
    meta = api.ObjectMeta(name=name, headers={HEADER: base64.b64encode(sealed).decode()})
    store = await snapshots.store()
    await store.put(name, body, meta=meta)


def edited(path: Path, change: Callable[[sqlite3.Connection], object]) -> tuple[bytes, int]:
    """The SQLite file at `path` after `change`, in a snapshot's stored form; its size."""
    db = sqlite3.connect(path, isolation_level=None)
    try:
        change(db)
    finally:
        db.close()
    packed = path.with_suffix(".packed")
    _, size = pack(path, packed)
    return packed.read_bytes(), size


def signed_for(manifest: Manifest, body: bytes, size: int, **changes: object) -> Manifest:
    """`manifest` made to fit `body` (its sha256 and plain size), as its writer would."""
    digest = hashlib.sha256(body).hexdigest()
    return msgspec.structs.replace(manifest, sha256=digest, size=size, **changes)
