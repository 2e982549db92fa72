"""A run's log read whole or a page at a time, in batches (followed:
services/surfaces/api/follow.py).

A finished step's log is read from its object in `rp-logs` (complete, and kept after the
live lines aged out), a chunk at a time; a running step's from RP_LOGS, a batch of direct
gets at a time. The answer is written as it is read, so what a reader holds on the
server is one batch, whatever the log's size. A page is `offset` and `limit` in lines
of the answer (step after step in start order): lines before a page are read and
skipped, which for a finished run gives every reader the same numbering.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS

from infra.steplogs import (
    READ_DEADLINE_S,
    LogError,
    LogLine,
    StoredLog,
    direct_batch,
    iter_live,
    log_subject,
)
from infra.streams import LOGS
from projections.readmodel import ReadModel
from services.surfaces.api.runfeed import hub

Key = tuple[str, str]  # (phase, step)
Removed = Callable[[], Awaitable[bool]]  # whether retention removed the run's logs
Out = tuple[str, Any]  # (server-sent event name, its data)

# Lines held per step while following (past a gap, or ahead of the step's start event);
# beyond, they are skipped live and come from the stored log when the step ends.
HOLD_LIMIT = 2_000


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
        return self.start() + self.take(sorted(lines, key=lambda line: line.line)) + self.finish()

    def take(self, lines: Iterable[LogLine]) -> list[LogLine]:
        """Part of the step's whole log, in line order: what is owed of it, held lines
        at their place. A whole log is read this way in batches, then `finish`."""
        self.started = True
        out: list[LogLine] = []
        low = min(self.held, default=None)
        for line in lines:
            if line.line < self.next:
                continue
            if low is not None and low <= line.line:  # pops one held line at least
                out += self._held_below(line.line)
                self.held.pop(line.line, None)
                low = min(self.held, default=None)
            out.append(line)
            self.next = line.line + 1
        return out

    def finish(self) -> list[LogLine]:
        """The whole log has been taken: the held lines past its end, and nothing more."""
        out = [self.held[n] for n in sorted(self.held) if n >= self.next]
        self.next = max(self.next, out[-1].line + 1) if out else self.next
        self.held.clear()
        self.done = True
        return out

    def _held_below(self, number: int) -> list[LogLine]:
        out: list[LogLine] = []
        for n in sorted(n for n in self.held if n < number):
            held = self.held.pop(n)
            if n >= self.next:
                out.append(held)
                self.next = n + 1
        return out

    def _release(self) -> list[LogLine]:
        out: list[LogLine] = []
        while self.started and (held := self.held.pop(self.next, None)) is not None:
            out.append(held)
            self.next += 1
        return out


# ---------------------------------------------------------------- all at once


@dataclass(frozen=True)
class Page:
    """Lines `offset` (0: the first of the answer) to `offset + limit - 1`."""

    offset: int = 0
    limit: int | None = None


class Lines:
    """The run's lines, step after step in start order, as batches for a streamed answer.

    A finished step's come from its object (a chunk at a time), a running step's from
    RP_LOGS (a batch of direct gets at a time). `page` skips and stops; `count` is how
    many went out, and `more` whether a line was left after the page's last.
    """

    def __init__(
        self,
        nc: NATS,
        read: ReadModel,
        target: Target,
        *,
        ended: bool,
        deadline: float = READ_DEADLINE_S,
        removed: Removed | None = None,
    ) -> None:
        self.nc = nc
        self.read = read
        self.target = target
        self.ended = ended
        self.count = 0
        self.more = False
        # Retention deletes a run's objects only READ_DEADLINE_S and more after recording
        # it (services/processes/retention.py GRACE_S): a read that began before that
        # record ends (whole) before the deletion, or here, never halfway through a chunk.
        self.deadline = time.monotonic() + deadline
        self.removed = removed

    async def batches(self, page: Page = Page()) -> AsyncIterator[list[LogLine]]:
        skip, room = page.offset, page.limit
        async for batch in self._all():
            if room == 0:  # the page is full: this batch only says there is more
                self.more = self.more or bool(batch)
                if self.more:
                    return
                continue
            if skip >= len(batch):
                skip -= len(batch)
                continue
            batch, skip = batch[skip:], 0
            if room is not None:
                self.more = len(batch) > room
                batch = batch[:room]
                room -= len(batch)
            self.count += len(batch)
            yield batch
            if self.more:
                return

    async def _all(self) -> AsyncIterator[list[LogLine]]:
        t = self.target
        seen: set[Key] = set()
        steps = await self.read.runs.steps(t.org, t.run_id)
        if not steps and self.ended and self.removed is not None and await self.removed():
            # The projection dropped the rows of a run removed whole after its row was
            # read: an empty answer would pass for the whole log.
            raise LogError("retention removed the run's record while it was read")
        for step in steps:
            key = (step["phase"], step["step"])
            seen.add(key)
            if t.wants(key):
                stored = (step["status"] != "running" and step["log_object"]) or ""
                async for batch in step_lines(self.nc, t.run_id, key, stored, removed=self.removed):
                    if time.monotonic() > self.deadline:
                        raise LogError("the read of the log took longer than it may")
                    yield batch
        if self.ended:
            return
        for key in await live_steps(self.nc, t.live_subject):  # not projected as started yet
            if key not in seen and t.wants(key):
                async for batch in step_lines(self.nc, t.run_id, key, ""):
                    yield batch


async def step_lines(
    nc: NATS,
    run_id: str,
    key: Key,
    stored: str,
    *,
    cursor: StepCursor | None = None,
    removed: Removed | None = None,
) -> AsyncIterator[list[LogLine]]:
    """A step's lines: its object's if `stored` names one that exists, else what RP_LOGS
    has; each line once and in order (from `cursor.next` on, if given). A named object
    that is gone because retention removed it (`removed`) is a LogError, never RP_LOGS's
    remains: an empty or partial answer would pass for the whole log."""
    cursor = cursor or StepCursor()
    obj = await StoredLog.open(nc, stored, hub(nc).gate) if stored else None
    if stored and obj is None and removed is not None and await removed():
        raise LogError(f"{stored}: removed by retention")
    if obj is not None:
        async for records in obj.records():
            yield cursor.take([LogLine(*key, r.stream, r.line, r.text) for r in records])
    else:
        async for lines in iter_live(nc, log_subject(run_id, *key)):
            yield cursor.take(lines)
    if rest := cursor.finish():
        yield rest


async def live_steps(nc: NATS, subject: str) -> list[Key]:
    """The steps RP_LOGS holds lines of on `subject`, in the order their first line came."""
    try:
        info = await nc.jetstream().stream_info(LOGS, subjects_filter=subject)
        firsts: list[tuple[int, Key]] = []
        for name in info.state.subjects or {}:
            page, _ = await direct_batch(nc, LOGS, name, 1, batch=1)
            parts = name.split(".")
            if page and len(parts) == 5:
                firsts.append((page[0].seq, (parts[3], parts[4])))
    except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as e:
        raise LogError(f"listing {subject}: {e!r}") from e
    return [key for _, key in sorted(firsts)]


_encoder = msgspec.json.Encoder()


def encode_sse(batch: list[Out]) -> bytes:
    """Server-sent events; an empty batch is a comment that keeps the connection alive."""
    if not batch:
        return b": keep-alive\n\n"
    return b"".join(
        b"event: " + name.encode() + b"\ndata: " + _encoder.encode(data) + b"\n\n"
        for name, data in batch
    )
