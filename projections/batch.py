"""Apply a batch of stream messages to the read model in one SQLite transaction.

The shell around the folds of `projections/project.py`: decode, prefetch the rows the batch
touches, fold, then write the changed rows and the checkpoint together, so the checkpoint
always names exactly the rows that are there. Used by the live `Projector` and by `replay`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import aiosqlite
import msgspec
import structlog

from events.codec import AnyEvent, decode, tag_of
from events.run import RunCreated
from events.workspace import WorkspaceCreated
from projections.changes import prefetch as prefetch_changes
from projections.ordered import Delivered
from projections.project import finish, project_event
from projections.schema import EVENTS, RUNS, STEPS, TABLES, WORKSPACES, Key, Table
from projections.working import PURGED_BY_RUN, Meta, Unprojectable, Working, meta_of

log = structlog.get_logger(__name__)

_CHUNK = 500  # keys per IN (...) list, well under SQLite's variable limit


class Item(NamedTuple):
    meta: Meta
    event: AnyEvent | None  # None: the message did not decode
    raw: bytes
    error: str = ""


class Applied(NamedTuple):
    """What a batch did."""

    last_seq: int  # the checkpoint after the batch
    events: int  # events folded
    skipped: int  # messages recorded in `skipped` instead (undecodable or unprojectable)


async def apply_batch(
    db: aiosqlite.Connection, msgs: Sequence[Delivered], *, after: int
) -> Applied:
    """Fold every message above sequence `after` and move the checkpoint, atomically."""
    items = [decode_item(m) for m in msgs if m.seq > after]
    if not items:
        return Applied(after, 0, 0)
    w = Working()
    try:  # BEGIN inside: cancelled while queued, it runs anyway, and so must the ROLLBACK
        await db.execute("BEGIN IMMEDIATE")
        await _prefetch(db, w, items)
        skipped = fold(w, items)
        finish(w)
        last = items[-1].meta.seq
        await _flush(db, w, last)
        await db.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(Exception):  # the connection itself may be what failed
            await db.execute("ROLLBACK")
        raise
    return Applied(last, len(items) - skipped, skipped)


def decode_item(m: Delivered) -> Item:
    meta = meta_of(m.seq, m.subject, m.time_ns)
    try:
        return Item(meta, decode(m.data), m.data)
    except msgspec.DecodeError as e:  # includes ValidationError (e.g. an unknown tag)
        return Item(meta, None, m.data, f"undecodable: {e}")


# ---------------------------------------------------------------- prefetch


def needed(items: Iterable[Item], kind: str, creator: type) -> list[Any]:
    """Aggregates whose first event in the batch is not their creation: they may exist."""
    first: dict[Any, bool] = {}
    for it in items:
        if it.event is None or it.meta.kind != kind:
            continue
        key = it.meta.run_id if kind == "run" else (it.meta.org, it.meta.workspace)
        first.setdefault(key, isinstance(it.event, creator))
    return sorted(k for k, created in first.items() if not created)


async def _prefetch(db: aiosqlite.Connection, w: Working, items: list[Item]) -> None:
    runs = needed(items, "run", RunCreated)
    await _load(db, w, RUNS, "id", runs)
    await _load(db, w, STEPS, "run_id", runs)
    await prefetch_changes(db, w, items)
    workspaces = needed(items, "ws", WorkspaceCreated)
    for i in range(0, len(workspaces), _CHUNK):
        chunk = workspaces[i : i + _CHUNK]
        values = ", ".join("(?, ?)" for _ in chunk)
        sql = f"{WORKSPACES.select} WHERE (org, name) IN (VALUES {values})"
        await _load_rows(db, w, WORKSPACES, sql, [v for pair in chunk for v in pair])


async def _load(
    db: aiosqlite.Connection, w: Working, table: Table, column: str, keys: list[Any]
) -> None:
    for i in range(0, len(keys), _CHUNK):
        chunk = keys[i : i + _CHUNK]
        sql = f"{table.select} WHERE {column} IN ({', '.join('?' * len(chunk))})"
        await _load_rows(db, w, table, sql, chunk)


async def _load_rows(
    db: aiosqlite.Connection, w: Working, table: Table, sql: str, params: list[Any]
) -> None:
    names = table.names
    async with db.execute(sql, params) as cur:
        for row in await cur.fetchall():
            w.load(table.name, dict(zip(names, row, strict=True)))


# ---------------------------------------------------------------- fold and flush


def fold(w: Working, items: list[Item]) -> int:
    """Fold each item; record what cannot be folded instead of stalling. Returns skips."""
    skipped = 0
    for it in items:
        reason = it.error
        if it.event is not None:
            try:
                project_event(w, it.meta, it.event, it.raw)
                continue
            except Unprojectable as e:
                reason = str(e)
            except Exception as e:  # a fold bug must not stall every reader: record it
                log.exception("projection_bug", seq=it.meta.seq, subject=it.meta.subject)
                reason = f"{type(e).__name__}: {e}"
        skipped += 1
        _skip(w, it, reason)
    return skipped


def _skip(w: Working, it: Item, reason: str) -> None:
    kind = tag_of(it.event) if it.event is not None else None
    log.warning("event_skipped", seq=it.meta.seq, subject=it.meta.subject, reason=reason)
    w.insert(
        "skipped", {"seq": it.meta.seq, "subject": it.meta.subject, "type": kind, "reason": reason}
    )


async def _flush(db: aiosqlite.Connection, w: Working, seq: int) -> None:
    for org, ws in w.purged:
        await _purge(db, org, ws)
    for sql, params in removal_statements(w.removed):
        await db.execute(sql, params)
    for table, deletes, upserts in changed(w):
        if deletes:
            await db.executemany(table.delete, deletes)
        if upserts:
            await db.executemany(table.upsert, upserts)
    await db.execute("UPDATE checkpoint SET seq = ? WHERE id = 1", (seq,))


async def _purge(db: aiosqlite.Connection, org: str, ws: str) -> None:
    for sql, params in purge_statements(org, ws):
        await db.execute(sql, params)


def purge_statements(org: str, ws: str) -> list[tuple[str, tuple[str, str]]]:
    """The deletes of a purged workspace's stored runs (their rows in every run table) and
    state versions, run before the batch's other writes (what the batch held of them
    `Working.purge_runs` dropped already). The live flush and the replay's writer
    (projections/fill.py) both run these."""
    ids = "SELECT id FROM runs WHERE org = ? AND workspace = ?"
    tables = PURGED_BY_RUN[1:]
    out = [(f"DELETE FROM {table} WHERE run_id IN ({ids})", (org, ws)) for table in tables]
    out.append(("DELETE FROM runs WHERE org = ? AND workspace = ?", (org, ws)))
    out.append(("DELETE FROM state_versions WHERE org = ? AND workspace = ?", (org, ws)))
    return out


def removal_statements(run_ids: list[str]) -> list[tuple[str, tuple[str]]]:
    """The deletes of removed runs' stored rows (run.removed), run before the batch's other
    writes as a purge's are (`Working.remove_run` dropped what the batch held)."""
    return [
        (f"DELETE FROM {table} WHERE {'id' if table == 'runs' else 'run_id'} = ?", (run_id,))
        for run_id in run_ids
        for table in PURGED_BY_RUN
    ]


def changed(w: Working) -> list[tuple[Table, list[Key], list[tuple[Any, ...]]]]:
    """Per table, in table order: the keys the batch deleted and the rows it wrote (value
    tuples in column order). Deletes go first: no key is both."""
    out = []
    for table in TABLES:
        dirty = w.dirty.get(table.name)
        audit = w.audit if table is EVENTS else None
        if not dirty and not audit:
            continue
        deletes = [k for k, r in dirty.items() if r is None] if dirty else []
        upserts = [table.values(r) for r in dirty.values() if r is not None] if dirty else []
        if audit:
            upserts += audit
        out.append((table, deletes, upserts))
    return out
