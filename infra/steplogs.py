"""Step logs: the subjects, headers and object format that executors write and readers read.

Live lines go to RP_LOGS, one message per line, on `rp.log.<run_id>.<phase>.<step>`: the
body is the masked text without its newline, the headers are `Rp-Stream: stdout|stderr`
and `Rp-Line: <n>`. Lines are numbered 1, 2, ... per step across both streams, in the
order the executor read them, so a reader can drop duplicates and notice gaps.

When the step ends its whole log is stored in `rp-logs` as `<run_id>/<phase>/<step>.log`:
JSON lines `{"stream": "stdout", "line": 1, "text": "..."}` with the same numbering, so
the object continues the live stream exactly. An object that is not JSON lines (written
before this format) reads as stdout, one record per line.

Readers here do I/O (batched direct gets over RP_LOGS, an object read chunk by chunk)
and hand out batches, so that what a reader holds is bounded whatever the log's size.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_META_PRE_TEMPLATE, OBJ_STREAM_TEMPLATE

from infra.directget import DirectReader, InfraError, Raw, as_raw
from infra.streams import LOGS, LOGS_BUCKET

STREAM_HEADER = "Rp-Stream"
LINE_HEADER = "Rp-Line"
STREAMS = ("stdout", "stderr")
PHASES = ("plan", "apply")  # and custom-<number>: events/templates.py valid_phase

_BATCH = 1000
_TIMEOUT = 5.0
# The longest a reader of a finished run's log may take (services/surfaces/api/runlog.py
# `Lines`): retention deletes a run's objects only more than this after it recorded their
# removal (services/processes/retention.py GRACE_S), so a read that began before is whole.
READ_DEADLINE_S = 600.0
_OBJ_API = "$JS.API.DIRECT.GET." + OBJ_STREAM_TEMPLATE.format(bucket=LOGS_BUCKET)


class LogError(InfraError):
    """A log could not be read (NATS unavailable or timed out); worth retrying."""


class Record(msgspec.Struct, frozen=True):
    """One line of a stored step log (the object format)."""

    stream: str
    line: int
    text: str


class LogLine(msgspec.Struct, frozen=True):
    """One line of a run's log, as the API answers it."""

    phase: str
    step: str
    stream: str
    line: int
    text: str


_record_encoder = msgspec.json.Encoder()
_record_decoder = msgspec.json.Decoder(Record)


def log_subject(run_id: str, phase: str = "*", step: str = "*") -> str:
    """The live subject of a step; `*` wildcards select several steps of a run."""
    return f"rp.log.{run_id}.{phase}.{step}"


def encode_record(stream: str, line: int, text: str) -> bytes:
    """One line of the object format, newline included."""
    return _record_encoder.encode(Record(stream, line, text)) + b"\n"


def decode_records(lines: Iterable[bytes], *, first: int = 1) -> Iterator[Record]:
    """The records of a stored log (blank lines skipped); a line that is not a record is
    stdout text, numbered by its place (`first` for the first)."""
    n = first - 1
    for raw in lines:
        if not raw.strip():
            continue
        n += 1
        try:
            yield _record_decoder.decode(raw)
        except msgspec.DecodeError:
            yield Record("stdout", n, raw.decode(errors="replace").rstrip("\r\n"))


def live_headers(stream: str, line: int) -> dict[str, str]:
    return {STREAM_HEADER: stream, LINE_HEADER: str(line)}


def parse_live(subject: str, headers: dict[str, str] | None, data: bytes) -> LogLine | None:
    """A message of RP_LOGS as a line; None if it is not one (foreign or malformed)."""
    parts = subject.split(".")
    hdrs = headers or {}
    number = hdrs.get(LINE_HEADER, "")
    if len(parts) != 5 or not number.isdigit():
        return None
    stream = hdrs.get(STREAM_HEADER, "stdout")
    return LogLine(parts[3], parts[4], stream, int(number), data.decode(errors="replace"))


# ---------------------------------------------------------------- reading


class StoredLog:
    """A stored step log, read chunk by chunk: at most one chunk (128 KiB) in flight and
    in memory per reader, however large the object.

    nats-py's `ObjectStore.get` is no way to serve readers: each call creates a push
    consumer that the server fills as fast as it can, so a few hundred concurrent
    downloads put hundreds of megabytes in flight on the API's one connection; its other
    requests (stream info, the object's meta, consumer creation) then wait behind them
    past their 5 s timeout (answered 503), and past the server's max pending the
    connection is closed as a slow consumer. Here each chunk is one direct get, asked
    for only when the previous one has been written out (the caller's backpressure), and
    `gate` bounds the chunk requests in flight in the whole process.
    """

    def __init__(self, nc: NATS, name: str, info: dict[str, Any], gate: asyncio.Semaphore) -> None:
        self.nc = nc
        self.name = name
        self.nuid = str(info["nuid"])
        self.size = int(info.get("size") or 0)
        self.chunks = int(info.get("chunks") or 0)
        self.digest = str(info.get("digest") or "")
        self.gate = gate

    @classmethod
    async def open(
        cls, nc: NATS, name: str, gate: asyncio.Semaphore, *, timeout: float = _TIMEOUT
    ) -> StoredLog | None:
        """The object's meta (one direct get), or None if there is no such object."""
        meta = OBJ_META_PRE_TEMPLATE.format(
            bucket=LOGS_BUCKET, obj=base64.urlsafe_b64encode(name.encode()).decode()
        )
        msg = await _direct(nc, f"{_OBJ_API}.{meta}", b"", gate, timeout)
        if msg is None:
            return None
        try:
            info = json.loads(msg.data)
        except ValueError as e:
            raise LogError(f"{LOGS_BUCKET}/{name}: unreadable meta") from e
        if info.get("deleted") or not info.get("nuid"):
            return None
        return cls(nc, name, info, gate)

    async def chunks_of(self, *, timeout: float = _TIMEOUT) -> AsyncIterator[bytes]:
        """The object's bytes in its chunks, checked against its size and digest."""
        subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=LOGS_BUCKET, obj=self.nuid)
        h = hashlib.sha256()
        seq, got, size = 1, 0, 0
        while got < self.chunks:
            req = json.dumps({"seq": seq, "next_by_subj": subject}).encode()
            msg = await _direct(self.nc, _OBJ_API, req, self.gate, timeout)
            if msg is None:
                break
            seq = msg.seq + 1
            got, size = got + 1, size + len(msg.data)
            h.update(msg.data)
            yield msg.data
        digest = base64.urlsafe_b64encode(h.digest()).decode()
        if (got, size) != (self.chunks, self.size) or self.digest.split("=", 1)[-1] != digest:
            raise LogError(f"{LOGS_BUCKET}/{self.name}: incomplete or corrupt object")

    async def records(self) -> AsyncIterator[list[Record]]:
        """The object's records, one list per chunk read (lines split across chunks are
        joined); an old object that is not JSON lines reads as stdout, one record a line."""
        rest = b""
        n = 0
        async for chunk in self.chunks_of():
            lines = (rest + chunk).split(b"\n")
            rest = lines.pop()
            batch = list(decode_records(lines, first=n + 1))
            n += len(batch)
            if batch:
                yield batch
        if last := list(decode_records([rest], first=n + 1)):
            yield last


async def _direct(
    nc: NATS, subject: str, payload: bytes, gate: asyncio.Semaphore, timeout: float
) -> Raw | None:
    """One direct get; None when the server has no such message."""
    async with gate:
        return await DirectReader.of(nc).one(
            subject, payload, as_raw, what=LOGS_BUCKET, error=LogError, timeout=timeout
        )


async def read_object(nc: NATS, name: str) -> list[Record] | None:
    """All the records of a stored log (small logs and tests), or None if there is none."""
    stored = await StoredLog.open(nc, name, asyncio.Semaphore(1))
    if stored is None:
        return None
    return [r async for batch in stored.records() for r in batch]


async def read_live(nc: NATS, subject: str, *, timeout: float = _TIMEOUT) -> list[LogLine]:
    """Every line RP_LOGS still holds on `subject` (wildcards allowed), in stream order."""
    return [line async for batch in iter_live(nc, subject, timeout=timeout) for line in batch]


async def iter_live(
    nc: NATS, subject: str, *, start: int = 1, timeout: float = _TIMEOUT
) -> AsyncIterator[list[LogLine]]:
    """The lines RP_LOGS holds on `subject` from sequence `start`, a batch at a time."""
    async for batch in iter_stream(nc, LOGS, subject, start=start, timeout=timeout):
        lines = [parse_live(m.subject, m.headers, m.data) for m in batch]
        yield [line for line in lines if line is not None]


async def iter_stream(
    nc: NATS, stream: str, subject: str, *, start: int = 1, timeout: float = _TIMEOUT
) -> AsyncIterator[list[Raw]]:
    """The messages `stream` holds on `subject` from sequence `start`, in batches."""
    while True:
        page, last = await direct_batch(nc, stream, subject, start, timeout=timeout)
        if page:
            yield page
        if last == 0:
            return
        start = last + 1


async def direct_batch(
    nc: NATS,
    stream: str,
    subject: str,
    start: int,
    *,
    batch: int = _BATCH,
    timeout: float = _TIMEOUT,
) -> tuple[list[Raw], int]:
    """One batched direct get: the messages and the last sequence read (0 when at the end)."""
    req = {"seq": start, "next_by_subj": subject, "batch": batch}
    page, _ = await DirectReader.of(nc).batch(
        stream, req, as_raw, what=subject, error=LogError, timeout=timeout
    )
    return page, (page[-1].seq if len(page) == batch else 0)
