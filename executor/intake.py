"""Taking work: a pool's dispatch messages, organizations in turn, and the claim of each.

The claim (`ClaimPhase`, an optimistic append on the run) decides who runs a phase; the
message is deleted once the claim is decided either way (executor/worker.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import msgspec
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from events import wire
from events.errors import DomainError
from events.run import ClaimPhase, FailRun, RunState
from events.wire import Dispatch
from executor.job import Job
from executor.ports import RunLedger
from executor.turns import Slots, Turns, Waiting
from infra.ids import new_id
from infra.streams import DISPATCH, delete_dispatch, dispatch_subject, pool_subjects

log = structlog.get_logger(__name__)

LEGACY_EVERY = 60.0  # seconds between looks at the pool's subject of older versions

# A claimed phase's Job: its directory and identity (the executor's `_job`).
StartJob = Callable[[Dispatch, str, RunState], Job]


class _ApiError(msgspec.Struct, frozen=True):
    code: int = 0
    err_code: int = 0
    description: str = ""


class _Counts(msgspec.Struct, frozen=True):
    subjects: dict[str, int] | None = None


class _Info(msgspec.Struct, frozen=True):
    """What a pool's count needs of a stream info: the messages by subject."""

    state: _Counts | None = None
    error: _ApiError | None = None


_info = msgspec.json.Decoder(_Info)


async def waiting_by_subject(nc: NATS, subjects: str, timeout: float = 5.0) -> dict[str, int]:
    """The dispatch stream's messages by subject among `subjects` (a filter), as its
    leader counts them: a stream info decoded for its counts alone (nats-py's
    `stream_info` builds the whole configuration each time, twice the CPU)."""
    req = msgspec.json.encode({"subjects_filter": subjects})
    reply = await nc.request(f"$JS.API.STREAM.INFO.{DISPATCH}", req, timeout=timeout)
    info = _info.decode(reply.data)
    if info.error is not None:
        raise nats.js.errors.APIError.from_error(msgspec.structs.asdict(info.error))
    return dict(info.state.subjects or {}) if info.state is not None else {}


class Taken(msgspec.Struct, frozen=True):
    """A dispatch message as read from the pool's queue: it stays there until the claim
    it calls for is decided (`Intake.claim`), so an executor killed before then leaves
    it to the next."""

    seq: int
    org: str
    data: bytes
    headers: dict[str, str]


class Intake:
    """The dispatched phases of one pool, taken one at a time, organizations in turn.

    Each organization's phases wait on a subject of their own (`rp.dispatch.<pool>.<org>`,
    infra/streams.py); when this executor has room it counts them by subject, asks its
    `Turns` (executor/turns.py) whose turn it is, reads that organization's oldest
    message from the stream's leader and claims its phase under a fresh lease. The claim
    decides; the message is deleted once it is decided either way. Executors of a pool
    racing for one message both try to claim it and the loser moves on. A plain
    subscription to the pool's subjects wakes a waiting executor as soon as one is
    published. Once `stopping` is set, nothing more is taken."""

    def __init__(
        self,
        js: JetStreamContext,
        app: RunLedger,
        pool: str,
        executor_id: str,
        stopping: asyncio.Event,
        fetch_timeout: float,
        nc: NATS,
        turns: Turns | None = None,
        slots: Slots | None = None,
    ) -> None:
        self.js = js
        self.nc = nc
        self.app = app
        self.pool = pool
        self.executor_id = executor_id
        self._stopping = stopping
        self.fetch_timeout = fetch_timeout
        self.turns = turns or Turns()
        self.slots = slots or Slots()
        self._wake = asyncio.Event()
        self._subs: list[Subscription] = []
        self._held: set[int] = set()  # taken here, their claims not yet decided
        self._later: dict[int, float] = {}  # not before (loop time), after a retryable refusal
        self._legacy_at = -LEGACY_EVERY
        # An apply planned by another executor is left to it this long (executor/warm.py)
        self.warm_wait = 0.0
        self._first_seen: dict[int, float] = {}  # such applies: when this one first saw each

    async def open(self) -> None:
        """Listen for the pool's dispatches (a wake-up only: the stream is the truth)."""

        async def wake(_: Msg) -> None:
            self._wake.set()

        for subject in (dispatch_subject(self.pool), pool_subjects(self.pool)):
            self._subs.append(await self.nc.subscribe(subject, cb=wake))

    async def close(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs.clear()

    async def next(self) -> Taken | None:
        """The next phase to claim, organizations in turn; None when there was none
        within `fetch_timeout` (or we are stopping)."""
        if self._stopping.is_set():
            return None
        self._wake.clear()  # before the read: a dispatch published after it wakes us
        try:
            taken = await self._take()
        except Exception as e:  # keep taking work through broker hiccups
            log.warning("fetch_failed", error=repr(e))
            await asyncio.sleep(1)
            return None
        if taken is None and not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._pause())
            return None
        if taken is not None and self._stopping.is_set():
            self._held.discard(taken.seq)  # left where it is, for another executor
            self.slots.gave_back(taken.org)
            return None
        return taken

    def _pause(self) -> float:
        now = asyncio.get_running_loop().time()
        self._later = {s: t for s, t in self._later.items() if t > now}
        soonest = min(self._later.values(), default=now + self.fetch_timeout)
        return max(0.05, min(self.fetch_timeout, soonest - now))

    async def _waiting(self, now: float) -> Waiting:
        """This pool's waiting phases by organization (only its own subjects: another
        pool's, however many, cost nothing here); the pool's own subject, of versions
        before organizations took turns, looked at once every LEGACY_EVERY seconds."""
        subjects = await waiting_by_subject(self.nc, pool_subjects(self.pool))
        if now - self._legacy_at >= LEGACY_EVERY:
            self._legacy_at = now
            subjects.update(await waiting_by_subject(self.nc, dispatch_subject(self.pool)))
        return Waiting.of(subjects, dispatch_subject(self.pool))

    async def _take(self) -> Taken | None:
        now = asyncio.get_running_loop().time()
        waiting = await self._waiting(now)
        self.slots.saw(waiting.counts, now)
        for org in self.turns.order(waiting.counts):
            if org and not self.slots.room(org, now):
                continue
            taken = await self._oldest(org)
            if taken is not None:
                self.turns.served(org)
                self.slots.took(org)  # until `finished`, or given back if not claimed
                self._held.add(taken.seq)
                return taken
        return None

    async def _oldest(self, org: str) -> Taken | None:
        """The organization's oldest message not in hand here nor put off."""
        subject = dispatch_subject(self.pool, org) if org else dispatch_subject(self.pool)
        now = asyncio.get_running_loop().time()
        self._later = {s: t for s, t in self._later.items() if t > now}
        seq = 1
        while True:
            try:
                got = await self.js.get_msg(DISPATCH, seq=seq, subject=subject, next=True)
            except nats.js.errors.NotFoundError:
                return None
            at = got.seq or seq
            if at in self._held or at in self._later or self._planners(at, got.data, now):
                seq = at + 1
                continue
            return Taken(at, org, got.data or b"", dict(got.headers or {}))

    def _planners(self, seq: int, data: bytes | None, now: float) -> bool:
        """True if the message is an apply another executor planned and may hold warm,
        first seen here less than `warm_wait` ago: put off until then (the planner, free
        meanwhile, takes it without a second clone and init; gone or busy, we do)."""
        if self.warm_wait <= 0 or not data or b'"planner"' not in data:
            return False
        try:
            d = wire.decode_dispatch(data)
        except ValueError:
            return False
        if d.phase != "apply" or d.planner in ("", self.executor_id):
            return False
        self._first_seen = {s: t for s, t in self._first_seen.items() if now - t < 600}
        due = self._first_seen.setdefault(seq, now) + self.warm_wait
        if due <= now:
            return False
        self._later[seq] = due
        return True

    async def drop(self, taken: Taken) -> None:
        """Delete a message (its claim is decided, or it is not a dispatch); held here
        until it is gone, so this executor does not take it twice meanwhile. Never
        raises: a message left behind is refused its claim next time, then deleted."""
        try:
            await delete_dispatch(self.nc, taken.seq)
        except Exception as e:
            log.warning("dispatch_not_deleted", error=repr(e))
        finally:
            self._held.discard(taken.seq)

    def finished(self, taken: Taken) -> None:
        """What `next` returned is done with (its claim refused, or its phase ended): its
        organization's slot here is free again."""
        self.slots.gave_back(taken.org)
        self._wake.set()

    def _put_off(self, taken: Taken, delay: float) -> None:
        self._held.discard(taken.seq)
        self._later[taken.seq] = asyncio.get_running_loop().time() + delay

    async def claim(self, taken: Taken, d: Dispatch, start: StartJob) -> Job | None:
        """Claim the phase under a fresh lease; delete the message whatever the claim
        decided (a retryable refusal puts it off instead). `start` makes the claimed
        phase's Job."""
        try:
            return await self._claim(taken, d, start)
        finally:  # decided, put off, or cancelled: no longer in hand
            self._held.discard(taken.seq)

    async def _claim(self, taken: Taken, d: Dispatch, start: StartJob) -> Job | None:
        try:
            claimed = await self._claimed(d)
        except DomainError as e:
            if e.retryable:
                self._put_off(taken, 1)
                return None
            log.info("dispatch_dropped", why=e.code, detail=str(e))
            await self.drop(taken)
            return None
        except Exception as e:
            log.warning("claim_failed_will_retry", error=repr(e))
            self._put_off(taken, 2)
            return None
        await self.drop(taken)  # the claim is ours even if this delete is lost: run it
        return await self._started(d, claimed, start)

    async def claim_next(self, d: Dispatch, start: StartJob) -> Job | None:
        """Claim at once the phase `d` of a run whose previous phase just ended here and
        left it waiting (a plan that needs no approval, then its apply): no round trip
        through the scheduler's dispatch and the pool's queue. Only while no other
        organization's phases wait in the pool (their turn would come first, as
        executor/turns.py has it) and we are not stopping. The dispatch the scheduler
        publishes meanwhile finds the phase claimed and is dropped (`_claim`), whichever
        executor takes it. None: not claimed here; the phase goes the usual way."""
        if self._stopping.is_set():
            return None
        try:
            waiting = await self._waiting(asyncio.get_running_loop().time())
            if any(org != d.org and n > 0 for org, n in waiting.counts.items()):
                return None
            claimed = await self._claimed(d)
        except DomainError as e:  # claimed by another, or no longer waiting: theirs
            log.info("next_phase_not_claimed", why=e.code, detail=str(e))
            return None
        except Exception as e:  # the dispatch brings it back
            log.warning("next_phase_not_claimed", error=repr(e))
            return None
        return await self._started(d, claimed, start)

    async def _claimed(self, d: Dispatch) -> tuple[str, RunState]:
        """Append the claim of `d`'s phase under a fresh lease: (lease, the run then)."""
        lease_id = new_id()
        claim = ClaimPhase(
            actor=f"executor:{self.executor_id}",
            phase=d.phase,
            lease_id=lease_id,
            executor_id=self.executor_id,
        )
        result = await self.app.run_command(d.org, d.workspace, d.run_id, claim)
        return lease_id, result.state

    async def _started(
        self, d: Dispatch, claimed: tuple[str, RunState], start: StartJob
    ) -> Job | None:
        """The claimed phase's Job; if it cannot be had, the claimed run fails now."""
        lease_id, state = claimed
        log.info("phase_claimed", lease_id=lease_id)
        try:
            return start(d, lease_id, state)
        except Exception as e:  # no directory or identity for it: the claimed run fails now
            log.exception("phase_not_started", lease_id=lease_id)
            cmd = FailRun(
                actor=f"executor:{self.executor_id}",
                lease_id=lease_id,
                reason="executor_unavailable",
                message=f"executor {self.executor_id} could not start the phase: {e}",
            )
            try:
                await self.app.run_command(d.org, d.workspace, d.run_id, cmd)
            except Exception:
                log.exception("phase_failure_not_reported")
            return None
