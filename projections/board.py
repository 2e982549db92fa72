"""The heartbeat board folded into the read model: `run_liveness`, one row per entry.

RP_HEARTBEATS (infra/heartbeats.py) keeps the last message of each `rp.hb.<run>.<phase>`
subject: the phases someone should watch and each run's deadline marker. `BoardFold`
follows it with an ordered consumer from the checkpoint stored in `board_checkpoint` and
writes each batch in one transaction: the rows and the stream sequence it consumed, so a
redelivery is harmless and a rebuild (checkpoint 0: the stream read from its start, which
holds the last message of each subject) folds the same rows. A GET of a run then reads its
owner and deadline with its row (projections/liveness.py), and never asks NATS.

Beats are frequent (every few seconds per phase): a batch keeps each subject's newest
message, and a row is replaced only by a message of a higher sequence, so an old beat
(redelivered, or folded after a newer one) never overwrites a newer.

A purge is no message, so it reaches the fold another way:
- a purge made through this process's connection at once (`Board.purge` tells its
  watchers), applied before the next batch's rows;
- any other (a scheduler or reaper elsewhere, a message aged out) by a listing of the
  stream's subjects every `reconcile_s`, as the reaper's `Follower` does: rows folded
  before the listing whose subject it lacks are deleted.
So the rows converge on the stream's content, which is what a rebuild folds.

Each replica folds at its own pace: what it shows is as of its own position. Within a
process, `settle` gives read-your-writes: it waits (bounded) until the board writes and
purges made through this connection are folded, as a direct read of the board saw them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import aiosqlite
import structlog
from nats.aio.client import Client as NATS

from infra.heartbeats import (
    RECONCILE_S,
    Board,
    beat_of,
    stored_time,
    subject,
    subjects,
    unwatch,
    watch,
)
from infra.streams import HEARTBEATS
from infra.tasks import cancel_and_wait
from projections import schema
from projections.liveness import project_beat
from projections.ordered import Delivered, OrderedReader

log = structlog.get_logger(__name__)

_COLS = schema.LIVENESS.names
# A row is replaced only by a newer message of its subject.
UPSERT = (
    f"INSERT INTO run_liveness ({', '.join(_COLS)}) VALUES ({', '.join('?' * len(_COLS))}) "
    "ON CONFLICT (run_id, phase) DO UPDATE SET "
    + ", ".join(f"{c} = excluded.{c}" for c in _COLS[2:])
    + " WHERE excluded.seq > run_liveness.seq"
)
_SEQ = _COLS.index("seq")
_DELETE = "DELETE FROM run_liveness WHERE run_id = ? AND phase = ? AND seq <= ?"
_EVERYTHING = 2**63 - 1  # a purge of a whole subject: every sequence
Purge = tuple[str, int | None]  # (subject, purged through this sequence; None: all)


async def apply_board(
    db: aiosqlite.Connection, msgs: Sequence[Delivered], purges: Sequence[Purge], *, after: int
) -> int:
    """Apply purges heard of, then fold every board message above sequence `after`, and
    move the checkpoint: one transaction. Returns the sequence folded through.

    A batch that changes no row (the reapers' clock messages: several a second) commits
    nothing: the checkpoint moves with the next row written, and folding those messages
    again after a restart changes nothing."""
    rows: dict[tuple[str, str], tuple[Any, ...]] = {}  # each entry's newest message
    last = after
    for m in msgs:
        if m.seq <= after:
            continue
        last = max(last, m.seq)
        beat = beat_of(m.subject, m.seq, stored_time(m.time_ns), m.data)
        if beat is None:  # the clock, or a subject that is no entry
            continue
        if (key := (beat.run_id, beat.phase)) not in rows or rows[key][_SEQ] < beat.seq:
            rows[key] = project_beat(beat)
    deletes = []
    for subj, through in purges:
        if (purged := entry_of(subj)) is None:
            continue
        deletes.append((*purged, _EVERYTHING if through is None else through))
        if through is not None and purged in rows and rows[purged][_SEQ] <= through:
            del rows[purged]  # purged before it was folded
    if not rows and not deletes:
        return last
    try:  # BEGIN inside: cancelled while queued, it runs anyway, and so must the ROLLBACK
        await db.execute("BEGIN IMMEDIATE")
        await db.executemany(_DELETE, deletes)
        await db.executemany(UPSERT, list(rows.values()))
        await db.execute("UPDATE board_checkpoint SET seq = ? WHERE id = 1", (last,))
        await db.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(Exception):  # the connection itself may be what failed
            await db.execute("ROLLBACK")
        raise
    return last


def entry_of(subj: str) -> tuple[str, str] | None:
    """(run, phase) of a board entry's subject `rp.hb.<run>.<phase>`; None otherwise."""
    parts = subj.split(".")
    if len(parts) != 4 or parts[:2] != ["rp", "hb"] or parts[2].startswith("_"):
        return None
    return parts[2], parts[3]


async def reconcile(db: aiosqlite.Connection, listed: set[str], *, before: int) -> int:
    """Delete the rows folded at or below sequence `before` whose subject the stream no
    longer holds (`listed`, asked for after `before` was folded). Returns how many."""
    async with db.execute(
        "SELECT run_id, phase, seq FROM run_liveness WHERE seq <= ?", (before,)
    ) as cur:
        gone = [(r, p, s) for r, p, s in await cur.fetchall() if subject(r, p) not in listed]
    if not gone:
        return 0
    try:
        await db.execute("BEGIN IMMEDIATE")
        await db.executemany(_DELETE, gone)
        await db.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(Exception):
            await db.execute("ROLLBACK")
        raise
    return len(gone)


class BoardFold:
    """Keep `run_liveness` folded from the board while started.

    `db` is the read model's writer, shared with the events' projector: `lock` keeps
    their transactions apart. `seq` is the board's last sequence folded (committed with
    the last rows written: what came after them changed no row).
    """

    def __init__(
        self,
        nc: NATS,
        db: aiosqlite.Connection,
        lock: asyncio.Lock,
        *,
        stream: str = HEARTBEATS,
        batch_size: int = 500,
        idle_heartbeat: float = 1.0,
        reconcile_s: float = RECONCILE_S,
    ) -> None:
        self.nc = nc
        self.db = db
        self.lock = lock
        self.stream = stream
        self.batch_size = batch_size
        self.idle_heartbeat = idle_heartbeat
        self.reconcile_s = reconcile_s
        self.seq = 0
        self._writes: dict[str, int] = {}  # subject: sequence written here, not folded yet
        self._known = 0  # the highest sequence written here or delivered
        self._purges: list[Purge] = []  # heard of, not applied yet
        self._heard = 0  # purges heard of
        self._applied = 0  # of which applied
        self._advanced = asyncio.Condition()
        self._poke = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self.seq = await schema.checkpoint(self.db, schema.BOARD_CHECKPOINT)
        watch(self.nc, self)
        self._tasks = [
            asyncio.create_task(self._consume(), name="board-fold"),
            asyncio.create_task(self._maintain(), name="board-fold-purges"),
        ]

    async def stop(self) -> None:
        unwatch(self.nc, self)
        for task in self._tasks:
            await cancel_and_wait(task)
        self._tasks = []

    # ------------------------------------------------------------ heard of in this process

    def wrote(self, subj: str, seq: int) -> None:
        """A board write through this connection: `settle` waits until it is folded."""
        self._known = max(self._known, seq)
        if seq > self.seq and entry_of(subj) is not None:
            self._writes[subj] = max(seq, self._writes.get(subj, 0))

    def forget(self, subj: str, through: int | None) -> None:
        """A purge through this connection: applied with the next batch, or at once when a
        read settles. A purge of the whole subject covers what this process has seen of
        it so far (a beat on its way to the fold when the purge was made must not bring
        the entry back)."""
        if through is None:
            through = self._known
        self._purges.append((subj, through))
        self._heard += 1
        written = self._writes.get(subj)
        if written is not None and written <= through:
            del self._writes[subj]  # it may never be delivered now

    async def settle(self, timeout: float) -> bool:
        """Wait until the board writes and purges made through this connection so far are
        folded; False if that took longer than `timeout` (then the read goes on as of
        the fold's position, and those writes are not waited for again)."""
        target = dict(self._writes)
        heard = self._heard

        def folded(subj: str, seq: int) -> bool:  # or purged, or written again since
            return self.seq >= seq or self._writes.get(subj) != seq

        def done() -> bool:
            return self._applied >= heard and all(folded(s, v) for s, v in target.items())

        if done():
            return True
        if self._purges:
            self._poke.set()  # the purges now, rather than with the next batch
        try:
            async with asyncio.timeout(timeout), self._advanced:
                await self._advanced.wait_for(done)
        except TimeoutError:
            for s, v in target.items():  # e.g. purged elsewhere before it was delivered
                if self._writes.get(s) == v:
                    del self._writes[s]
            log.info("board_fold_lagging", seq=self.seq, waited_s=timeout)
            return False
        return True

    # ------------------------------------------------------------ the loops

    async def _consume(self) -> None:
        """Fold forever; on any failure, start over after the last sequence folded."""
        delay = 0.1
        while True:
            try:
                await self._rewind_if_ahead()
                async with OrderedReader(
                    self.nc, self.stream, start_seq=self.seq + 1, idle_heartbeat=self.idle_heartbeat
                ) as reader:
                    delay = 0.1
                    while True:
                        batch = await reader.next_batch(self.batch_size)
                        self._known = max(self._known, batch[-1].seq)
                        await self._apply(batch)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure restarts from the checkpoint
                log.warning("board_fold_restarting", seq=self.seq, error=repr(e), delay=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _maintain(self) -> None:
        """Apply the purges heard of when a read waits for them (none may come with a
        message soon); list the stream's subjects every `reconcile_s` for those made
        elsewhere."""
        loop = asyncio.get_running_loop()
        listed_at = loop.time() - self.reconcile_s  # the first listing at once
        while True:
            left = listed_at + self.reconcile_s - loop.time()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poke.wait(), max(left, 0))
            self._poke.clear()
            try:
                if self._purges:
                    await self._apply([])
                if loop.time() - listed_at >= self.reconcile_s:
                    listed_at = loop.time()
                    await self._reconcile()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - tried again at the next round
                log.warning("board_fold_maintenance_failed", error=repr(e))

    async def _apply(self, msgs: Sequence[Delivered]) -> None:
        async with self.lock:
            purges, self._purges = self._purges, []
            try:
                last = await apply_board(self.db, msgs, purges, after=self.seq)
            except BaseException:
                self._purges[:0] = purges  # applied with the next one
                raise
        async with self._advanced:
            self.seq = last
            self._applied += len(purges)
            self._writes = {s: v for s, v in self._writes.items() if v > last}
            self._advanced.notify_all()

    async def _reconcile(self) -> None:
        before = self.seq
        listed = await subjects(Board(self.nc, stream=self.stream))
        async with self.lock:
            gone = await reconcile(self.db, listed, before=before)
        if gone:
            log.info("board_fold_reconciled", deleted=gone, seq=before)

    async def _rewind_if_ahead(self) -> None:
        """A checkpoint past the stream's end means the stream was recreated: fold anew."""
        info = await self.nc.jetstream().stream_info(self.stream)
        if self.seq > info.state.last_seq:
            log.error("board_fold_ahead_of_stream", seq=self.seq, last_seq=info.state.last_seq)
            async with self.lock:
                await schema.reset(self.db, schema.BOARD_TABLES)
            async with self._advanced:
                self.seq = 0
                self._advanced.notify_all()
