"""Rebuild a read model from sequence 1, then swap it in atomically.

The rebuild goes into a scratch file next to the target (same filesystem, so the final
`os.replace` is atomic) with no journal and no fsync until the end: if anything fails the
scratch file is deleted and the old database is untouched. Stop the projector that uses
the target first; a database still open elsewhere is refused, not replaced.

The batches are folded on the event loop while a thread writes the previous ones
(`projections/fill.py`), instead of `apply_batch`'s read, fold, write, commit per batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import tempfile
import time
from pathlib import Path

import structlog
from nats.aio.client import Client as NATS

from infra.streams import EVENTS
from projections import schema
from projections.fill import Writer, create_indexes, fill, replay_runtime
from projections.ordered import OrderedReader

log = structlog.get_logger(__name__)


class ReplayError(RuntimeError):
    """The rebuilt read model could not be put in place."""

    retryable = False


async def replay(
    nc: NATS,
    db_path: Path,
    *,
    stream: str = EVENTS,
    batch_size: int = 1000,
    idle_timeout: float = 30.0,
    until: int | None = None,
) -> int:
    """Rebuild `db_path` from the whole stream; return the number of events applied.

    Everything up to the stream's last sequence at the start is included (and whatever
    arrives with the last batch); the projector that opens the result resumes from there.
    With `until` (at most the last sequence: projections/asof.py `resolve`), every event
    up to it and none after: the read model as it was once the stream held `until`.
    """
    db_path = Path(db_path)
    target = (await nc.jetstream().stream_info(stream)).state.last_seq
    if until is not None:
        target = min(target, until)
    fd, name = tempfile.mkstemp(dir=db_path.parent, prefix=f".{db_path.name}.", suffix=".replay")
    os.close(fd)
    scratch = Path(name)
    started = time.perf_counter()
    try:
        db = await schema.connect(scratch, fast_unsafe=True)
        await db.close()
        cut = target if until is not None else None
        applied = await _fill(nc, scratch, stream, target, batch_size, idle_timeout, cut)
        await asyncio.to_thread(_swap, scratch, db_path)
    except BaseException:
        scratch.unlink(missing_ok=True)
        raise
    elapsed = time.perf_counter() - started
    log.info("replayed", db=str(db_path), events=applied, seq=target, seconds=round(elapsed, 3))
    return applied


async def _fill(
    nc: NATS,
    scratch: Path,
    stream: str,
    target: int,
    batch_size: int,
    idle_timeout: float,
    cut: int | None,
) -> int:
    """Apply batches until the target sequence is in (each batch one transaction), then
    build the indexes; return the number of events applied."""
    writer = Writer(scratch)
    try:
        await writer.open()
        applied = 0
        if target > 0:
            with replay_runtime():
                async with OrderedReader(nc, stream, start_seq=1) as reader:
                    applied = await fill(
                        reader,
                        writer,
                        target,
                        batch_size=batch_size,
                        idle_timeout=idle_timeout,
                        cut=cut,
                    )
        await writer.call(create_indexes)
    finally:
        await writer.close()
    return applied


def _swap(scratch: Path, target: Path) -> None:
    """Make the scratch file durable, then rename it over the target."""
    with open(scratch, "rb+") as f:
        os.fsync(f.fileno())
    if target.exists():
        _retire(target)
    os.replace(scratch, target)
    for suffix in ("-wal", "-shm"):  # leftovers of the old file must not pair with the new
        Path(f"{target}{suffix}").unlink(missing_ok=True)
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _retire(target: Path) -> None:
    """Fold the old database's WAL into it, which needs it to be closed everywhere else.

    Leaving the WAL would be worse than useless: SQLite would apply the old log's pages to
    the new file. Switching out of WAL mode checkpoints and deletes it, and fails if any
    other connection still has the database open.
    """
    try:
        conn = sqlite3.connect(target, timeout=1.0)
    except sqlite3.Error:
        return
    try:
        mode = conn.execute("PRAGMA journal_mode = DELETE").fetchone()
        if mode and str(mode[0]).lower() == "wal":
            raise ReplayError(f"{target} is open elsewhere; stop its projector first")
    except sqlite3.DatabaseError as e:
        if "locked" in str(e) or "busy" in str(e):
            raise ReplayError(f"{target} is open elsewhere; stop its projector first") from e
        # Not a database at all (or corrupt): it is being replaced anyway.
    finally:
        with contextlib.suppress(sqlite3.Error):
            conn.close()
