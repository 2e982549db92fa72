"""The audit stream (RP_AUDIT): append a record to an organization's chain, read it back.

Appends are checked (`Nats-Expected-Last-Subject-Sequence` on `audit.<org>`), so writers
on any replica, the auditor's and the api's refusals, keep one linear chain: a writer that
lost the race reads the new head and links after it (bounded tries). A record of an event
carries `Nats-Msg-Id` `audit-<org>-<src>`, and is skipped when the chain's high-water mark
is at or past its event (events/audit.py `after`), so a retry after a lost answer, a
restarted auditor or two auditors racing never record an event twice. The head is read
from the stream's leader (a follower behind would have the writer link to an old head
and lose the race every time); each process keeps the last head it wrote, so a busy
chain costs one round trip per record.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Callable
from datetime import UTC, datetime

import msgspec
import nats.errors
import structlog
from nats.aio.client import Client as NATS

from events.audit import (
    CHECKPOINT,
    Facts,
    Record,
    after,
    checkpoint,
    checkpoint_message,
    checkpoint_msg_id,
    decode,
    encode,
)
from events.audit import msg_id as record_msg_id
from events.audit import subject as audit_subject
from infra.auditkeys import AuditKeys
from infra.directget import DirectReader, InfraError, Raw, as_raw, leader_get
from infra.streams import AUDIT, WRONG_LAST_SEQUENCES

log = structlog.get_logger(__name__)

TRIES = 50  # a chain hot with refusals of many replicas: each try links after a new head
PAGE = 1000  # records a direct get returns at once
_EPOCH = datetime.fromtimestamp(0, UTC)


class AuditError(InfraError):
    """The audit stream could not be read or written."""


class _Ack(msgspec.Struct, frozen=True):
    seq: int = 0
    duplicate: bool = False
    error: dict[str, object] | None = None


_ack = msgspec.json.Decoder(_Ack)
Head = tuple[int, bytes, Record | None]  # stream sequence (0: none), stored bytes, record


class AuditLog:
    """Append to and read organizations' audit chains."""

    def __init__(self, nc: NATS, *, timeout: float = 5.0) -> None:
        self.nc = nc
        self.timeout = timeout
        self.direct = DirectReader(nc, timeout=timeout)
        self._heads: dict[str, Head] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def head(self, org: str) -> Head:
        """The chain's last record as the stream's leader has it."""
        raw = await leader_get(
            self.nc, AUDIT, as_raw, subject=audit_subject(org), what=f"audit of {org}",
            error=AuditError, timeout=self.timeout,
        )  # fmt: skip
        if raw is None:
            return 0, b"", None
        try:
            return raw.seq, raw.data, decode(raw.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.error("audit_head_not_a_record", org=org, seq=raw.seq, error=str(e))
            return raw.seq, raw.data, await self._standing_in(org, raw.seq)

    async def _standing_in(self, org: str, seq: int) -> Record:
        """What stands for a head that is no record (published by someone with NATS
        access): the place after the chain's last record before it, that record's
        high-water mark. The next record links to the foreign message's bytes and numbers
        past it, so `audit verify` names that message alone and the chain goes on (a
        head that raised stopped every append to the chain and the auditor's every pass)."""
        good: Record | None = None
        start = 1
        while start < seq and (page := await self.page(org, start)):
            for raw in page:
                if raw.seq >= seq:
                    break
                with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                    good = decode(raw.data)
            start = page[-1].seq + 1
        return Record(
            org=org, n=good.n + 1 if good else 1, prev="", at=good.at if good else _EPOCH,
            hw=good.hw if good else 0,
        )  # fmt: skip

    async def append(self, facts: Facts) -> int:
        """Append `facts` to its organization's chain; the record's stream sequence, or 0
        when the chain already holds the record of its event."""

        def make(head: Head) -> tuple[Record | None, str]:
            made = after(head[2], head[1], facts)
            mid = record_msg_id(facts.org, facts.src) if facts.src else uuid.uuid4().hex
            return made, mid

        return await self._linked(facts.org, make)

    async def checkpoint(self, org: str, keys: AuditKeys, at: datetime) -> int:
        """Sign the chain's head with a checkpoint record; 0 if the chain is empty or
        already ends with a checkpoint. The head is the leader's, never this process's
        last: another writer (the api's refusals) appends after it without telling."""
        kid = await keys.kid()
        async with self._lock(org):
            for _ in range(TRIES):
                head = await self.head(org)
                if head[2] is None or head[2].kind == CHECKPOINT:
                    return 0
                record = msgspec.structs.replace(checkpoint(head[2], head[1], org, at), kid=kid)
                sig = await keys.sign(checkpoint_message(record))
                record = msgspec.structs.replace(record, sig=sig.hex())
                seq = await self._publish(org, head, record, checkpoint_msg_id(org, record.n))
                if seq:
                    return seq
            raise AuditError(f"{org}'s audit chain kept moving under {TRIES} tries")

    async def _linked(self, org: str, make: Callable[[Head], tuple[Record | None, str]]) -> int:
        async with self._lock(org):
            for _ in range(TRIES):
                head = await self._head(org)
                record, mid = make(head)
                if record is None:
                    return 0
                seq = await self._publish(org, head, record, mid)
                if seq:
                    return seq
            raise AuditError(f"{org}'s audit chain kept moving under {TRIES} tries")

    def _lock(self, org: str) -> asyncio.Lock:
        return self._locks.setdefault(org, asyncio.Lock())

    async def _head(self, org: str) -> Head:
        cached = self._heads.get(org)
        return cached if cached is not None else await self.head(org)

    async def _publish(self, org: str, head: Head, record: Record, mid: str) -> int:
        """The record's sequence once appended after `head`; 0 when another writer moved
        the chain first (the head is read again)."""
        data = encode(record)
        headers = {"Nats-Msg-Id": mid, "Nats-Expected-Last-Subject-Sequence": str(head[0])}
        try:
            reply = await self.nc.request(
                audit_subject(org), data, headers=headers, timeout=self.timeout
            )
        except (TimeoutError, nats.errors.Error) as e:
            self._heads.pop(org, None)
            raise AuditError(f"appending to {org}'s audit chain: {e!r}") from e
        ack = _ack.decode(reply.data)
        if ack.error is not None:
            self._heads.pop(org, None)
            if ack.error.get("err_code") in WRONG_LAST_SEQUENCES:
                return 0
            raise AuditError(f"appending to {org}'s audit chain: {ack.error.get('description')}")
        if ack.duplicate:  # an earlier try (or another writer) stored this very record id
            self._heads.pop(org, None)
            return ack.seq
        self._heads[org] = (ack.seq, data, record)
        return ack.seq

    async def page(self, org: str, start: int, limit: int = PAGE) -> list[Raw]:
        """Up to `limit` records of `org` from stream sequence `start` on, in order."""
        req = {"seq": max(1, start), "next_by_subj": audit_subject(org), "batch": min(limit, PAGE)}
        page, _ = await self.direct.batch(
            AUDIT, req, as_raw, what=f"audit of {org}", error=AuditError, timeout=self.timeout
        )
        return page


async def stream_state(nc: NATS, *, stream: str = AUDIT, timeout: float = 5.0) -> tuple[int, int]:
    """The audit stream's (or `stream`'s) first and last sequence, as its leader has them."""
    reply = await nc.request(f"$JS.API.STREAM.INFO.{stream}", b"", timeout=timeout)
    body = json.loads(reply.data)
    if "error" in body:
        raise AuditError(f"{stream} stream info: {body['error'].get('description')}")
    state = body["state"]
    return int(state["first_seq"]), int(state["last_seq"])
