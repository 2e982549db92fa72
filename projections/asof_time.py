"""`as_of` to a stream sequence (projections/asof.py's models are folded up to it): a
sequence is checked against the stream's bounds, an RFC 3339 time is the last sequence
stored at or before it, one request to the stream's leader."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from nats.aio.client import Client as NATS

from infra.streams import EVENTS

_API = "$JS.API"
_NO_MESSAGE = 10037  # JetStream's "no message found"


class AsOfError(RuntimeError):
    """An `as_of` that cannot be answered; `slug` is the problem type."""

    slug = "invalid-as-of"


async def bounds(nc: NATS, stream: str = EVENTS) -> tuple[int, int]:
    """The stream's first and last sequences, as its leader has them."""
    state = (await nc.jetstream().stream_info(stream)).state
    return state.first_seq, state.last_seq


async def resolve(nc: NATS, raw: str, *, stream: str = EVENTS, now: datetime | None = None) -> int:
    """The stream sequence `raw` (a sequence, or an RFC 3339 time) names; AsOfError if
    it is unparseable, in the future, past the stream's last or before its first."""
    text = raw.strip()
    first, last = await bounds(nc, stream)
    if text.isascii() and text.isdigit():
        seq = int(text) if len(text) <= 19 else last + 1
        if seq > last:
            raise AsOfError(f"as_of {text[:24]} is past the stream's last sequence ({last})")
    else:
        when = parse_time(text)
        if when > (now or datetime.now(UTC)):
            raise AsOfError(f"as_of {raw[:64]} is in the future")
        after = await _first_at(nc, stream, when, nanos=1)
        seq = last if after is None else after - 1
    if seq < max(first, 1):
        raise AsOfError(f"as_of {raw[:64]} is before the stream's first event ({first})")
    return seq


async def _first_at(nc: NATS, stream: str, when: datetime, *, nanos: int = 0) -> int | None:
    """The sequence of the first message stored at or after `when` (plus `nanos`
    nanoseconds), or None: one request, answered by the stream's leader."""
    utc = when.astimezone(UTC)
    stamp = f"{utc:%Y-%m-%dT%H:%M:%S}.{utc.microsecond * 1000 + nanos:09d}Z"
    req = json.dumps({"start_time": stamp}).encode()
    reply = await nc.request(f"{_API}.STREAM.MSG.GET.{stream}", req, timeout=5)
    answer = json.loads(reply.data)
    if "error" in answer:
        if answer["error"].get("err_code") == _NO_MESSAGE:
            return None
        raise RuntimeError(f"reading {stream} at {stamp}: {answer['error']}")
    return int(answer["message"]["seq"])


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)  # no stream holds a message before it


def parse_time(text: str) -> datetime:
    """An RFC 3339 time with its offset (`Z` or `+hh:mm`); AsOfError otherwise."""
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise AsOfError(
            f"as_of {text[:64]!r} is neither a stream sequence nor an RFC 3339 time"
        ) from None
    if when.tzinfo is None or "T" not in text.upper():
        raise AsOfError(f"as_of {text[:64]!r} needs a date, a time and an offset (RFC 3339)")
    try:  # in UTC, within the calendar (year 1 at +01:00 is not), after the epoch
        utc = when.astimezone(UTC)
    except OverflowError:
        raise AsOfError(f"as_of {text[:64]!r} is out of range") from None
    if utc < _EPOCH:
        raise AsOfError(f"as_of {text[:64]!r} is before the stream's first event")
    return utc
