"""The live projector: follows RP_EVENTS into the SQLite read model.

One per api replica (each replica owns its read model) and standalone for tools. It resumes
after the checkpoint stored in the database, applies what arrives in batches (one
transaction each), and lets callers wait until a given stream sequence is readable, which
is how the api answers a read only from a projection at or past the caller's last write.
Beside it, on the same writer, `board` folds the heartbeat board (RP_HEARTBEATS) into the
runs' liveness (projections/board.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from types import TracebackType
from typing import Self

import aiosqlite
import structlog
from nats.aio.client import Client as NATS

from infra.streams import EVENTS, HEARTBEATS
from infra.tasks import cancel_and_wait
from projections import schema
from projections.batch import apply_batch
from projections.board import BoardFold
from projections.ordered import Delivered, OrderedReader
from projections.readmodel import ReadModel
from projections.snapshots import Snapshots

log = structlog.get_logger(__name__)


class Projector:
    """Keep the read model at `db_path` up to date while the context lasts.

    `seq` is the last stream sequence committed; `taken` the last handed to a batch
    (committed or not yet); `read` queries the same database; `skipped` counts messages
    recorded as skipped (undecodable or unprojectable); `received` counts messages taken
    from the stream by this instance, redeliveries included. `board` folds `board_stream`
    (None: no board fold, the liveness tables stay as they are). `start_target` is the
    stream's last sequence as its leader had it when this projector started (None until
    asked; moved with a rebuild): a read model at or past it has caught up with what
    existed at the start (the api's /readyz). `failed_at`: the loop time of the last
    failure that restarted the consumption (None: none yet). `snapshots`: where a read
    model may be restored from before the start (projections/snapshots.py; None: never);
    `restored` the sequence of the snapshot restored (None: none).
    """

    def __init__(
        self,
        nc: NATS,
        db_path: Path,
        *,
        stream: str = EVENTS,
        batch_size: int = 500,
        idle_heartbeat: float = 1.0,
        board_stream: str | None = HEARTBEATS,
        snapshots: Snapshots | None = None,
    ) -> None:
        self.nc = nc
        self.db_path = Path(db_path)
        self.stream = stream
        self.batch_size = batch_size
        self.idle_heartbeat = idle_heartbeat
        self.board_stream = board_stream
        self.seq = 0
        self.taken = 0
        self.skipped = 0
        self.received = 0
        self.board: BoardFold | None = None
        self.start_target: int | None = None
        self.failed_at: float | None = None
        self.snapshots = snapshots
        self.restored: int | None = None
        self._reader: OrderedReader | None = None
        self._writing = asyncio.Lock()  # one transaction at a time on the shared writer
        self._db: aiosqlite.Connection | None = None
        self._read: ReadModel | None = None
        self._task: asyncio.Task[None] | None = None
        self._advanced = asyncio.Condition()
        # Set once the checkpoint was checked against the stream: until then `seq` may be
        # from a stream that no longer exists, and must not answer `wait_for`.
        self._verified = asyncio.Event()

    @property
    def read(self) -> ReadModel:
        if self._read is None:
            raise RuntimeError("the projector is not running")
        return self._read

    async def __aenter__(self) -> Self:
        try:
            if self.snapshots is not None:
                self.restored = await self.snapshots.restore(self.db_path)
            self._db = await schema.connect(self.db_path)
            self.seq = await schema.checkpoint(self._db)
            async with self._db.execute("SELECT count(*) FROM skipped") as cur:
                row = await cur.fetchone()
            self.skipped = int(row[0]) if row else 0
            self._read = await ReadModel.open(self.db_path)
            if self.board_stream is not None:
                self.board = BoardFold(
                    self.nc,
                    self._db,
                    self._writing,
                    stream=self.board_stream,
                    idle_heartbeat=self.idle_heartbeat,
                )
                await self.board.start()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        self._task = asyncio.create_task(self._run(), name="projector")
        log.info("projector_started", db=str(self.db_path), seq=self.seq)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await cancel_and_wait(self._task)
        if self.board is not None:
            await self.board.stop()
            self.board = None
        if self._read:
            await self._read.close()
            self._read = None
        if self._db:
            await self._db.close()
            self._db = None
        log.info("projector_stopped", seq=self.seq)

    async def wait_for(self, seq: int, timeout: float = 5.0) -> bool:
        """True as soon as everything up to `seq` is committed; False after `timeout`."""
        if self._verified.is_set() and self.seq >= seq:
            return True
        try:
            async with asyncio.timeout(timeout):
                await self._verified.wait()
                async with self._advanced:
                    await self._advanced.wait_for(lambda: self.seq >= seq)
        except TimeoutError:
            return self._verified.is_set() and self.seq >= seq
        return True

    @property
    def running(self) -> bool:
        """Whether the consuming loop is alive (started and neither ended nor cancelled)."""
        return self._task is not None and not self._task.done()

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """Nothing is committed while this is held: what arrives waits in the reader
        (bounded by the server's flow control). For a consistent copy of the read model's
        file, or a test's replica held behind the stream."""
        async with self._writing:
            yield

    @property
    def received_seq(self) -> int:
        """The last stream sequence that reached this projector: committed, in the batch
        being applied, or buffered by its reader."""
        reader = self._reader
        return max(self.taken, reader.received_last if reader is not None else 0)

    async def caught_up(self, timeout: float) -> bool:
        """Wait until what has already reached this projector is committed (no question
        to NATS: only what reached this process)."""
        return await self.wait_for(self.received_seq, timeout)

    async def settle(self, timeout: float, *, events: bool = True) -> bool:
        """Wait until the read model holds what reached this process: the board writes
        and purges made through its connection (`BoardFold.settle`) and, with `events`,
        the events this projector has received. No question to NATS; False if that took
        longer than `timeout` (the read goes on as it is)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout
        done = await self.caught_up(timeout) if events else True
        if self.board is None:
            return done
        return await self.board.settle(max(0.0, until - loop.time())) and done

    # ------------------------------------------------------------ the loop

    async def _run(self) -> None:
        """Consume forever; on any failure, start over from the committed checkpoint."""
        delay = 0.1
        while True:
            try:
                await self._rewind_if_ahead()
                async with OrderedReader(
                    self.nc,
                    self.stream,
                    start_seq=self.seq + 1,
                    idle_heartbeat=self.idle_heartbeat,
                ) as reader:
                    delay = 0.1
                    self._reader = reader
                    while True:
                        await self._apply(await reader.next_batch(self.batch_size))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure restarts from the checkpoint
                self._reader = None
                self.failed_at = asyncio.get_running_loop().time()
                log.warning("projector_restarting", seq=self.seq, error=repr(e), delay=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _apply(self, batch: list[Delivered]) -> None:
        assert self._db is not None
        self.received += len(batch)
        if batch:
            self.taken = max(self.taken, batch[-1].seq)
        async with self._writing:
            applied = await apply_batch(self._db, batch, after=self.seq)
        if applied.last_seq <= self.seq:
            return
        self.skipped += applied.skipped
        log.debug("projected", seq=applied.last_seq, events=applied.events, skipped=applied.skipped)
        async with self._advanced:
            self.seq = applied.last_seq
            self._advanced.notify_all()

    async def _rewind_if_ahead(self) -> None:
        """A checkpoint past the stream's end means the stream was recreated: rebuild."""
        assert self._db is not None
        info = await self.nc.jetstream().stream_info(self.stream)
        last = info.state.last_seq
        if self.seq > last:
            log.error("projection_ahead_of_stream", seq=self.seq, stream_last_seq=last)
            async with self._writing:
                await schema.reset(self._db)
            self.seq, self.taken, self.skipped = 0, 0, 0
            self.start_target = last  # a rebuild: caught up once the new stream is read
        if self.start_target is None:
            self.start_target = last
        self._verified.set()
