"""Live step logs: every line a step's process writes, masked, to RP_LOGS and to its file.

The formats are in `infra/steplogs.py`. A line is handed to a bounded buffer
(no await) and sent by a background task in batches: every line but the last of a batch
as a core publish (the stream captures it), the last with `js.publish`, whose
acknowledgement confirms the whole batch (JetStream stores one connection's messages in
order). A batch that is not confirmed is sent again; readers drop lines they already
have, by number.

Nothing is lost from the live stream while NATS takes lines: a step that prints faster
than it absorbs (measured ~70,000 lines/s) waits for room once the buffer is full,
paced like a slow pipe. While NATS is away nothing waits: lines that do not fit skip the
live stream (counted in the metrics as `live_dropped`), and the file, stored whole when
the step ends, still has them all.

The step's metrics come from the same lines: its duration, the lines per stream, and the
resource counts of Terraform's `change_summary` (plan and apply run with `-json`).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import deque
from itertools import islice
from pathlib import Path

import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS

from events.codec import valid_id
from executor.context import PhaseContext
from executor.output import Masker, readable
from executor.process import StepLog
from infra.quotas import MIB, Quotas
from infra.steplogs import STREAMS, encode_record, live_headers, log_subject

log = structlog.get_logger(__name__)

LIVE_LINE_LIMIT = 32 * 1024  # characters; longer lines are cut in the live stream only
_MAX_LINE_BYTES = 4 * LIVE_LINE_LIMIT  # UTF-8
_NATS_ERRORS = (nats.errors.Error, nats.js.errors.Error, TimeoutError, OSError)
_SUMMARY_KEYS = {"add": "add", "change": "change", "remove": "destroy"}


class LivePublisher:
    """Sends one step's lines to its subject in the background, within a memory bound.

    `offer` never blocks; `room` waits while the buffer is full and NATS takes lines (a
    step that prints faster than the live stream absorbs is slowed, not cut), but not
    while NATS is away: then lines that do not fit are skipped. `close` sends what is
    left, waiting at most `timeout`. `dropped` counts lines that never went live.
    """

    def __init__(
        self,
        nc: NATS,
        subject: str,
        *,
        max_lines: int = 50_000,
        max_bytes: int = 16 * 1024 * 1024,
        batch: int = 500,
        ack_timeout: float = 2.0,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.subject = subject
        self.max_lines = max_lines
        self.max_bytes = max_bytes
        self.batch = batch
        self.ack_timeout = ack_timeout
        self.dropped = 0
        self.sent = 0
        self._buf: deque[tuple[str, int, bytes]] = deque()
        self._bytes = 0
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._closing = False
        self._failing = False
        self._task: asyncio.Task[None] | None = None

    def offer(self, stream: str, line: int, text: str) -> None:
        """Queue a line for the live stream; skip it if the buffer is full."""
        body = text[:LIVE_LINE_LIMIT].encode()
        if len(self._buf) >= self.max_lines or self._bytes + len(body) > self.max_bytes:
            self.dropped += 1
            return
        self._buf.append((stream, line, body))
        self._bytes += len(body)
        self._wake.set()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"live-{self.subject}")

    def has_room(self) -> bool:
        """Below 90% of the bounds: the rest is slack for the two streams' writers."""
        lines, size = len(self._buf) * 10, (self._bytes + _MAX_LINE_BYTES) * 10
        return lines < self.max_lines * 9 and size <= self.max_bytes * 9

    async def room(self) -> None:
        """Wait while the buffer is full, unless NATS is away (then nothing waits)."""
        while not (self.has_room() or self._failing):
            self._room.clear()
            await self._room.wait()

    async def close(self, timeout: float = 2.0) -> None:
        """Send what is buffered, for at most `timeout` seconds; then stop."""
        self._closing = True
        self._wake.set()
        task = self._task
        if task is None:
            return
        try:
            await asyncio.wait({task}, timeout=timeout)
        finally:
            if not task.done():
                task.cancel()
            elif not task.cancelled() and task.exception() is not None:
                log.error("live_log_failed", subject=self.subject, exc_info=task.exception())
            if self._buf:
                self.dropped += len(self._buf)
                log.warning("live_log_incomplete", subject=self.subject, unsent=len(self._buf))

    async def _run(self) -> None:
        delay = 0.1
        while self._buf or not self._closing:
            if not self._buf:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = list(islice(self._buf, self.batch))
            if not await self._send(batch):
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            delay = 0.1
            for _, _, body in batch:
                self._buf.popleft()
                self._bytes -= len(body)
            self.sent += len(batch)
            self._room.set()

    async def _send(self, batch: list[tuple[str, int, bytes]]) -> bool:
        """Publish a batch; True once its last line is acknowledged by the stream."""
        try:
            for stream, line, body in batch[:-1]:
                await self.nc.publish(self.subject, body, headers=live_headers(stream, line))
            stream, line, body = batch[-1]
            await self.js.publish(
                self.subject, body, timeout=self.ack_timeout, headers=live_headers(stream, line)
            )
        except _NATS_ERRORS as e:
            if not self._failing:  # one line per outage, not one per retry
                log.warning("live_log_unavailable", subject=self.subject, error=repr(e))
            self._failing = True
            self._room.set()  # a waiting step goes on; its lines skip the live stream
            return False
        self._failing = False
        return True


class LogBudget:
    """What a phase's steps may still write to their logs (the deployment's
    `--log-max-mb`): shared by the phase's steps. Past it a step's lines are left out of
    its file and of the live stream alike (a tenant printing without end would
    otherwise grow RP_LOGS and `rp-logs` without end), after one marker line; they are
    still masked and read by runplane (its summary, resource states, errors)."""

    def __init__(self, limit: int = Quotas().log_max_bytes) -> None:
        self.limit = limit
        self.used = 0
        self.cut = False  # the marker line is written
        self.dropped_lines = 0
        self.dropped_bytes = 0

    def take(self, size: int) -> bool:
        """Whether a record of `size` bytes still fits: once one did not, none does."""
        if self.cut or self.used + size > self.limit:
            return False
        self.used += size
        return True

    def marker(self) -> str:
        self.cut = True
        return (
            f"[runplane] log cut: this phase printed more than {self.limit // MIB} MiB "
            "(the deployment's --log-max-mb); the rest of its output is left out of the log"
        )


# Terraform's http backend client logs every request to the executor's own loopback
# backend on stderr; to a person reading the step it is noise.
_OWN_BACKEND_CHATTER = re.compile(
    r"^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d \[DEBUG\] [A-Z]+ http://127\.0\.0\.1:\d+/"
)


class LiveStepLog(StepLog):
    """A step's log: masked lines numbered per step, to the file and the live stream.

    The file holds JSON-lines records (`infra.steplogs`), stdout and stderr apart.
    """

    def __init__(
        self,
        path: Path,
        masker: Masker,
        live: LivePublisher | None,
        budget: LogBudget | None = None,
    ) -> None:
        super().__init__(path, masker)
        self.live = live
        self.budget = budget or LogBudget()
        self.dropped_lines = 0  # this step's lines past the phase's budget
        self.dropped_bytes = 0
        self.lines = 0
        self.counts = dict.fromkeys(STREAMS, 0)
        self.summary: dict[str, int] = {}
        self._started = time.monotonic()
        self._ended: float | None = None

    def write(self, text: str, stream: str = "stdout") -> str:
        """Mask, number and record a line; return the masked text."""
        masked = self.mask(text)
        body = masked.removesuffix("\n").removesuffix("\r")
        if body.startswith("{") and '"change_summary"' in body:
            self._take_summary(body)
        if _OWN_BACKEND_CHATTER.match(body):
            return masked  # Terraform's http client logging our loopback state backend
        body = self.mask(readable(body))  # again: decoding a JSON record may unescape
        record = encode_record(stream, self.lines + 1, body)
        if not self.budget.take(len(record)):
            self._drop(len(record))
            return masked
        self._record(stream, body, record)
        return masked

    def _record(self, stream: str, body: str, record: bytes) -> None:
        self.lines += 1
        self.counts[stream] = self.counts.get(stream, 0) + 1
        self._file.write(record)
        if self.live is not None:
            self.live.offer(stream, self.lines, body)

    def _drop(self, size: int) -> None:
        """A line past the budget: counted; the first one is replaced by the marker."""
        self.dropped_lines += 1
        self.dropped_bytes += size
        self.budget.dropped_lines += 1
        self.budget.dropped_bytes += size
        if not self.budget.cut:
            marker = self.budget.marker()
            self._record("stderr", marker, encode_record("stderr", self.lines + 1, marker))
            log.warning("log_cut", path=str(self.path), limit=self.budget.limit)

    def _take_summary(self, body: str) -> None:
        try:
            changes = json.loads(body).get("changes") or {}
        except (ValueError, AttributeError):
            return
        for key, name in _SUMMARY_KEYS.items():
            if isinstance(changes.get(key), int):
                self.summary[name] = changes[key]

    def close(self) -> None:
        if self._ended is None:
            self._ended = time.monotonic()
        super().close()

    async def drain(self) -> None:
        if self.live is not None:
            await self.live.room()

    async def finish(self, timeout: float = 2.0) -> None:
        """Close the file and send the rest of the live lines (bounded by `timeout`)."""
        self.close()
        if self.live is not None:
            await self.live.close(timeout)

    def metrics(self) -> dict[str, int]:
        """Duration, lines per stream, resource counts if Terraform printed a summary."""
        ended = self._ended if self._ended is not None else time.monotonic()
        out = {
            "duration_ms": round((ended - self._started) * 1000),
            **{f"{s}_lines": n for s, n in self.counts.items()},
            **self.summary,
        }
        if self.live is not None and self.live.dropped:
            out["live_dropped"] = self.live.dropped
        if self.dropped_lines:  # the run is told: past the phase's log budget
            out["log_cut_lines"] = self.dropped_lines
            out["log_cut_bytes"] = self.dropped_bytes
        return out


def open_step_log(
    ctx: PhaseContext, nc: NATS, masker: Masker, step: str, budget: LogBudget | None = None
) -> LiveStepLog:
    """The log of one step of a phase, published live on `rp.log.<run>.<phase>.<step>`
    through `nc` (the executor's one connection: the one its reports go through), within
    the phase's `budget`."""
    path = ctx.root / "logs" / f"{step}.log"  # a job directory is one phase's
    live: LivePublisher | None = None
    if valid_id(step):
        live = LivePublisher(nc, log_subject(ctx.run_id, ctx.phase, step))
    else:  # not a subject-safe token: the log is still stored, just not streamed
        log.warning("step_not_streamed", step=step)
    return LiveStepLog(path, masker, live, budget)
