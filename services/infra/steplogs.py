"""Step logs: the subjects, headers and object format that executors write and readers read.

Live lines go to RP_LOGS, one message per line, on `rp.log.<run_id>.<phase>.<step>`: the
body is the masked text without its newline, the headers are `Rp-Stream: stdout|stderr`
and `Rp-Line: <n>`. Lines are numbered 1, 2, ... per step across both streams, in the
order the executor read them, so a reader can drop duplicates and notice gaps.

When the step ends its whole log is stored in `rp-logs` as `<run_id>/<phase>/<step>.log`:
JSON lines `{"stream": "stdout", "line": 1, "text": "..."}` with the same numbering, so
the object continues the live stream exactly. An object that is not JSON lines (written
before this format) reads as stdout, one record per line.

Readers here do I/O (a direct get over RP_LOGS, an object download) and return whole
lists: a step log is read once per request, and live lines are age-limited.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterable, Iterator

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.infra.streams import LOGS, LOGS_BUCKET

STREAM_HEADER = "Rp-Stream"
LINE_HEADER = "Rp-Line"
STREAMS = ("stdout", "stderr")
PHASES = ("plan", "apply")  # and custom-<number>: events/templates.py valid_phase

_BATCH = 1000
_SPOOL = 8 * 1024 * 1024  # a log object larger than this is spooled to disk while read


class LogError(RuntimeError):
    """A log could not be read (NATS unavailable or timed out); worth retrying."""

    retryable = True


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


def decode_records(lines: Iterable[bytes]) -> Iterator[Record]:
    """The records of a stored log; a line that is not a record is stdout text."""
    for n, raw in enumerate(lines, 1):
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


async def read_object(nc: NATS, name: str) -> list[Record] | None:
    """The records of a stored log, or None if there is no such object."""
    with tempfile.SpooledTemporaryFile(max_size=_SPOOL) as buf:
        try:
            store = await nc.jetstream().object_store(LOGS_BUCKET)
            await store.get(name, writeinto=buf)  # type: ignore[arg-type]  # a binary file
        except nats.js.errors.ObjectNotFoundError:
            return None
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as e:
            raise LogError(f"reading {LOGS_BUCKET}/{name}: {e!r}") from e
        buf.seek(0)
        return list(decode_records(raw for raw in buf if raw.strip()))


async def read_live(nc: NATS, subject: str, *, timeout: float = 5.0) -> list[LogLine]:
    """Every line RP_LOGS still holds on `subject` (wildcards allowed), in stream order."""
    out: list[LogLine] = []
    start = 1
    while True:
        page, last = await _direct_batch(nc, subject, start, timeout)
        out.extend(page)
        if last == 0:
            return out
        start = last + 1


async def _direct_batch(
    nc: NATS, subject: str, start: int, timeout: float
) -> tuple[list[LogLine], int]:
    """One batched direct get: the lines and the last sequence read (0 when at the end)."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    page: list[LogLine] = []
    try:
        req = {"seq": start, "next_by_subj": subject, "batch": _BATCH}
        await nc.publish(f"$JS.API.DIRECT.GET.{LOGS}", json.dumps(req).encode(), reply=inbox)
        count, last = 0, 0
        while True:
            msg = await sub.next_msg(timeout=timeout)
            if _end_of_batch(msg):
                return page, (last if count == _BATCH else 0)
            count, last = count + 1, int((msg.headers or {})["Nats-Sequence"])
            line = parse_live((msg.headers or {})["Nats-Subject"], msg.headers, msg.data)
            if line is not None:
                page.append(line)
    except TimeoutError as e:
        raise LogError(f"reading {subject} timed out") from e
    finally:
        await sub.unsubscribe()


def _end_of_batch(msg: Msg) -> bool:
    status = (msg.headers or {}).get("Status")
    if not status:
        return False
    if status in ("204", "404"):
        return True
    raise LogError(f"direct get failed: {status} {(msg.headers or {}).get('Description')}")
