"""The event store on JetStream: read a subject's events, append with optimistic concurrency.

Reads use batched direct gets (one request, many replies) on the subject index, so loading a
run costs one round trip. Appends carry `Nats-Expected-Last-Subject-Sequence` and
`Nats-Msg-Id`; several events of one decision go in one atomic batch (server 2.12+).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import datetime

import msgspec
from nats.aio.client import Client as NATS

from events.codec import AnyEvent, decode, encode, tag_of
from events.errors import Conflict
from services.infra.streams import EVENTS

_BATCH = 1000
WRONG_LAST_SEQUENCE = 10071
BATCH_DUPLICATE_ID = 10201


class StoreError(RuntimeError):
    """The event store could not do what was asked; `retryable` says whether to try again."""

    retryable = True


class Envelope(msgspec.Struct, frozen=True, kw_only=True):
    """A stored event with its place in the log."""

    seq: int
    subject: str
    msg_id: str
    time: datetime | None
    event: AnyEvent


class _AckError(msgspec.Struct, frozen=True):
    code: int = 0
    err_code: int = 0
    description: str = ""


class _Ack(msgspec.Struct, frozen=True):
    """JetStream's answer to a publish or to the commit of a batch."""

    seq: int = 0
    error: _AckError | None = None


_ack_decoder = msgspec.json.Decoder(_Ack)


class Append(msgspec.Struct, frozen=True, kw_only=True):
    """One event to append on a subject, expecting that subject's last sequence."""

    subject: str
    event: AnyEvent
    expected: int
    msg_id: str = ""


def _headers(item: Append, msg_id: str, extra: dict[str, str]) -> dict[str, str]:
    return {
        "Nats-Expected-Last-Subject-Sequence": str(item.expected),
        "Nats-Msg-Id": msg_id,
        "Rp-Type": tag_of(item.event),
        **extra,
    }


class EventStore:
    """Read and append events of the RP_EVENTS stream."""

    def __init__(self, nc: NATS, *, stream: str = EVENTS, timeout: float = 5.0) -> None:
        self.nc = nc
        self.stream = stream
        self.timeout = timeout

    # ------------------------------------------------------------ reading

    async def read(self, subject: str, after: int = 0) -> list[Envelope]:
        """Every event on `subject` (wildcards allowed) with a sequence above `after`."""
        out: list[Envelope] = []
        start = after + 1
        while True:
            page = await self._direct_batch(subject, start)
            out.extend(page)
            if len(page) < _BATCH:
                return out
            start = page[-1].seq + 1

    async def _direct_batch(self, subject: str, start: int) -> list[Envelope]:
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        try:
            req = {"seq": start, "next_by_subj": subject, "batch": _BATCH}
            await self.nc.publish(
                f"$JS.API.DIRECT.GET.{self.stream}", json.dumps(req).encode(), reply=inbox
            )
            page: list[Envelope] = []
            while True:
                msg = await sub.next_msg(timeout=self.timeout)
                hdrs = msg.headers or {}
                status = hdrs.get("Status")
                if status:
                    if status in ("204", "404"):
                        return page
                    raise StoreError(f"direct get failed: {status} {hdrs.get('Description')}")
                page.append(
                    Envelope(
                        seq=int(hdrs["Nats-Sequence"]),
                        subject=hdrs["Nats-Subject"],
                        msg_id=hdrs.get("Nats-Msg-Id", ""),
                        time=_parse_time(hdrs.get("Nats-Time-Stamp")),
                        event=decode(msg.data),
                    )
                )
        except TimeoutError as e:
            raise StoreError(f"reading {subject} timed out") from e
        finally:
            await sub.unsubscribe()

    async def last(self, subject: str) -> tuple[int, str]:
        """The sequence and msg id of the last message on an exact subject (0, "" if none)."""
        req = json.dumps({"last_by_subj": subject}).encode()
        msg = await self.nc.request(f"$JS.API.DIRECT.GET.{self.stream}", req, timeout=self.timeout)
        hdrs = msg.headers or {}
        if hdrs.get("Status"):
            return 0, ""
        return int(hdrs["Nats-Sequence"]), hdrs.get("Nats-Msg-Id", "")

    async def last_seq(self) -> int:
        """The stream's last sequence: what a fully caught-up reader has seen."""
        resp = await self.nc.request(
            f"$JS.API.STREAM.INFO.{self.stream}", b"", timeout=self.timeout
        )
        return int(json.loads(resp.data)["state"]["last_seq"])

    # ------------------------------------------------------------ appending

    async def append(self, items: list[Append], *, attempts: int = 3) -> int:
        """Append all items atomically; return the sequence of the last one.

        Raises Conflict when another writer moved one of the subjects first. A retry after
        a lost acknowledgement re-sends the same msg ids; if the first try landed, the
        head of the subject carries our msg id and the append counts as done.
        """
        if not items:
            raise ValueError("nothing to append")
        ids = [it.msg_id or uuid.uuid4().hex for it in items]
        last_err: Exception | None = None
        for _ in range(attempts):
            try:
                ack = await self._send(items, ids)
            except TimeoutError as e:  # the first try may have landed: look before retrying
                last_err = e
                landed = await self._landed(items, ids)
                if landed:
                    return landed
                continue
            err = ack.error
            if err is None:
                return ack.seq
            if err.err_code in (WRONG_LAST_SEQUENCE, BATCH_DUPLICATE_ID):
                landed = await self._landed(items, ids)
                if landed:
                    return landed
                raise Conflict(err.description or "wrong last sequence")
            raise StoreError(f"append refused: {err.description}")
        raise StoreError("append timed out") from last_err

    async def _landed(self, items: list[Append], ids: list[str]) -> int:
        """If an earlier try of this append landed, the sequence of its last event, else 0.

        Look at the message right after the first item's expected sequence on its subject:
        the expectation guarantees nothing else could be there if ours landed. (The heads
        of the subjects may have moved on since: the scheduler reacts within milliseconds.)
        A batch is atomic and contiguous, so the first landing means all of it did.
        """
        first = items[0]
        req = {"seq": first.expected + 1, "next_by_subj": first.subject}
        msg = await self.nc.request(
            f"$JS.API.DIRECT.GET.{self.stream}", json.dumps(req).encode(), timeout=self.timeout
        )
        hdrs = msg.headers or {}
        if hdrs.get("Status") or hdrs.get("Nats-Msg-Id") != ids[0]:
            return 0
        return int(hdrs["Nats-Sequence"]) + len(items) - 1

    async def _send(self, items: list[Append], ids: list[str]) -> _Ack:
        if len(items) == 1:
            it = items[0]
            msg = await self.nc.request(
                it.subject,
                encode(it.event),
                headers=_headers(it, ids[0], {}),
                timeout=self.timeout,
            )
            return _ack_decoder.decode(msg.data)
        batch = uuid.uuid4().hex
        n = len(items)
        for i, (it, mid) in enumerate(zip(items, ids, strict=True), 1):
            extra = {"Nats-Batch-Id": batch, "Nats-Batch-Sequence": str(i)}
            if i < n:
                await self.nc.publish(
                    it.subject, encode(it.event), headers=_headers(it, mid, extra)
                )
                continue
            extra["Nats-Batch-Commit"] = "1"
            msg = await self.nc.request(
                it.subject,
                encode(it.event),
                headers=_headers(it, mid, extra),
                timeout=self.timeout,
            )
            return _ack_decoder.decode(msg.data)
        raise AssertionError("unreachable")


def _parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    # Nanosecond RFC 3339; Python keeps microseconds.
    head, _, frac = value.rstrip("Z").partition(".")
    iso = f"{head}.{(frac + '000000')[:6]}+00:00" if frac else f"{head}+00:00"
    return datetime.fromisoformat(iso)


async def wait_for_stream(nc: NATS, stream: str = EVENTS, timeout: float = 30) -> None:
    """Wait until JetStream answers for the stream (a restarted server needs a moment)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            await nc.request(f"$JS.API.STREAM.INFO.{stream}", b"", timeout=2)
            return
        except Exception:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.2)
