"""One live subscription per run, shared by every follower of it in this process.

Following used to create two ordered consumers per reader (the run's events and its
live lines), each with a heartbeat a second and a 5 s creation timeout: 300 followers
of one run meant 600 consumers on the API's one connection, created at once; creations
timed out, readers reset and reset again, and most followers never got their `end`.

Here a `Tail` is the one ordered reader of a subject in the process, kept while someone
follows it: it keeps the last `KEEP` messages it read in a window shared by all, and
wakes its followers when more arrive. A follower reads what came before the window (its
history, or what it missed while slow) itself, by batched direct gets, then from the
window; a slow follower so never makes the tail hold more, it falls behind and catches
up from the stream. What a follower holds is one batch.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import weakref
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS

from infra.steplogs import LogError, direct_batch
from infra.tasks import cancel_and_wait
from projections.ordered import Delivered, OrderedReader

KEEP = 2_000  # messages a tail keeps for its followers
CHUNK_GATE = 32  # object chunks in flight from this process (128 KiB each)
_BATCH = 500


class Tail:
    """The latest messages of one subject of one stream, read once for all followers."""

    def __init__(self, nc: NATS, stream: str, subject: str) -> None:
        self.nc = nc
        self.stream = stream
        self.subject = subject
        self.window: deque[Delivered] = deque()
        self.base = 0  # the window holds every message of the subject after this sequence
        self.error: Exception | None = None
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Read on from the stream's end: everything before is each follower's history."""
        try:
            info = await self.nc.jetstream().stream_info(self.stream)
        except Exception as e:
            raise LogError(f"{self.stream}: {e!r}") from e
        self.base = info.state.last_seq
        reader = OrderedReader(
            self.nc, self.stream, start_seq=self.base + 1, filter_subject=self.subject
        )
        await reader.__aenter__()
        self._task = asyncio.create_task(self._read(reader), name=f"tail-{self.subject}")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    def waiter(self) -> asyncio.Event:
        """Set when the tail has news (messages or an error); take it before looking."""
        return self._changed

    def after(self, seq: int) -> list[Delivered] | None:
        """The window's messages after `seq` (at most a batch); None if `seq` is before
        the window: that follower reads the stream itself up to it."""
        if self.error is not None:
            raise self.error
        if seq < self.base:
            return None
        at = bisect.bisect_right(self.window, seq, key=lambda d: d.seq)
        return [self.window[i] for i in range(at, min(len(self.window), at + _BATCH))]

    async def _read(self, reader: OrderedReader) -> None:
        try:
            while True:
                batch = await reader.next_batch(_BATCH)
                self.window.extend(batch)
                while len(self.window) > KEEP:
                    self.base = self.window.popleft().seq
                self._notify()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - told to every follower, which ends with it
            self.error = LogError(f"following {self.subject}: {e!r}")
            self._notify()
        finally:
            await reader.__aexit__(None, None, None)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


@dataclass
class _Shared:
    tail: Tail
    users: int = 0


@dataclass
class Hub:
    """The tails of one connection, and the gate on object reads, shared by its readers."""

    nc: NATS
    gate: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(CHUNK_GATE))
    _tails: dict[tuple[str, str], _Shared] = field(default_factory=dict)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @contextlib.asynccontextmanager
    async def tail(self, stream: str, subject: str) -> AsyncIterator[Tail]:
        """The subject's tail, started by its first follower and stopped with its last."""
        key = (stream, subject)
        async with self._lock:
            shared = self._tails.get(key)
            if shared is None or shared.tail.error is not None:
                tail = Tail(self.nc, stream, subject)
                await tail.start()
                shared = self._tails[key] = _Shared(tail)
            shared.users += 1
        try:
            yield shared.tail
        finally:
            shared.users -= 1
            if shared.users == 0 and self._tails.get(key) is shared:
                del self._tails[key]
                await shared.tail.stop()


_hubs: weakref.WeakKeyDictionary[NATS, Hub] = weakref.WeakKeyDictionary()


def hub(nc: NATS) -> Hub:
    """The connection's hub, made on first use (one per API process and connection)."""
    if nc not in _hubs:
        _hubs[nc] = Hub(nc)
    return _hubs[nc]


class Cursor:
    """Where one follower is in one tailed subject; hands out what comes next."""

    def __init__(self, tail: Tail) -> None:
        self.tail = tail
        self.seq = 0

    async def next(self) -> list[Delivered]:
        """The next messages (none when caught up): from the window, or the stream."""
        batch = self.tail.after(self.seq)
        if batch is not None:
            self.seq = batch[-1].seq if batch else self.seq
            return batch
        t = self.tail
        base = t.base  # every message up to here is in the stream before the read below
        page, more = await direct_batch(t.nc, t.stream, t.subject, self.seq + 1)
        self.seq = max(page[-1].seq if page else self.seq, 0 if more else base)
        return [Delivered(m.seq, m.subject, m.data, 0, m.headers) for m in page]
