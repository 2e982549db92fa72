"""The read model's connection, shared by every query of a process, and the lock that
keeps each caller's read transaction its own.

It is a connection of its own, apart from the projector's writer: in WAL mode it reads
the last committed batch while the next one is being written, and it never sees a batch
half-applied. Answers that need two tables read both in one `snapshot`.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import aiosqlite


class Reader:
    """A read-only connection to one read-model database, its queries serialized."""

    def __init__(self, db: aiosqlite.Connection) -> None:
        self.db = db
        self._lock = asyncio.Lock()  # one snapshot at a time, no query inside another's
        self._holder: asyncio.Task[Any] | None = None  # the task whose snapshot is open

    @classmethod
    async def open(cls, path: Path) -> Self:
        """A read-only connection to a database the projector created."""
        db = await aiosqlite.connect(path, isolation_level=None)
        db.row_factory = aiosqlite.Row
        await db.execute("PRAGMA query_only = ON")
        await db.execute("PRAGMA busy_timeout = 5000")
        return cls(db)

    async def close(self) -> None:
        await self.db.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # A query runs to its last row in one call on the connection's thread, cancelled or
    # not: a cursor left part-read (its caller cancelled between execute and fetch) would
    # hold its read snapshot, and the connection's next query would read that old state.

    async def rows(self, sql: str, params: Sequence[Any] = ()) -> list[aiosqlite.Row]:
        if self._holding():  # a query of the snapshot this task holds
            return list(await self.db.execute_fetchall(sql, params))
        async with self._lock:  # never inside another caller's snapshot: it may be older
            return list(await self.db.execute_fetchall(sql, params))

    async def row(self, sql: str, params: Sequence[Any] = ()) -> aiosqlite.Row | None:
        rows = await self.rows(sql, params)
        return rows[0] if rows else None

    def _holding(self) -> bool:
        return self._holder is not None and self._holder is asyncio.current_task()

    @asynccontextmanager
    async def snapshot(self) -> AsyncIterator[None]:
        """One read transaction; serialized, since the connection is shared by callers:
        a query of another caller waits for its end (within it, it would read the
        snapshot's older state, whatever RP-Min-Seq it waited for).

        A cancelled await does not withdraw its statement: aiosqlite runs what it has
        queued, in order. So BEGIN is queued inside the `try`, and its COMMIT always
        queued after it, even when the caller was cancelled waiting for the BEGIN (a
        BEGIN left open would pin every later read of the connection to an old snapshot,
        and refuse the next BEGIN)."""
        if self._holding():  # already within this task's snapshot
            yield
            return
        async with self._lock:
            self._holder = asyncio.current_task()
            try:
                await self.db.execute("BEGIN")
                yield
            finally:
                self._holder = None
                try:
                    await self.db.execute("COMMIT")
                except sqlite3.OperationalError:
                    if self.db.in_transaction:
                        await self.db.execute("ROLLBACK")
                        raise
                    # the BEGIN itself failed: its error is the one to see
