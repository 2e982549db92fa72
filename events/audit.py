"""The organization's audit log: its records, their hash chain, and the chain's check. Pure.

A record says who (actor, its kind, via which surface), did what (`action`, the event's
tag or the refused route), on which thing, with which outcome, when, and the request id
and client address when a request caused it. Each organization's records form a chain:
record `n` carries `prev`, the SHA-256 of the stored bytes of record `n - 1` (`GENESIS`
before the first). A record describing an event carries the event's stream sequence
(`src`) and the SHA-256 of its stored bytes (`src_hash`), never its content, so retention
may later remove the event (or its logs) and the chain still verifies. `hw` is the highest
`src` in the chain so far: the auditor skips an event at or below it (idempotent across
a kill at any line, and across replicas).

A checkpoint is a record of its own kind in the chain: it signs (Ed25519, the deployment's
audit key) the organization, its place `n` (so `n - 1` records before it) and `prev` (the
head it attests). `Chain` checks one organization's records in stream order and names the
first broken link; `checkpoint_message` is what a checkpoint signs.
"""

from __future__ import annotations

import hashlib
from datetime import datetime
from typing import Final

import msgspec

GENESIS: Final = "0" * 64
VIA: Final = (
    "api", "ui", "cli", "tfe", "chat", "vcs", "schedule", "run_trigger", "rerun", "system",
)  # fmt: skip
OK, REFUSED = "ok", "refused"
RECORD, CHECKPOINT = "record", "checkpoint"


class Record(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One audit record as stored (`audit.<org>` on RP_AUDIT). Stored: never forbids
    unknown fields; new fields get defaults."""

    v: int = 1
    org: str
    n: int  # its place in the organization's chain, from 1
    prev: str  # SHA-256 (hex) of the stored bytes of record n - 1; GENESIS for n = 1
    at: datetime
    kind: str = RECORD  # RECORD | CHECKPOINT
    actor: str = ""
    actor_kind: str = ""  # user | token | team | admin | system
    via: str = ""  # one of VIA
    action: str = ""  # the event's tag, or "refused <METHOD> <route>"
    thing: str = ""  # "run ws/r-1", "workspace ws", "team net", "organization acme"
    outcome: str = ""  # OK | REFUSED
    status: int = 0  # a refusal's HTTP status
    detail: str = ""  # a refusal's problem type
    request_id: str = ""
    client: str = ""  # the client's address as the api saw it
    src: int = 0  # the described event's stream sequence on RP_EVENTS (0: none)
    src_hash: str = ""  # SHA-256 (hex) of that event's stored bytes
    hw: int = 0  # the highest `src` in the chain up to and with this record
    kid: str = ""  # a checkpoint's key id
    sig: str = ""  # a checkpoint's signature (hex) of `checkpoint_message`
    more: int = 0  # a refusal's: the caller's refusals left unrecorded just before (a flood)


class Facts(msgspec.Struct, frozen=True, kw_only=True):
    """What a record says, before its place in a chain is known."""

    org: str
    at: datetime
    actor: str
    actor_kind: str
    via: str
    action: str
    thing: str
    outcome: str = OK
    status: int = 0
    detail: str = ""
    request_id: str = ""
    client: str = ""
    src: int = 0
    src_hash: str = ""
    more: int = 0


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Record)


def encode(record: Record) -> bytes:
    return _encoder.encode(record)


def decode(data: bytes) -> Record:
    return _decoder.decode(data)


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def subject(org: str) -> str:
    return f"audit.{org}"


def msg_id(org: str, src: int) -> str:
    """The dedupe id of the record of event `src` (replicas racing append it once)."""
    return f"audit-{org}-{src}"


def checkpoint_msg_id(org: str, n: int) -> str:
    """The dedupe id of `org`'s checkpoint at place `n`. Its dots keep it apart from every
    `msg_id` (names hold no dot): with dashes, organization `ckpt-b`'s record of event 3
    and b's checkpoint at place 3 were one id, and the stream dropped the later one."""
    return f"audit-ckpt.{org}.{n}"


def after(head: Record | None, head_bytes: bytes, facts: Facts) -> Record | None:
    """The record `facts` make after `head` (None: the chain is empty); None when the
    chain already holds it (its event is at or below the chain's high-water mark)."""
    hw = head.hw if head is not None else 0
    if facts.src and facts.src <= hw:
        return None
    return Record(
        org=facts.org,
        n=head.n + 1 if head is not None else 1,
        prev=digest(head_bytes) if head is not None else GENESIS,
        at=facts.at,
        actor=facts.actor,
        actor_kind=facts.actor_kind,
        via=facts.via,
        action=facts.action,
        thing=facts.thing,
        outcome=facts.outcome,
        status=facts.status,
        detail=facts.detail,
        request_id=facts.request_id,
        client=facts.client,
        src=facts.src,
        src_hash=facts.src_hash,
        hw=max(hw, facts.src),
        more=facts.more,
    )


def checkpoint(head: Record | None, head_bytes: bytes, org: str, at: datetime) -> Record:
    """An unsigned checkpoint after `head` (sign `checkpoint_message` of it, then set
    `kid` and `sig`)."""
    return Record(
        org=org,
        n=head.n + 1 if head is not None else 1,
        prev=digest(head_bytes) if head is not None else GENESIS,
        at=at,
        kind=CHECKPOINT,
        actor="runplane",
        actor_kind="system",
        via="system",
        action="audit.checkpoint",
        thing=f"organization {org}",
        outcome=OK,
        hw=head.hw if head is not None else 0,
    )


def checkpoint_message(record: Record) -> bytes:
    """What a checkpoint's signature covers: the organization, how many records precede
    it, the hash of the last of them, and when."""
    return (
        f"runplane-audit-checkpoint/v1\n{record.org}\n{record.n - 1}\n{record.prev}\n"
        f"{record.at.isoformat()}\n{record.kid}"
    ).encode()
