"""The heartbeat board: RP_HEARTBEATS, one message per active phase on `rp.hb.<run>.<phase>`.

The stream keeps the last message per subject, so the stream *is* the list of phases
someone should be watching. The last message on a subject is the phase's latest sign of
life: an executor's beat (`lease_id` set), the scheduler's beat on a fresh lease's behalf
(`kind: claimed`), or the scheduler's `dispatched` marker while nobody has claimed the
phase yet (`lease_id` empty). Each body says after how many silent seconds it is stale
(`timeout`), so a reader needs no other lookup while all is well.

Ages are measured on the server's clock only. Every message carries its receipt time
(`Nats-Time-Stamp`, set by the stream's leader), and a reader learns the server's "now"
by publishing a clock message and reading it back with the board: neither the executor's
`at` nor the reader's own clock enters the comparison, so clock skew between hosts cannot
reap a live executor or spare a dead one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from datetime import UTC, datetime
from typing import Any, Protocol
from weakref import WeakKeyDictionary

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from events import wire
from events.templates import valid_phase
from events.wire import CLAIMED as CLAIMED  # re-exported: the board's kinds
from events.wire import DEADLINE as DEADLINE
from events.wire import DISPATCHED as DISPATCHED
from events.wire import Heartbeat
from infra.directget import DirectReader, InfraError, leader_get
from infra.streams import HEARTBEATS, WRONG_LAST_SEQUENCES

PHASES = ("plan", "apply")
# `rp.hb.<run>.deadline` (DEADLINE): when the run's limits pass
# (services/processes/scheduler/limits.py).
CLOCK_SUBJECT = "rp.hb._clock.now"
# Small pages, and a pause every few entries parsed: a board of thousands of entries is
# read in slices, so the scheduler sharing the process never waits for a whole read (at
# about 25 us per entry, a 1,000-entry page parsed at once held it for 25 ms).
_PAGE = 200
_YIELD_EVERY = 50
_READS = 5  # board reads per snapshot before giving up on finding the clock message
# How often a `Follower` asks which subjects the board still has (purges by others).
RECONCILE_S = 10.0


class BoardError(InfraError):
    """The heartbeat stream could not be read or written; worth retrying."""


Body = Heartbeat  # the board entry's body (events/wire.py)


class Beat(msgspec.Struct, frozen=True, kw_only=True):
    """The last message on one phase's subject, with its place and server time."""

    subject: str
    seq: int
    time: datetime
    run_id: str
    phase: str
    body: Body

    @property
    def lease_id(self) -> str:
        return self.body.lease_id


def subject(run_id: str, phase: str) -> str:
    return f"rp.hb.{run_id}.{phase}"


def body(**fields: Any) -> bytes:
    """Encode a heartbeat body from its fields (`events.wire.Heartbeat`'s)."""
    return wire.encode(Heartbeat(**fields))


def beat_interval(configured: float, timeout: int) -> float:
    """How often to beat: as configured, but at least three beats per heartbeat timeout."""
    return min(configured, timeout / 3) if timeout > 0 else configured


def server_time(value: str) -> datetime:
    """Parse `Nats-Time-Stamp` (RFC 3339 with nanoseconds); microseconds are kept."""
    head, _, frac = value.rstrip("Z").partition(".")
    return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}").replace(tzinfo=UTC)


def parse(hdrs: dict[str, str], data: bytes) -> Beat | None:
    """A board message as a Beat; None for the clock and anything not `rp.hb.<run>.<phase>`."""
    return beat_of(
        hdrs["Nats-Subject"],
        int(hdrs["Nats-Sequence"]),
        server_time(hdrs["Nats-Time-Stamp"]),
        data,
    )


def beat_of(subj: str, seq: int, at: datetime, data: bytes) -> Beat | None:
    """A board message as a Beat, from its subject, sequence and server time."""
    parts = subj.split(".")
    if len(parts) != 4 or parts[2].startswith("_"):
        return None
    if parts[3] != DEADLINE and not valid_phase(parts[3]):
        return None
    try:
        decoded = wire.decode_heartbeat(data)
    except wire.WireError:
        decoded = Heartbeat(kind="unreadable")
    return Beat(subject=subj, seq=seq, time=at, run_id=parts[2], phase=parts[3], body=decoded)


class Board:
    """Read and write the heartbeat stream."""

    def __init__(self, nc: NATS, *, stream: str = HEARTBEATS, timeout: float = 5.0) -> None:
        self.nc = nc
        self.stream = stream
        self.timeout = timeout

    async def snapshot(self) -> tuple[datetime, list[Beat]]:
        """The server's time now and every phase's last message.

        The clock message, published first, is read back last: a board read without it
        was answered (in part) by a follower that is behind, and is read again. (Pages
        may still come from different replicas: a verdict is checked against the
        leader's copy of its entry before it is acted on, `last(..., leader=True)`.)
        """
        await self.put(CLOCK_SUBJECT, b"")
        for _ in range(_READS):
            try:
                return await self._read_board()
            except BoardError as e:
                error = e
        raise error

    async def _read_board(self) -> tuple[datetime, list[Beat]]:
        now: datetime | None = None
        beats: list[Beat] = []
        start = 1
        while True:
            page = await self._page(start)
            for i, (hdrs, data) in enumerate(page, 1):
                if hdrs["Nats-Subject"] == CLOCK_SUBJECT:
                    now = server_time(hdrs["Nats-Time-Stamp"])
                elif (beat := parse(hdrs, data)) is not None:
                    beats.append(beat)
                if i % _YIELD_EVERY == 0:  # the process's other work goes on meanwhile
                    await asyncio.sleep(0)
            if len(page) < _PAGE:
                break
            start = int(page[-1][0]["Nats-Sequence"]) + 1
        if now is None:
            raise BoardError("the clock message was not read back")
        return now, beats

    async def _page(self, start: int) -> list[tuple[dict[str, str], bytes]]:
        """One batched direct get of up to `_PAGE` messages from sequence `start`, kept
        unparsed: the caller parses them in slices."""
        req = {"seq": start, "next_by_subj": "rp.hb.>", "batch": _PAGE}
        page, _ = await DirectReader.of(self.nc).batch(
            self.stream, req, _unparsed, what="heartbeats", error=BoardError, timeout=self.timeout
        )
        return page

    async def last(self, run_id: str, phase: str, *, leader: bool = False) -> Beat | None:
        """The last message on one phase's subject, if any; with `leader`, as the stream's
        leader has it (a direct get may be answered by a follower that is behind)."""
        subj = subject(run_id, phase)
        if leader:
            return await leader_get(
                self.nc,
                self.stream,
                parse,
                subject=subj,
                what=subj,
                error=BoardError,
                timeout=self.timeout,
            )
        return await DirectReader.of(self.nc).last(
            self.stream, subj, parse, what=subj, error=BoardError, timeout=self.timeout
        )

    async def put(self, subj: str, data: bytes, *, expected: int | None = None) -> bool:
        """Publish; with `expected`, only if the subject's last sequence is still that one
        (0: the subject is empty). False when that expectation failed."""
        return await self.publish(subj, data, expected=expected) > 0

    async def publish(self, subj: str, data: bytes, *, expected: int | None = None) -> int:
        """`put`, answering the stored message's sequence (0: the expectation failed). The
        watchers of the board in this process hear of the write at once (`Watcher.wrote`)."""
        headers = {} if expected is None else {"Nats-Expected-Last-Subject-Sequence": str(expected)}
        try:
            msg = await self.nc.request(subj, data, headers=headers, timeout=self.timeout)
        except TimeoutError as e:
            raise BoardError(f"publishing on {subj} timed out") from e
        try:
            ack = msgspec.json.decode(msg.data, type=_Ack)
        except msgspec.DecodeError as e:
            raise BoardError(f"publishing on {subj}: an unreadable answer") from e
        if ack.error is None:
            for watcher in list(_watchers.get(self.nc, ())):
                watcher.wrote(subj, ack.seq)
            return ack.seq
        if ack.error.err_code in WRONG_LAST_SEQUENCES:
            return 0
        raise BoardError(f"publishing on {subj}: {ack.error.description}")

    async def purge(self, subj: str, *, through: int | None = None) -> None:
        """Drop a subject's messages (only up to sequence `through`, if given). The
        watchers of the board in this process forget them at once (a purge is no message
        their consumer would see)."""
        req: dict[str, Any] = {"filter": subj}
        if through is not None:
            req["seq"] = through + 1  # the server purges below `seq`
        api = f"$JS.API.STREAM.PURGE.{self.stream}"
        try:
            resp = await self.nc.request(api, json.dumps(req).encode(), timeout=self.timeout)
        except TimeoutError as e:
            raise BoardError(f"purging {subj} timed out") from e
        if "error" in (answer := json.loads(resp.data)):
            raise BoardError(f"purging {subj}: {answer['error'].get('description')}")
        for watcher in list(_watchers.get(self.nc, ())):
            watcher.forget(subj, through)


def _unparsed(hdrs: dict[str, str], data: bytes) -> tuple[dict[str, str], bytes]:
    return hdrs, data


class _AckError(msgspec.Struct, frozen=True):
    err_code: int = 0
    description: str = ""


class _Ack(msgspec.Struct, frozen=True):
    seq: int = 0
    error: _AckError | None = None


class Watcher(Protocol):
    """A fold of the board in this process that hears of the writes and purges made
    through the same connection as soon as they are answered (`watch`)."""

    def wrote(self, subj: str, seq: int) -> None:
        """A message was stored on `subj` at stream sequence `seq`."""

    def forget(self, subj: str, through: int | None) -> None:
        """`subj` was purged (only up to sequence `through`, if given)."""


_watchers: WeakKeyDictionary[NATS, set[Watcher]] = WeakKeyDictionary()


def watch(nc: NATS, watcher: Watcher) -> None:
    """Tell `watcher` of every board write and purge made through `nc` from now on."""
    _watchers.setdefault(nc, set()).add(watcher)


def unwatch(nc: NATS, watcher: Watcher) -> None:
    _watchers.get(nc, set()).discard(watcher)


class Follower:
    """The board kept in memory by an ordered consumer on its stream, so that reading it
    costs what changed since the last read, not a read of every entry.

    The stream keeps one message per subject: a consumer from its start delivers the
    board as it is, then every beat and marker written since, in stream order. A
    `snapshot` publishes a clock message and waits until the consumer has delivered it:
    everything stored before it has been folded, and its server time is `now` (as
    `Board.snapshot`, whose guarantee it keeps: a follower behind cannot hide an entry).

    A purge is no message: the purges of this process's boards reach the fold at once
    (`Board.purge`), those of other processes (another scheduler replica, a reaper) by
    a listing of the stream's subjects every `reconcile_s` (answered by the stream's
    leader: one answer, no message per entry). An entry shown meanwhile is harmless:
    whatever it is judged to need is checked against the leader's copy first.
    """

    def __init__(self, board: Board, *, reconcile_s: float = RECONCILE_S) -> None:
        self.board = board
        self.reconcile_s = reconcile_s
        self.entries: dict[str, Beat] = {}
        self._now: datetime | None = None  # the server time of the last clock message
        self._seen = 0  # the stream sequence of the last message folded
        self._clock = 0  # the stream sequence of the last clock message folded
        self._waiting: dict[int, asyncio.Future[None]] = {}
        self._sub: Any = None
        self._reconciled = -reconcile_s
        self._n = 0

    async def start(self) -> None:
        if self._sub is not None:
            return
        js = self.board.nc.jetstream(timeout=self.board.timeout)
        self._sub = await js.subscribe(
            "rp.hb.>", stream=self.board.stream, ordered_consumer=True, cb=self._on
        )
        watch(self.board.nc, self)

    async def stop(self) -> None:
        unwatch(self.board.nc, self)
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):  # a closed connection has no subscription
                await sub.unsubscribe()

    async def snapshot(self) -> tuple[datetime, list[Beat]]:
        """The server's time now and every phase's last message (see the class)."""
        await self.start()
        seq = await self.board.publish(CLOCK_SUBJECT, b"")
        if self._clock < seq:  # ours, or a newer one (another reaper's) that replaced it
            done = self._waiting.setdefault(seq, asyncio.get_running_loop().create_future())
            try:
                await asyncio.wait_for(asyncio.shield(done), self.board.timeout)
            except TimeoutError as e:
                # (e.g. its server restarted: the consumer is gone, and nats-py would
                # notice only after two missed idle heartbeats.) Folded again from the
                # start at the next snapshot.
                await self._restart()
                raise BoardError("the board's consumer did not deliver the clock message") from e
            finally:
                self._waiting.pop(seq, None)
        loop = asyncio.get_running_loop()
        if loop.time() - self._reconciled >= self.reconcile_s:
            await self._reconcile()
            self._reconciled = loop.time()
        if self._now is None:
            raise BoardError("the clock message was not read back")
        return self._now, list(self.entries.values())

    async def _restart(self) -> None:
        await self.stop()
        self.entries.clear()
        self._now, self._seen, self._clock = None, 0, 0

    def wrote(self, subj: str, seq: int) -> None:
        """Nothing to do: a snapshot waits for its clock message, which comes later."""

    def forget(self, subj: str, through: int | None) -> None:
        """A subject purged (up to `through`): drop what the fold holds of it."""
        entry = self.entries.get(subj)
        if entry is not None and (through is None or entry.seq <= through):
            del self.entries[subj]

    async def _reconcile(self) -> None:
        """Drop entries purged by other processes: those folded before the listing was
        asked for whose subject the stream no longer has."""
        before = self._seen
        listed = await subjects(self.board)
        for subj, entry in list(self.entries.items()):
            if entry.seq <= before and subj not in listed:
                del self.entries[subj]

    async def _on(self, msg: Msg) -> None:
        seq, at = _stored(msg)
        self._seen = seq
        if msg.subject == CLOCK_SUBJECT:
            self._now, self._clock = at, seq
            for want in [s for s in self._waiting if s <= seq]:
                if not (done := self._waiting.pop(want)).done():
                    done.set_result(None)
        elif (beat := beat_of(msg.subject, seq, at, msg.data)) is not None:
            self.entries[msg.subject] = beat
        self._n += 1
        if self._n % _YIELD_EVERY == 0:  # a big board's first delivery: others go on
            await asyncio.sleep(0)


def _stored(msg: Msg) -> tuple[int, datetime]:
    """A delivered message's stream sequence and server time, from its reply subject, to
    the microsecond as a direct get's `Nats-Time-Stamp` gives it (nats-py's metadata
    goes through a float, which may differ by one)."""
    tokens = msg.reply.split(".")
    if len(tokens) == 9:  # $JS.ACK.<stream>.<consumer>.<delivered>.<seq>.<cseq>.<ns>.<pending>
        seq, at = int(tokens[5]), int(tokens[7])
    else:  # with the domain and account hash
        seq, at = int(tokens[Msg.Ack.StreamSeq]), int(tokens[Msg.Ack.Timestamp])
    return seq, stored_time(at)


def stored_time(ns: int) -> datetime:
    """A message's server receipt time from nanoseconds since the epoch, to the
    microsecond as a direct get's `Nats-Time-Stamp` gives it (`server_time`)."""
    sec, ns = divmod(ns, 1_000_000_000)
    return datetime.fromtimestamp(sec, UTC).replace(microsecond=ns // 1000)


async def subjects(board: Board) -> set[str]:
    """Every subject the board's stream holds, from its leader (stream info, paged)."""
    api = f"$JS.API.STREAM.INFO.{board.stream}"
    out: set[str] = set()
    while True:
        req = msgspec.json.encode({"subjects_filter": "rp.hb.>", "offset": len(out)})
        try:
            resp = await board.nc.request(api, req, timeout=board.timeout)
            info = msgspec.json.decode(resp.data, type=_Info)
        except (TimeoutError, nats.errors.Error, msgspec.DecodeError) as e:
            raise BoardError(f"listing the board's subjects: {e!r}") from e
        if info.error is not None:
            raise BoardError(f"listing the board's subjects: {info.error.description}")
        page = info.state.subjects or {}
        out.update(page)
        if not page or len(out) >= info.total:
            return out


class _State(msgspec.Struct, frozen=True):
    subjects: dict[str, int] | None = None


class _Info(msgspec.Struct, frozen=True):
    state: _State = _State()
    total: int = 0
    error: _AckError | None = None
