"""Audit destinations: where an organization's audit log is streamed (a SIEM), and what is
sent there. Pure.

A destination belongs to one organization and is an aggregate of its own on
`rp.org.<org>.auditdest.<id>`. Its secret (the signing secret of the `runplane` format,
the HEC token of `splunk-hec`) is never in an event: the event says only whether one is
set (`has_secret`), and the sealed value lives in the secrets bucket, as a notification
token does. The organization it streams is the subject's, never a field a tenant
writes: every field of the body (name, sourcetype, index, URL) is free text that selects no
record (HEC's `source` is always `runplane:<org>`, of the subject's organization).

What is sent: each record as `GET .../audit` answers it (the record as stored, its
stream sequence `seq` and `hash`), with its stable `delivery_id` `<org>.<n>` (the
organization and the record's place in its chain: the same on every retry, after a
restart, from every replica). `runplane`: a batch of JSON lines, signed as notifications
are; `splunk-hec`: HEC's event objects one after the other (HEC takes several in a body).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, assert_never

import msgspec

from events.audit import Record, digest
from events.base import Command, Event
from events.errors import AlreadyExists, Invalid, NotFound

RUNPLANE, HEC = "runplane", "splunk-hec"
FORMATS = (RUNPLANE, HEC)
MAX_NAME = 100
MAX_URL = 2048
MAX_FIELD = 100  # a HEC sourcetype or index
MAX_DESTINATIONS = 10  # per organization: each is a lane of its own in the streamer
MAX_SECRET = 4096
NDJSON = "application/x-ndjson"


class AuditDestination(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    org: str
    name: str
    format: str = RUNPLANE
    url: str
    enabled: bool = True
    has_secret: bool = False
    sourcetype: str = ""  # HEC's `sourcetype` ("": runplane:audit)
    index: str = ""  # HEC's `index` ("": the token's default)
    created_at: datetime
    created_by: str


class DestinationSaved(Event, frozen=True, kw_only=True, tag="org.audit_destination_saved"):
    """The whole destination as it now is (created or changed)."""

    destination_id: str
    destination: AuditDestination


class DestinationDeleted(Event, frozen=True, kw_only=True, tag="org.audit_destination_deleted"):
    destination_id: str


AuditDestinationEvent = DestinationSaved | DestinationDeleted


def subject(org: str, destination_id: str) -> str:
    return f"rp.org.{org}.auditdest.{destination_id}"


def subjects(org: str) -> str:
    return f"rp.org.{org}.auditdest.*"


ALL_SUBJECTS = "rp.org.*.auditdest.*"


class SaveDestination(Command, frozen=True, kw_only=True):
    """Create (`create=True`) or change a destination: fields left None are kept."""

    destination_id: str
    org: str
    create: bool = False
    name: str | None = None
    format: str | None = None
    url: str | None = None
    enabled: bool | None = None
    has_secret: bool | None = None
    sourcetype: str | None = None
    index: str | None = None


class DeleteDestination(Command, frozen=True, kw_only=True):
    destination_id: str


class DestinationState(msgspec.Struct, frozen=True, kw_only=True):
    destination: AuditDestination | None = None
    deleted: bool = False
    version: int = 0

    @property
    def exists(self) -> bool:
        return self.destination is not None and not self.deleted


def evolve(state: DestinationState, event: AuditDestinationEvent) -> DestinationState:
    s = msgspec.structs.replace(state, version=state.version + 1)
    match event:
        case DestinationSaved():
            return msgspec.structs.replace(s, destination=event.destination, deleted=False)
        case DestinationDeleted():
            return msgspec.structs.replace(s, deleted=True)
        case _:
            assert_never(event)


def fold(events: Sequence[Any], state: DestinationState | None = None) -> DestinationState:
    state = state or DestinationState()
    for e in events:
        if isinstance(e, DestinationSaved | DestinationDeleted):
            state = evolve(state, e)
    return state


_CHANGED = ("name", "format", "url", "enabled", "has_secret", "sourcetype", "index")


def decide(
    state: DestinationState, cmd: SaveDestination | DeleteDestination, *, now: datetime
) -> list[AuditDestinationEvent]:
    match cmd:
        case SaveDestination():
            return _save(state, cmd, now)
        case DeleteDestination():
            if not state.exists:
                raise NotFound(f"audit destination {cmd.destination_id} not found")
            return [DestinationDeleted(at=now, actor=cmd.actor, destination_id=cmd.destination_id)]
        case _:
            assert_never(cmd)


def _save(
    state: DestinationState, cmd: SaveDestination, now: datetime
) -> list[AuditDestinationEvent]:
    if cmd.create:
        if state.destination is not None:
            raise AlreadyExists(f"audit destination {cmd.destination_id} exists")
        if cmd.name is None or cmd.url is None:
            raise Invalid("an audit destination needs name and url")
        before = AuditDestination(
            id=cmd.destination_id, org=cmd.org, name="", url="", created_at=now,
            created_by=cmd.actor,
        )  # fmt: skip
    elif not state.exists or state.destination is None:
        raise NotFound(f"audit destination {cmd.destination_id} not found")
    else:
        before = state.destination
    changes = {k: getattr(cmd, k) for k in _CHANGED if getattr(cmd, k) is not None}
    after = msgspec.structs.replace(before, **changes)
    check(after)
    if after == state.destination:
        return []
    return [DestinationSaved(at=now, actor=cmd.actor, destination_id=after.id, destination=after)]


def check(d: AuditDestination) -> None:
    """Invalid, saying why, unless the destination is well formed (its address is judged
    by the shell: it needs DNS)."""
    if not d.name.strip() or len(d.name) > MAX_NAME or not d.name.isprintable():
        raise Invalid(f"name is 1 to {MAX_NAME} printable characters")
    if d.format not in FORMATS:
        raise Invalid(f"format must be one of {', '.join(FORMATS)}")
    if len(d.url) > MAX_URL or not d.url.startswith(("https://", "http://")):
        raise Invalid(f"url must be an http(s) URL of at most {MAX_URL} characters")
    if any(ord(c) <= 32 or ord(c) == 127 for c in d.url):
        raise Invalid("url may not contain spaces or control characters")
    for field in ("sourcetype", "index"):
        value = getattr(d, field)
        if len(value) > MAX_FIELD or not value.isprintable():
            raise Invalid(f"{field} is at most {MAX_FIELD} printable characters")
    if d.enabled and not d.has_secret:
        what = "HEC token" if d.format == HEC else "signing secret"
        raise Invalid(f"an enabled destination needs its secret (the {what})")


# ---------------------------------------------------------------- what is sent


def delivery_id(org: str, n: int) -> str:
    """A record's stable delivery id: its organization and its place in the chain."""
    return f"{org}.{n}"


def batch_id(org: str, first: int, last: int) -> str:
    """A batch's `RP-Delivery`: the first and last place it carries."""
    return f"{org}.{first}-{last}"


def answered(seq: int, data: bytes, record: Record) -> dict[str, Any]:
    """A record as `GET .../audit` answers it: as stored, with its sequence and hash."""
    return {"seq": seq, "hash": digest(data), **msgspec.to_builtins(record)}


_encoder = msgspec.json.Encoder()


def item(seq: int, data: bytes, record: Record) -> dict[str, Any]:
    """What a destination gets of one record: the audit API's answer and its delivery id."""
    return {"delivery_id": delivery_id(record.org, record.n), **answered(seq, data, record)}


def render(
    d: AuditDestination, records: Sequence[tuple[int, bytes, Record]], *, host: str
) -> bytes:
    """The body of one request carrying `records` (in chain order) to `d`."""
    if d.format == HEC:
        return b"".join(
            _encoder.encode(_hec(d, r, seq, data, host)) + b"\n" for seq, data, r in records
        )
    return b"".join(_encoder.encode(item(seq, data, r)) + b"\n" for seq, data, r in records)


def _hec(d: AuditDestination, r: Record, seq: int, data: bytes, host: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "time": round(r.at.timestamp(), 6),
        "host": host,
        "source": f"runplane:{d.org}",  # never the tenant's word: it names the org
        "sourcetype": d.sourcetype or "runplane:audit",
        "event": item(seq, data, r),
    }
    if d.index:
        out["index"] = d.index
    return out


def content_type(d: AuditDestination) -> str:
    return "application/json" if d.format == HEC else NDJSON
