"""A run's log: all of it at once, or followed live until the run ends.

A finished step's log is read from its object in `rp-logs` (complete, and kept after the
live lines aged out); a running step's from RP_LOGS. Following runs two ordered readers
into one loop: the run's events (`rp.run.<org>.<ws>.<run>`, from its first) and its live
lines (`rp.log.<run>.>`, from the oldest RP_LOGS still holds). Each step's lines go out in
order and once, after the step's `step` (running) event and before its end: a
`StepCursor` holds back lines past a gap or ahead of the step's start, and when the
step's `run.step_finished` arrives the rest comes from the stored object. Steps follow
each other in the order of the run's events. Once the run is terminal, steps that never
finished are completed from RP_LOGS, and `end` is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import msgspec
from nats.aio.client import Client as NATS

from events import run as run_agg
from events.codec import AnyEvent, decode, run_subject
from events.run import RunEvent, RunState, StepFinished, StepStarted
from projections.ordered import Delivered, OrderedReader
from projections.readmodel import ReadModel
from services.infra.steplogs import LogLine, log_subject, parse_live, read_live, read_object
from services.infra.streams import EVENTS, LOGS

Key = tuple[str, str]  # (phase, step)
Out = tuple[str, Any]  # (server-sent event name, its data)
Send = Callable[[list[Out]], Awaitable[None]]

# Lines held per step while following (past a gap, or ahead of the step's start event);
# beyond, they are skipped live and come from the stored log when the step ends.
HOLD_LIMIT = 2_000
_BATCH = 500


@dataclass(frozen=True, kw_only=True)
class Target:
    """Whose log, and which part of it (`phase` / `step` None: all)."""

    org: str
    ws: str
    run_id: str
    phase: str | None = None
    step: str | None = None

    def wants(self, key: Key) -> bool:
        return self.phase in (None, key[0]) and self.step in (None, key[1])

    @property
    def live_subject(self) -> str:
        return log_subject(self.run_id, self.phase or "*", self.step or "*")


class StepCursor:
    """How far one step's output has gone out: the next line owed, and the lines that
    wait (past a gap, or for the step's start to be announced)."""

    def __init__(self) -> None:
        self.next = 1
        self.started = False
        self.done = False
        self.held: dict[int, LogLine] = {}

    def offer(self, line: LogLine) -> list[LogLine]:
        """The lines that can go out now that `line` arrived (none if it is early or old)."""
        if self.done or line.line < self.next:
            return []
        if len(self.held) < HOLD_LIMIT:
            self.held[line.line] = line
        return self._release()

    def start(self) -> list[LogLine]:
        """The step's start was announced: the lines that waited for it."""
        self.started = True
        return self._release()

    def complete(self, lines: Iterable[LogLine]) -> list[LogLine]:
        """The step ended and `lines` is all there is: what is still owed, in order, once
        (past a gap too: nothing will fill it now)."""
        out = self.start()
        owed = self.held | {line.line: line for line in lines if line.line >= self.next}
        out += [owed[n] for n in sorted(owed)]
        self.next = max(owed, default=self.next - 1) + 1
        self.held.clear()
        self.done = True
        return out

    def _release(self) -> list[LogLine]:
        out: list[LogLine] = []
        while self.started and (held := self.held.pop(self.next, None)) is not None:
            out.append(held)
            self.next += 1
        return out


# ---------------------------------------------------------------- all at once


async def snapshot(nc: NATS, read: ReadModel, target: Target, *, ended: bool) -> list[LogLine]:
    """Every line of the run's steps, step after step in start order.

    While the run goes on, RP_LOGS is read once for all its steps (it also has the steps
    the read model has not seen start yet); once it `ended`, only for a step whose log
    was not stored.
    """
    live: dict[Key, list[LogLine]] = {}
    for line in [] if ended else await read_live(nc, target.live_subject):
        live.setdefault((line.phase, line.step), []).append(line)
    out: list[LogLine] = []
    for step in await read.run_steps(target.org, target.run_id):
        key = (step["phase"], step["step"])
        if not target.wants(key):
            continue
        stored = None
        if step["status"] != "running" and step["log_object"]:
            stored = await _stored(nc, key, step["log_object"])
        if stored is None:
            lines = (
                await read_live(nc, log_subject(target.run_id, *key))
                if ended
                else live.get(key, [])
            )
            stored = StepCursor().complete(lines)
        out += stored
        live.pop(key, None)
    for lines in live.values():
        out += StepCursor().complete(lines)
    return out


async def _stored(nc: NATS, key: Key, name: str) -> list[LogLine] | None:
    records = await read_object(nc, name)
    if records is None:
        return None
    return [LogLine(key[0], key[1], r.stream, r.line, r.text) for r in records]


# ---------------------------------------------------------------- followed


class Follower:
    """Sends a run's log as it grows (through `send`) until the run is terminal."""

    def __init__(self, nc: NATS, target: Target, send: Send, *, keepalive: float = 15.0) -> None:
        self.nc = nc
        self.target = target
        self.send = send
        self.keepalive = keepalive
        self.state: RunState = run_agg.INITIAL
        self.cursors: dict[Key, StepCursor] = {}
        self.ended = False

    async def run(self) -> None:
        """Follow until `end` has been sent; an empty batch sent is a keep-alive."""
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue(maxsize=4)
        t = self.target
        async with AsyncExitStack() as stack:
            runs = OrderedReader(self.nc, EVENTS, filter_subject=run_subject(t.org, t.ws, t.run_id))
            lines = OrderedReader(self.nc, LOGS, filter_subject=t.live_subject)
            feeders = [
                asyncio.create_task(_feed(await stack.enter_async_context(r), kind, queue))
                for r, kind in ((runs, "run"), (lines, "log"))
            ]
            stack.push_async_callback(_cancel, feeders)
            while not self.ended:
                batch = await self._next(queue)
                if batch is None or batch:  # None: silent for a while, keep the line alive
                    await self.send(batch or [])

    async def _next(self, queue: asyncio.Queue[tuple[str, Any]]) -> list[Out] | None:
        try:
            async with asyncio.timeout(self.keepalive):
                kind, batch = await queue.get()
        except TimeoutError:
            return None
        if kind == "error":
            raise batch
        return await (self._on_events(batch) if kind == "run" else self._on_lines(batch))

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

    async def _on_lines(self, batch: list[Delivered]) -> list[Out]:
        """Lines of started steps go out in order; others wait for their `step` event."""
        out: list[Out] = []
        for d in batch:
            line = parse_live(d.subject, d.headers, d.data)
            if line is not None:
                cursor = self._cursor((line.phase, line.step))
                out += [("line", sent) for sent in cursor.offer(line)]
        return out

    # ------------------------------------------------------------ the run's events

    async def _on_events(self, batch: list[Delivered]) -> list[Out]:
        out: list[Out] = []
        for d in batch:
            event = _decode(d.data)
            if self.ended or not isinstance(event, RunEvent):
                continue
            phase = self.state.phase
            self.state = run_agg.evolve(self.state, event)
            if isinstance(event, StepStarted) and self.target.wants((phase, event.step)):
                out += self._announce((phase, event.step))
            elif isinstance(event, StepFinished) and self.target.wants((phase, event.step)):
                out += await self._step_finished(phase, event)
            if self.state.terminal:
                out += await self._end()
        return out

    async def _step_finished(self, phase: str, event: StepFinished) -> list[Out]:
        key = (phase, event.step)
        out = self._announce(key)
        stored = await _stored(self.nc, key, event.log_object) if event.log_object else None
        if stored is None:  # never stored: what the live stream still has is all there is
            stored = await read_live(self.nc, log_subject(self.target.run_id, *key))
        out += [("line", line) for line in self._cursor(key).complete(stored)]
        info = {"status": "ok" if event.ok else "failed", "error": event.error or None}
        out.append(("step", {"phase": phase, "step": event.step, **info, "metrics": event.metrics}))
        return out

    async def _end(self) -> list[Out]:
        """The run is over: finish the steps it left running, then `end`."""
        out: list[Out] = []
        s = self.state
        error = f"run {s.status}" + (f": {s.reason}" if s.reason else "")
        for key, cursor in list(self.cursors.items()):
            if cursor.done:
                continue
            out += self._announce(key)
            remaining = await read_live(self.nc, log_subject(self.target.run_id, *key))
            out += [("line", line) for line in cursor.complete(remaining)]
            out.append(
                ("step", {"phase": key[0], "step": key[1], "status": "failed", "error": error})
            )
        out.append(("end", {"status": str(s.status), "reason": s.reason or None}))
        self.ended = True
        return out


def _decode(data: bytes) -> AnyEvent | None:
    try:
        return decode(data)
    except msgspec.DecodeError:  # the projection records it as skipped; a log skips it too
        return None


async def _feed(reader: OrderedReader, kind: str, queue: asyncio.Queue[tuple[str, Any]]) -> None:
    try:
        while True:
            await queue.put((kind, await reader.next_batch(_BATCH)))
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - handed to the loop, which ends the follow with it
        await queue.put(("error", e))


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.gather(*tasks, return_exceptions=True)


_encoder = msgspec.json.Encoder()


def encode_sse(batch: list[Out]) -> bytes:
    """Server-sent events; an empty batch is a comment that keeps the connection alive."""
    if not batch:
        return b": keep-alive\n\n"
    return b"".join(
        b"event: " + name.encode() + b"\ndata: " + _encoder.encode(data) + b"\n\n"
        for name, data in batch
    )
