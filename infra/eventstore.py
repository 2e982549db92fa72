"""The event store on JetStream: read a subject's events, append with optimistic concurrency.

Reads use batched direct gets (one request, many replies) on the subject index, so loading a
run costs one round trip; the replies of every read come to one wildcard inbox subscription
per store (its `DirectReader`, infra/directget.py). Appends carry
`Nats-Expected-Last-Subject-Sequence` and `Nats-Msg-Id`; several events of one decision go in
one atomic batch (server 2.12+).

On a cluster a direct get may be answered by a follower that is behind (the server in the
wheel, 2.15, has no `min_last_seq` on direct gets: it ignores the field). A read a
decision is made on therefore names the sequence it must be at least as new as (`floor`,
set per message or round by its caller, or `min_seq`): a read whose last event is at or
past it is proven fresh; any other is finished by the stream's leader
(`$JS.API.STREAM.MSG.GET`, which only the leader answers), which adds what the follower
did not have.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import time
import uuid
from datetime import datetime

import msgspec
import nats.errors
from nats.aio.client import Client as NATS

from events.codec import AnyEvent, decode, encode, tag_of
from events.errors import Conflict
from infra import origin, tracing
from infra.directget import DirectReader, InfraError, leader_get, leader_last_seq
from infra.streams import EVENTS, WRONG_LAST_SEQUENCES

_BATCH = 1000
# How often a store asks again how many replicas its stream has: one replica has no
# follower to lag, so its direct gets need no leader's word (raised replication is seen
# within this long).
REPLICAS_RECHECK_S = 30.0
BATCH_DUPLICATE_ID = 10201
NO_MESSAGE_FOUND = 10037
# An append that finds no stream leader (its server was killed; the election took 1 to
# 6 s on a 3-node cluster) is sent again every NO_LEADER_PAUSE_S for up to
# NO_LEADER_WAIT_S: before, the raw NoRespondersError crashed an executor's apply phase,
# its failure report too, and the run stayed `applying` with no owner until the
# heartbeat timeout (600 s), its new state on disk until the executor's next start.
NO_LEADER_WAIT_S = 30.0
NO_LEADER_PAUSE_S = 0.25
# A `min_seq` no read proves by itself: the leader is asked whether anything is newer.
LATEST = 2**63 - 1
# The stream sequence a decision's reads must be at least as new as: the event that woke
# the scheduler, the round of the reaper, the dispatch an executor claims. Per task.
floor: contextvars.ContextVar[int] = contextvars.ContextVar("eventstore_floor", default=0)


class StoreError(InfraError):
    """The event store could not do what was asked; `retryable` says whether to try again."""


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


def _headers(
    item: Append, msg_id: str, extra: dict[str, str], *, check: bool = True
) -> dict[str, str]:
    headers = {"Nats-Msg-Id": msg_id, "Rp-Type": tag_of(item.event), **origin.headers(), **extra}
    tracing.inject(headers)  # the writer's trace: its request, phase or delivery
    if check:
        headers["Nats-Expected-Last-Subject-Sequence"] = str(item.expected)
    return headers


class EventStore:
    """Read and append events of the RP_EVENTS stream."""

    def __init__(
        self,
        nc: NATS,
        *,
        stream: str = EVENTS,
        timeout: float = 5.0,
    ) -> None:
        self.nc = nc
        self.stream = stream
        self.timeout = timeout
        self._replicated = True  # until asked: a follower may answer
        self._replicas_at = -REPLICAS_RECHECK_S
        self._asking = asyncio.Lock()
        # This store's reads share one wildcard inbox subscription (infra/directget.py).
        self.direct = DirectReader(nc, timeout=timeout)

    # ------------------------------------------------------------ reading

    async def read(self, subject: str, after: int = 0, *, min_seq: int = 0) -> list[Envelope]:
        """Every event on `subject` (wildcards allowed) with a sequence above `after`, as
        of a stream at least at `min_seq` (or the task's `floor`, whichever is higher).

        Nothing is kept here: infra/folds.py keeps aggregates as folded, and asks only for
        what is after the state it has. A caller that has read through `after` has proven
        the stream at least that far already.
        """
        need = max(min_seq, floor.get())
        return await self._fetch(subject, after + 1, 0 if after >= need else need)

    async def _fetch(self, subject: str, start: int, need: int) -> list[Envelope]:
        """The events from `start` on, by direct gets; finished by the leader unless the
        last one read proves the answering replica was at `need` (module docstring)."""
        out = await self._direct(subject, start)
        if need and (not out or out[-1].seq < need) and await self._has_followers():
            out.extend(await self._leader_tail(subject, out[-1].seq + 1 if out else start))
        return out

    async def _has_followers(self) -> bool:
        """Whether the stream has replicas that may answer a direct get behind the leader
        (asked every `REPLICAS_RECHECK_S`; when the answer is not known, yes)."""
        if time.monotonic() - self._replicas_at < REPLICAS_RECHECK_S:
            return self._replicated
        async with self._asking:
            if time.monotonic() - self._replicas_at >= REPLICAS_RECHECK_S:
                try:
                    info = await self.nc.jetstream(timeout=self.timeout).stream_info(self.stream)
                    self._replicated = (info.config.num_replicas or 1) > 1
                except (TimeoutError, nats.errors.Error):
                    self._replicated = True
                self._replicas_at = time.monotonic()
        return self._replicated

    async def _leader_tail(self, subject: str, start: int, most: int = 0) -> list[Envelope]:
        """What the stream's leader has on `subject` from `start` on (usually nothing:
        one round trip proves a follower's answer complete)."""
        out: list[Envelope] = []
        while True:
            env = await leader_get(
                self.nc,
                self.stream,
                _envelope,
                subject=subject,
                seq=start,
                what=subject,
                error=StoreError,
                timeout=self.timeout,
            )
            if env is None:
                return out
            out.append(env)
            if len(out) == most:
                return out
            start = env.seq + 1

    async def _direct(self, subject: str, start: int) -> list[Envelope]:
        out: list[Envelope] = []
        while True:
            page = await self._direct_batch(subject, start)
            out.extend(page)
            if len(page) < _BATCH:
                return out
            start = page[-1].seq + 1

    async def _direct_batch(self, subject: str, start: int) -> list[Envelope]:
        req = {"seq": start, "next_by_subj": subject, "batch": _BATCH}
        page, _ = await self.direct.batch(
            self.stream, req, _envelope, what=subject, error=StoreError, timeout=self.timeout
        )
        return page

    async def last(self, subject: str) -> tuple[int, str]:
        """The sequence and msg id of the last message on an exact subject (0, "" if none)."""
        found = await self.direct.last(
            self.stream, subject, _seq_and_id, what=subject, error=StoreError
        )
        return found or (0, "")

    async def last_seq_of(self, subject: str) -> int:
        """The sequence of the last message on an exact subject (0 if none), as the stream's
        leader has it: at or past every acknowledged append. (`last` is a direct get, which
        any replica may answer, maybe one that is behind.)"""
        req = json.dumps({"last_by_subj": subject}).encode()
        resp = await self.nc.request(
            f"$JS.API.STREAM.MSG.GET.{self.stream}", req, timeout=self.timeout
        )
        body = json.loads(resp.data)
        error = body.get("error")
        if error is None:
            return int(body["message"]["seq"])
        if error.get("err_code") == NO_MESSAGE_FOUND:
            return 0
        raise StoreError(f"message get failed: {error.get('description')}")

    async def last_seq(self) -> int:
        """The stream's last sequence: what a fully caught-up reader has seen."""
        return await leader_last_seq(self.nc, self.stream, error=StoreError, timeout=self.timeout)

    # ------------------------------------------------------------ appending

    async def append(self, items: list[Append], *, attempts: int = 3) -> int:
        """Append all items atomically; return the sequence of the last one.

        Raises Conflict when another writer moved one of the subjects first. A retry
        after a lost acknowledgement re-sends the same msg ids; if the first try landed,
        the head of the subject carries our msg id and the append counts as done.
        """
        if not items:
            raise ValueError("nothing to append")
        ids = [it.msg_id or uuid.uuid4().hex for it in items]
        last_err: Exception | None = None
        tries, leaderless_since = 0, 0.0
        while tries < attempts:
            try:
                ack = await self._send(items, ids)
            except nats.errors.NoRespondersError as e:
                # The stream has no leader for a moment (its server died: an election
                # takes seconds). Nothing was stored; the same msg ids are sent again.
                last_err = e
                leaderless_since = leaderless_since or time.monotonic()
                if time.monotonic() - leaderless_since > NO_LEADER_WAIT_S:
                    raise StoreError("append: the stream has no leader") from e
                await asyncio.sleep(NO_LEADER_PAUSE_S)
                continue
            except TimeoutError as e:  # the first try may have landed: look before retrying
                tries += 1
                last_err = e
                landed = await self._landed(items, ids)
                if landed:
                    return landed
                continue
            err = ack.error
            if err is None:
                return ack.seq
            if err.err_code in WRONG_LAST_SEQUENCES or err.err_code == BATCH_DUPLICATE_ID:
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
        Asked of the stream's leader: a follower behind would say "not landed" and have
        the caller decide again on top of its own event.
        """
        first = items[0]
        tail = await self._leader_tail(first.subject, first.expected + 1, most=1)
        if not tail or tail[0].msg_id != ids[0]:
            return 0
        return tail[0].seq + len(items) - 1

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
        # Within a batch only a subject's first event may carry the expected sequence (the
        # server refuses one on a later event of the same subject, whatever its value);
        # the batch is atomic, so that first check guards the subject's other events.
        seen: set[str] = set()
        for i, (it, mid) in enumerate(zip(items, ids, strict=True), 1):
            extra = {"Nats-Batch-Id": batch, "Nats-Batch-Sequence": str(i)}
            headers = _headers(it, mid, extra, check=it.subject not in seen)
            seen.add(it.subject)
            if i < n:
                await self.nc.publish(it.subject, encode(it.event), headers=headers)
                continue
            headers["Nats-Batch-Commit"] = "1"
            msg = await self.nc.request(
                it.subject,
                encode(it.event),
                headers=headers,
                timeout=self.timeout,
            )
            return _ack_decoder.decode(msg.data)
        raise AssertionError("unreachable")


def _envelope(hdrs: dict[str, str], data: bytes) -> Envelope:
    """A stored event from a direct get's (or the leader's) reply."""
    return Envelope(
        seq=int(hdrs["Nats-Sequence"]),
        subject=hdrs["Nats-Subject"],
        msg_id=hdrs.get("Nats-Msg-Id", ""),
        time=_parse_time(hdrs.get("Nats-Time-Stamp")),
        event=decode(data),
    )


def _seq_and_id(hdrs: dict[str, str], data: bytes) -> tuple[int, str]:
    return int(hdrs["Nats-Sequence"]), hdrs.get("Nats-Msg-Id", "")


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
