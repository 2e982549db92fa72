"""Replay's fill: fold the next batch on the event loop while a thread writes the last one.

The live `apply_batch` reads the rows a batch's folds need from SQLite, folds, writes and
commits before it takes the next batch. A replay into a new file can overlap the two,
because it is the file's only writer:

- `Rows` keeps what folds read back (the `runs`, `steps`, `changes` and `resource_states`
  of recent runs, and `workspaces`) as the batches write them, so a batch is folded
  without reading the file, and each batch's folds get exactly the rows `apply_batch`'s
  prefetch would have read (the same selection: `batch.needed`, `changes.wanted`);
- `Writer` is one thread with its own connection that runs, in submission order, each
  batch's writes (one transaction with the checkpoint, as `apply_batch`) and the reads of
  rows `Rows` no longer holds. A read queued after a batch's writes sees them, so what
  `Rows` does not hold is in the file, or nowhere.

`sqlite3` releases the GIL around each statement it steps and must take it back after: a
writer thread stepping one row at a time (`executemany`) would wait for the busy event loop
once per row. So rows go in multi-row statements (hundreds of rows per step), and the
replay shortens the interpreter's switch interval while it runs (`replay_runtime`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sqlite3
import sys
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache
from itertools import chain
from pathlib import Path
from typing import Any, TypeVar

from events.run import RunCreated
from events.workspace import WorkspaceCreated
from projections import changes, schema
from projections.batch import (
    Item,
    changed,
    decode_item,
    fold,
    needed,
    purge_statements,
    removal_statements,
)
from projections.ordered import Delivered, OrderedReader
from projections.project import finish
from projections.schema import CHANGES, RESOURCE_STATES, RUNS, STEPS, WORKSPACES, Key, Row, Table
from projections.working import Working

T = TypeVar("T")

_RUN_TABLES = (RUNS, STEPS, CHANGES, RESOURCE_STATES)  # the first key column is the run
_RUN_NAMES = tuple(t.name for t in _RUN_TABLES)
_CHUNK = 500  # keys per IN (...) list of a read, well under SQLite's variable limit
_MAX_ROWS = 256  # rows per multi-row statement (x columns: under the variable limit)
_SWITCH_INTERVAL = 0.0002  # seconds; CPython's default is 0.005

Statement = tuple[str, list[Any]]


# ---------------------------------------------------------------- writing


class Writer:
    """One thread, one SQLite connection: jobs run in the order they were submitted."""

    def __init__(self, path: Path) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replay-sqlite")
        self._conn: sqlite3.Connection | None = None
        self._path = path

    async def open(self) -> None:
        await asyncio.wrap_future(self._pool.submit(self._open))

    def _open(self) -> None:
        conn = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
        # A new scratch file, deleted if anything fails (projections/replay.py).
        conn.execute("PRAGMA journal_mode = OFF")
        conn.execute("PRAGMA synchronous = OFF")
        conn.execute("PRAGMA cache_size = -65536")
        conn.execute("PRAGMA locking_mode = EXCLUSIVE")
        self._conn = conn

    def submit(self, fn: Callable[[sqlite3.Connection], T]) -> Future[T]:
        return self._pool.submit(self._run, fn)

    async def call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        return await asyncio.wrap_future(self.submit(fn))

    def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        assert self._conn is not None, "open() first"
        return fn(self._conn)

    async def close(self) -> None:
        """Wait for the jobs submitted, then close the connection."""
        try:
            await asyncio.wrap_future(self._pool.submit(self._close))
        finally:
            self._pool.shutdown(wait=True)

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def statements(w: Working, seq: int) -> list[Statement]:
    """The batch's writes as multi-row statements, in `apply_batch`'s order: a purged
    workspace's deletes first."""
    out: list[Statement] = [
        (sql, list(params)) for org, ws in w.purged for sql, params in purge_statements(org, ws)
    ]
    out += [(sql, list(params)) for sql, params in removal_statements(w.removed)]
    for table, deletes, upserts in changed(w):
        for chunk in _chunks(deletes):
            out.append((_delete_sql(table, len(chunk)), list(chain.from_iterable(chunk))))
        for chunk in _chunks(upserts):
            out.append((_upsert_sql(table, len(chunk)), list(chain.from_iterable(chunk))))
    out.append(("UPDATE checkpoint SET seq = ? WHERE id = 1", [seq]))
    return out


def _chunks(rows: list[Any]) -> Iterator[list[Any]]:
    """Full chunks of _MAX_ROWS, then the rest in powers of two: few distinct statement
    texts, so SQLite's statement cache keeps them compiled."""
    i, n = 0, len(rows)
    size = _MAX_ROWS
    while i < n:
        while size > n - i:
            size //= 2
        yield rows[i : i + size]
        i += size


@cache
def _upsert_sql(table: Table, rows: int) -> str:
    one = f"({', '.join('?' * len(table.names))})"
    return f"INSERT OR REPLACE INTO {table.name} ({', '.join(table.names)}) VALUES " + ", ".join(
        [one] * rows
    )


@cache
def _delete_sql(table: Table, rows: int) -> str:
    one = f"({', '.join('?' * len(table.pk))})"
    return (
        f"DELETE FROM {table.name} WHERE ({', '.join(table.pk)}) IN (VALUES "
        + ", ".join([one] * rows)
        + ")"
    )


def write(stmts: list[Statement]) -> Callable[[sqlite3.Connection], None]:
    """A job for `Writer`: the statements in one transaction."""

    def run(conn: sqlite3.Connection) -> None:
        conn.execute("BEGIN")
        try:
            for sql, params in stmts:
                conn.execute(sql, params)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    return run


def create_indexes(conn: sqlite3.Connection) -> None:
    for index in schema.INDEXES:
        conn.execute(index)


@contextlib.contextmanager
def replay_runtime() -> Iterator[None]:
    """Shorten the interpreter's switch interval while the writer thread runs (see above),
    and leave what the process held before out of the garbage collector's full passes:
    `Rows` keeps rows alive from batch to batch, which makes those passes frequent, and
    each would walk the whole heap of a process that has other things in it."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(min(before, _SWITCH_INTERVAL))
    freeze = gc.get_freeze_count() == 0  # someone else's freeze is left alone
    if freeze:
        gc.freeze()
    try:
        yield
    finally:
        if freeze:
            gc.unfreeze()
        sys.setswitchinterval(before)


# ---------------------------------------------------------------- reading back


class Rows:
    """The rows folds read, as the file will hold them once the writes queued are done.

    A run is held whole (its rows of the four run tables) or not at all; a workspace is
    its row. What is not held is read from the file, except runs and workspaces no batch
    ever wrote: the file started empty, so they have no rows.
    """

    def __init__(self, writer: Writer, *, max_runs: int = 2_000, max_workspaces: int = 20_000):
        self.writer = writer
        self.max_runs = max_runs
        self.max_workspaces = max_workspaces
        # run id -> table name -> key -> row; least recently used first
        self.runs: dict[str, dict[str, dict[Key, Row]]] = {}
        self.workspaces: dict[Key, Row | None] = {}  # None: no such workspace
        self.written_runs: set[str] = set()
        self.written_ws: set[Key] = set()
        self.reads = 0  # reads from the file, for tests and tuning

    # ------------------------------------------------------------ before the folds

    async def load(self, w: Working, items: list[Item]) -> None:
        """Give `w` the rows `apply_batch`'s prefetch would read from the file."""
        runs = needed(items, "run", RunCreated)
        want = changes.wanted(items)
        workspaces = needed(items, "ws", WorkspaceCreated)
        wanted_runs = {*runs, *want.plans, *want.ends, *(r for r, _ in want.moved)}
        missing = [r for r in wanted_runs if r not in self.runs and r in self.written_runs]
        if missing:
            await self._read_runs(sorted(missing))
        missing_ws = [k for k in workspaces if k not in self.workspaces and k in self.written_ws]
        if missing_ws:
            await self._read_workspaces(missing_ws)
        held = self.runs
        for r in wanted_runs:  # most recently used last
            if r in held:
                held[r] = held.pop(r)
        for r in runs:
            if (agg := held.get(r)) is not None:
                _load_all(w, RUNS.name, agg)
                _load_all(w, STEPS.name, agg)
        for r in want.plans:
            if (agg := held.get(r)) is not None:
                _load_all(w, CHANGES.name, agg)
        for r in want.ends:
            if (agg := held.get(r)) is not None:
                _load_all(w, RESOURCE_STATES.name, agg)
        for r, address in want.moved:
            if (agg := held.get(r)) is not None:
                for key, row in agg[RESOURCE_STATES.name].items():
                    if key[1] == address:
                        w.load(RESOURCE_STATES.name, row)
        cached = self.workspaces
        for k in workspaces:
            if k in cached:
                ws = cached[k] = cached.pop(k)  # most recently used last
                if ws is not None:
                    w.load(WORKSPACES.name, ws)

    async def _read_runs(self, runs: list[str]) -> None:
        queries: list[tuple[str, list[Any]]] = []
        tables: list[Table] = []
        for table in _RUN_TABLES:
            column = "id" if table is RUNS else "run_id"
            for i in range(0, len(runs), _CHUNK):
                chunk = runs[i : i + _CHUNK]
                queries.append(
                    (f"{table.select} WHERE {column} IN ({', '.join('?' * len(chunk))})", chunk)
                )
                tables.append(table)
        self.reads += 1
        answers = await self.writer.call(_reader(queries))
        found: dict[str, dict[str, dict[Key, Row]]] = {r: _empty_run() for r in runs}
        for table, rows in zip(tables, answers, strict=True):
            for values in rows:
                row = dict(zip(table.names, values, strict=True))
                key = table.key(row)
                found[key[0]][table.name][key] = row
        self.runs.update(found)

    async def _read_workspaces(self, keys: list[Key]) -> None:
        queries: list[tuple[str, list[Any]]] = []
        for i in range(0, len(keys), _CHUNK):
            chunk = keys[i : i + _CHUNK]
            values = ", ".join("(?, ?)" for _ in chunk)
            sql = f"{WORKSPACES.select} WHERE (org, name) IN (VALUES {values})"
            queries.append((sql, [x for pair in chunk for x in pair]))
        self.reads += 1
        answers = await self.writer.call(_reader(queries))
        found: dict[Key, Row | None] = dict.fromkeys(keys)
        for rows in answers:
            for v in rows:
                row = dict(zip(WORKSPACES.names, v, strict=True))
                found[WORKSPACES.key(row)] = row
        self.workspaces.update(found)

    # ------------------------------------------------------------ after the folds

    def absorb(self, w: Working) -> None:
        """Take in the batch's writes (just queued for the file), then forget the least
        recently used runs and workspaces beyond the limits."""
        held, written = self.runs, self.written_runs
        for org, ws in w.purged:  # before the batch's rows: a run made after is kept
            for run_id in [r for r, agg in held.items() if _of(agg, org, ws)]:
                del held[run_id]
        for run_id in w.removed:  # its rows are gone from the file: none is held either
            held.pop(run_id, None)
        for name in _RUN_NAMES:
            for key, row in w.dirty.get(name, {}).items():
                run_id = key[0]
                agg = held.get(run_id)
                if agg is None:
                    if run_id in written:
                        continue  # not held: the file has its rows, this one included
                    agg = held[run_id] = _empty_run()  # new: these are all its rows
                    written.add(run_id)
                if row is None:
                    agg[name].pop(key, None)
                else:
                    agg[name][key] = row
        for key, row in w.dirty.get(WORKSPACES.name, {}).items():
            if key in self.workspaces or key not in self.written_ws:
                self.workspaces.pop(key, None)  # most recently used last
                self.workspaces[key] = row
                self.written_ws.add(key)
        while len(held) > self.max_runs:
            del held[next(iter(held))]
        while len(self.workspaces) > self.max_workspaces:
            del self.workspaces[next(iter(self.workspaces))]


def _of(agg: dict[str, dict[Key, Row]], org: str, ws: str) -> bool:
    """Whether a held run is one of workspace `org`/`ws`'s (by its `runs` row)."""
    return any((r["org"], r["workspace"]) == (org, ws) for r in agg[RUNS.name].values())


def _empty_run() -> dict[str, dict[Key, Row]]:
    return {name: {} for name in _RUN_NAMES}


def _load_all(w: Working, table: str, agg: dict[str, dict[Key, Row]]) -> None:
    for row in agg[table].values():
        w.load(table, row)


def _reader(queries: list[Statement]) -> Callable[[sqlite3.Connection], list[list[Any]]]:
    def run(conn: sqlite3.Connection) -> list[list[Any]]:
        return [conn.execute(sql, params).fetchall() for sql, params in queries]

    return run


class Filler:
    """Folds batches in order and queues each one's writes; `drain` waits for them."""

    def __init__(self, writer: Writer, *, in_flight: int = 2, rows: Rows | None = None) -> None:
        self.writer = writer
        self.rows = rows if rows is not None else Rows(writer)
        self.in_flight = in_flight
        self.seq = 0  # the last sequence folded
        self.applied = 0  # events folded (skipped ones not counted)
        self._pending: deque[Future[None]] = deque()

    async def apply(self, batch: Sequence[Delivered]) -> None:
        """Fold what is above the last sequence folded; queue its writes and the checkpoint
        as one transaction; wait only while more than `in_flight` batches are unwritten."""
        items = [decode_item(m) for m in batch if m.seq > self.seq]
        if not items:
            return
        w = Working()
        await self.rows.load(w, items)
        skipped = fold(w, items)
        finish(w)
        self.seq = items[-1].meta.seq
        self._pending.append(self.writer.submit(write(statements(w, self.seq))))
        self.rows.absorb(w)
        self.applied += len(items) - skipped
        pending = self._pending
        while len(pending) > self.in_flight or (pending and pending[0].done()):
            await asyncio.wrap_future(pending.popleft())

    async def drain(self) -> int:
        """Wait until every batch is written; return the number of events folded."""
        while self._pending:
            await asyncio.wrap_future(self._pending.popleft())
        return self.applied

    def abandon(self) -> None:
        for f in self._pending:
            f.cancel()
        self._pending.clear()


async def fill(
    reader: OrderedReader,
    writer: Writer,
    target: int,
    *,
    batch_size: int,
    idle_timeout: float | None,
    in_flight: int = 2,
    rows: Rows | None = None,
    cut: int | None = None,
) -> int:
    """Fold batches until the target sequence is in, in this process; return the number of
    events folded (skipped ones not counted). `cut`: nothing past that sequence is folded
    (a batch is cut there, and the fill ends at the first message past it)."""
    filler = Filler(writer, in_flight=in_flight, rows=rows)
    try:
        while filler.seq < target:
            batch = await reader.next_batch(batch_size, timeout=idle_timeout)
            if cut is not None and batch[-1].seq > cut:
                await filler.apply([m for m in batch if m.seq <= cut])
                break
            await filler.apply(batch)
        return await filler.drain()
    finally:
        filler.abandon()
