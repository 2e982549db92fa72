"""A run's log followed live until the run ends (the `?follow=1` answer's events).

Two sources feed one loop: the run's events (`rp.run.<org>.<ws>.<run>`, from its first)
and its live lines (`rp.log.<run>.<phase>.<step>`, from the oldest RP_LOGS still holds).
Each is read through the process's shared tail of its subject (services/surfaces/api/runfeed.py):
history and catch-up by direct gets, then the tail's window, so a follower costs no
consumer of its own. Each step's lines go out in order and once, after the step's `step`
(running) event and before its end: a `StepCursor` holds back lines past a gap or ahead
of the step's start, and when the step's `run.step_finished` arrives the rest comes from
the stored object, a chunk at a time. Steps follow each other in the order of the run's
events. Once the run is terminal, steps that never finished are completed from RP_LOGS,
and `end` is sent. What a follower holds is a batch, whatever the log's size.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import msgspec
from nats.aio.client import Client as NATS

from events import run as run_agg
from events.codec import AnyEvent, decode, run_subject
from events.run import RunEvent, RunState, StepFinished, StepStarted
from infra.steplogs import parse_live
from infra.streams import EVENTS, LOGS
from projections.ordered import Delivered
from services.surfaces.api.runfeed import Cursor, hub
from services.surfaces.api.runlog import Key, Out, Removed, StepCursor, Target, step_lines

Send = Callable[[list[Out]], Awaitable[None]]
_FLUSH = 500  # events sent in one write, at most


class Follower:
    """Sends a run's log as it grows (through `send`) until the run is terminal."""

    def __init__(
        self,
        nc: NATS,
        target: Target,
        send: Send,
        *,
        keepalive: float = 15.0,
        removed: Removed | None = None,
    ) -> None:
        self.nc = nc
        self.removed = removed  # a stored log found gone: LogError if retention took it
        self.target = target
        self.send = send
        self.keepalive = keepalive
        self.state: RunState = run_agg.INITIAL
        self.cursors: dict[Key, StepCursor] = {}
        self.ended = False
        self._out: list[Out] = []

    async def run(self) -> None:
        """Follow until `end` has been sent; an empty batch sent is a keep-alive."""
        t = self.target
        feeds = hub(self.nc)
        async with (
            feeds.tail(EVENTS, run_subject(t.org, t.ws, t.run_id)) as runs,
            feeds.tail(LOGS, t.live_subject) as lines,
        ):
            sources = ((Cursor(runs), self._on_events), (Cursor(lines), self._on_lines))
            while not self.ended:
                waits = [runs.waiter(), lines.waiter()]  # taken before looking: no lost wake
                moved = False
                for cursor, handle in sources:
                    if not self.ended and (batch := await cursor.next()):
                        moved = True
                        await handle(batch)
                        await self._flush()
                if not moved and not await _woken(waits, self.keepalive):
                    await self.send([])

    async def _emit(self, out: list[Out]) -> None:
        self._out += out
        if len(self._out) >= _FLUSH:
            await self._flush()

    async def _flush(self) -> None:
        out, self._out = self._out, []
        if out:
            await self.send(out)

    def _cursor(self, key: Key) -> StepCursor:
        return self.cursors.setdefault(key, StepCursor())

    def _announce(self, key: Key) -> list[Out]:
        """`step` running, once, then the lines that waited for it."""
        cursor = self._cursor(key)
        if cursor.started:
            return []
        announced: list[Out] = [("step", {"phase": key[0], "step": key[1], "status": "running"})]
        return announced + [("line", line) for line in cursor.start()]

    # ------------------------------------------------------------ live lines

    async def _on_lines(self, batch: list[Delivered]) -> None:
        """Lines of started steps go out in order; others wait for their `step` event."""
        for d in batch:
            line = parse_live(d.subject, d.headers, d.data)
            if line is not None:
                cursor = self._cursor((line.phase, line.step))
                await self._emit([("line", sent) for sent in cursor.offer(line)])

    # ------------------------------------------------------------ the run's events

    async def _on_events(self, batch: list[Delivered]) -> None:
        for d in batch:
            event = _decode(d.data)
            if self.ended or not isinstance(event, RunEvent):
                continue
            phase = self.state.phase
            self.state = run_agg.evolve(self.state, event)
            if isinstance(event, StepStarted) and self.target.wants((phase, event.step)):
                await self._emit(self._announce((phase, event.step)))
            elif isinstance(event, StepFinished) and self.target.wants((phase, event.step)):
                await self._step_finished(phase, event)
            if self.state.terminal:
                await self._end()

    async def _step_finished(self, phase: str, event: StepFinished) -> None:
        key = (phase, event.step)
        await self._emit(self._announce(key))
        await self._rest(key, event.log_object)
        info = {"status": "ok" if event.ok else "failed", "error": event.error or None}
        await self._emit(
            [("step", {"phase": phase, "step": event.step, **info, "metrics": event.metrics})]
        )

    async def _rest(self, key: Key, stored: str) -> None:
        """What is owed of a step that ended: from its object, else from RP_LOGS."""
        cursor = self._cursor(key)
        lines_of = step_lines(
            self.nc, self.target.run_id, key, stored, cursor=cursor, removed=self.removed
        )
        async for lines in lines_of:
            await self._emit([("line", line) for line in lines])

    async def _end(self) -> None:
        """The run is over: finish the steps it left running, then `end`."""
        s = self.state
        error = f"run {s.status}" + (f": {s.reason}" if s.reason else "")
        for key, cursor in list(self.cursors.items()):
            if cursor.done:
                continue
            await self._emit(self._announce(key))
            await self._rest(key, "")
            failed = {"phase": key[0], "step": key[1], "status": "failed", "error": error}
            await self._emit([("step", failed)])
        await self._emit([("end", {"status": str(s.status), "reason": s.reason or None})])
        self.ended = True


async def _woken(events: list[asyncio.Event], timeout: float) -> bool:
    """Wait until one of `events` is set; False if none was within `timeout`."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*waits, return_exceptions=True)
    return bool(done)


def _decode(data: bytes) -> AnyEvent | None:
    try:
        return decode(data)
    except msgspec.DecodeError:  # the projection records it as skipped; a log skips it too
        return None
