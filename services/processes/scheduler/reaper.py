"""The reaper: fail runs whose executor went silent, and phases nobody claimed in time.

Every `interval` it reads the heartbeat board (one message per active phase, see
`infra.heartbeats`; kept in memory by an ordered consumer, `Follower`, so a round
reads only what changed) and judges each entry older than its timeout against the
run itself:

- a beat of the run's current lease: the executor is gone (killed, host lost, paused);
  the run fails with `executor_unavailable`, which releases its workspace;
- a `dispatched` marker of a phase the run still waits for: nobody picked it up within
  the workspace's dispatch timeout; the run fails with `executor_unavailable` too;
- a `dispatched` marker older than `redispatch_after` (60 s), with or without a dispatch
  timeout: if the pool's work queue no longer holds the phase's message (lost, taken by
  someone who never claimed), the phase is dispatched again with the same `Nats-Msg-Id`
  (deduplicated within the stream's duplicate window, 120 s: then it goes at the next
  check); a second message of a phase is harmless, its claim is refused. The marker is
  rewritten at each check, so a waiting run always shows when it is looked at next;
- a marker of a phase that was claimed since: the lease gets its own beat, so an
  executor that died between its claim and its first beat is still caught;
- anything else (the run moved on or ended): the entry is purged.

Any number of replicas may reap at once. Each failure is guarded by the condition it
was judged on (same status, same lease), checked again against the state the append
expects, so a run that moved on in between is left alone and two reapers fail a run at
most once. A phase failed by the reaper is fenced: the executor's next report carries a
lease that is no longer current and is refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime
from enum import StrEnum
from types import TracebackType

import msgspec
import nats.errors
import structlog
from nats.aio.client import Client as NATS

from events.errors import DomainError, IllegalTransition
from events.run import FailRun, RunState, running_status
from infra import streams
from infra.directget import InfraError, as_raw, leader_get
from infra.eventstore import floor
from infra.heartbeats import DEADLINE, DISPATCHED, Beat, Board, BoardError, Follower
from infra.tasks import cancel_and_wait
from services.app.commands import App
from services.processes.scheduler import limits, watch
from services.processes.scheduler.watch import adopt, pool_of

log = structlog.get_logger(__name__)

ACTOR = "reaper"
REASON = "executor_unavailable"

Guard = Callable[[RunState], None]


class Verdict(StrEnum):
    KEEP = "keep"
    FAIL_SILENT = "fail_silent"  # the lease's executor stopped beating
    FAIL_UNCLAIMED = "fail_unclaimed"  # nobody claimed the phase within the dispatch timeout
    ADOPT = "adopt"  # claimed, but the board still shows the marker: beat for the lease
    REDISPATCH = "redispatch"  # unclaimed, in time: dispatch again if its message is gone
    PURGE = "purge"  # the run moved on: the entry is garbage


def running(run: RunState, phase: str) -> bool:
    return run.phase == phase and run.status == running_status(phase)


def judge(beat: Beat, run: RunState, *, timed_out: bool = True) -> Verdict:
    """What to do with a board entry past its timeout (or, `timed_out` false, a marker
    due for its recheck), given the run's state now. Pure."""
    if not run.exists or run.terminal:
        return Verdict.PURGE
    if running(run, beat.phase):
        if beat.lease_id == run.lease_id:
            return Verdict.FAIL_SILENT if timed_out else Verdict.KEEP
        return Verdict.ADOPT
    if run.waiting_phase == beat.phase:
        if beat.lease_id:
            return Verdict.KEEP
        return Verdict.FAIL_UNCLAIMED if timed_out else Verdict.REDISPATCH
    return Verdict.PURGE


def silent_guard(beat: Beat) -> Guard:
    """Fail only while the run still runs that phase under that lease."""

    def guard(run: RunState) -> None:
        if not running(run, beat.phase) or run.lease_id != beat.lease_id:
            raise IllegalTransition("the run moved on since it was judged", status=str(run.status))

    return guard


def unclaimed_guard(beat: Beat) -> Guard:
    """Fail only while the run still waits for that phase."""

    def guard(run: RunState) -> None:
        if run.waiting_phase != beat.phase:
            raise IllegalTransition(
                "the phase was claimed since it was judged", status=str(run.status)
            )

    return guard


class Reaper:
    """Watches the heartbeat board; an async context manager, one task."""

    def __init__(
        self,
        nc: NATS,
        app: App,
        *,
        interval: float = 1.0,
        concurrency: int = 32,
        board: Board | None = None,
        redispatch_after: int = watch.RECHECK,
    ) -> None:
        self.nc = nc
        self.app = app
        self.board = board or Board(nc)
        # The board as an ordered consumer delivers it: a round reads what changed.
        self.fold = Follower(self.board)
        self.interval = interval
        self.redispatch_after = redispatch_after
        # The `Nats-Msg-Id`s in a pool's work queue (one message get each), read again
        # only once they are a quarter of `redispatch_after` old: a queue of thousands
        # of waiting phases is not read every round. An old list may show a message
        # lost since (its phase goes at the next check) or miss one published since
        # (only for markers this young: never due).
        self._queued: dict[str, tuple[float, asyncio.Task[set[str]]]] = {}
        # When each open run's deadline marker was last looked at (server time).
        self._looked: dict[str, datetime] = {}
        # (subject, has a lease) -> timeout, for entries that do not say theirs
        self._timeouts: dict[tuple[str, bool], int] = {}
        self._slots = asyncio.Semaphore(concurrency)
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # Silence is counted only from when this reaper could see the board: after it lost
        # sight of NATS (a failed round, or the server's clock jumping past a round), no
        # executor could beat either, so their silence restarts at the first round back.
        self._watching_since: datetime | None = None
        self._last_round: datetime | None = None
        self._blind = False

    async def __aenter__(self) -> Reaper:
        self._task = asyncio.create_task(self.run(), name="reaper")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stopping.set()
        await cancel_and_wait(self._task)
        self._task = None
        for _, read in self._queued.values():
            await cancel_and_wait(read)
        self._queued.clear()
        await self.fold.stop()

    async def run(self) -> None:
        """Reap every `interval`, or twice as long as a round took: reading the board costs
        about 25 us per active phase, so a huge board slows the rounds, not the process."""
        log.info("reaper_started", interval=self.interval)
        loop = asyncio.get_running_loop()
        while not self._stopping.is_set():
            started = loop.time()
            try:
                await self.reap_once()
            except (InfraError, nats.errors.Error, TimeoutError) as e:
                log.warning("reaper_retry", error=str(e))
                self.lost_sight()
            except Exception:  # one bad round must not stop reaping
                log.exception("reaper_round_failed")
                self.lost_sight()
            pause = max(self.interval, 2 * (loop.time() - started))
            try:
                await asyncio.wait_for(self._stopping.wait(), pause)
            except TimeoutError:
                pass

    def lost_sight(self) -> None:
        """The board could not be read: NATS may be away, and executors' beats with it."""
        self._blind = True

    def _observe(self, now: datetime) -> None:
        gap = max(10.0, 5 * self.interval)
        jumped = self._last_round is not None and (now - self._last_round).total_seconds() > gap
        if self._blind or jumped:
            self._watching_since = now
            log.info("reaper_sight_regained", at=now.isoformat())
        self._blind, self._last_round = False, now

    async def reap_once(self) -> list[tuple[Beat, Verdict]]:
        """One round: judge every stale entry; return what was decided (for tests)."""
        now, board = await self.fold.snapshot()
        # Every run judged below is read at least as new as the stream was after the board
        # (from its leader): a beat is published after the claim it beats for, so no
        # follower that is behind can show a live run as one that moved on.
        floor.set(await self.app.store.last_seq())
        self._observe(now)
        beats = [b for b in board if b.phase != DEADLINE]
        markers = [b for b in board if b.phase == DEADLINE]
        await self._limits([b for b in markers if limits.due(b, now)], now)
        await self._open_runs(markers, beats, now)
        for marker in (b for b in markers if limits.stale(b, now)):
            await limits.refresh(self.board, marker)
        known = self._timeouts
        self._timeouts = {k: known[k] for b in beats if (k := _key(b)) in known}
        stale = [(b, True) for b in beats if await self._stale(b, now)]
        due = {b.seq for b, _ in stale}
        stale += [(b, False) for b in beats if b.seq not in due and self._recheck(b, now)]
        results = await asyncio.gather(
            *(self._reap(b, now, timed_out) for b, timed_out in stale), return_exceptions=True
        )
        done: list[tuple[Beat, Verdict]] = []
        for (beat, _), result in zip(stale, results, strict=True):
            if isinstance(result, BaseException):  # judged again next round
                log.warning("reap_failed", run_id=beat.run_id, error=repr(result))
            else:
                done.append((beat, result))
        return done

    async def _limits(self, due: list[Beat], now: datetime) -> None:
        """Enforce the run limits whose deadlines passed
        (services/processes/scheduler/limits.py)."""

        async def one(beat: Beat) -> None:
            async with self._slots:
                try:
                    await limits.enforce(self.app, self.board, beat, now)
                except (InfraError, DomainError, nats.errors.Error, TimeoutError) as e:
                    log.warning("limit_failed", run_id=beat.run_id, error=repr(e))

        await asyncio.gather(*(one(b) for b in due))

    async def _open_runs(self, markers: list[Beat], beats: list[Beat], now: datetime) -> None:
        """Every open run has a deadline marker (services/processes/scheduler/limits.py). One whose
        run has nothing on the board is looked at every `redispatch_after`: if it waits
        for an executor, its phase was never dispatched (or lost its marker) and is
        dispatched now; if it ended, the marker is purged."""
        shown = {b.run_id for b in beats}
        self._looked = {
            m.subject: self._looked[m.subject] for m in markers if m.subject in self._looked
        }

        def due(m: Beat) -> bool:
            since = self._looked.get(m.subject, m.time)
            return m.run_id not in shown and (now - since).total_seconds() > self.redispatch_after

        async def one(marker: Beat) -> None:
            async with self._slots:
                try:
                    await self._unseen(marker)
                except (InfraError, DomainError, nats.errors.Error, TimeoutError) as e:
                    log.warning("open_run_check_failed", run_id=marker.run_id, error=repr(e))
                    return
            self._looked[marker.subject] = now

        await asyncio.gather(*(one(m) for m in markers if due(m)))

    async def _unseen(self, marker: Beat) -> None:
        run = await self._load(marker)
        if not run.exists or run.terminal:
            if await self._current(marker):
                await self.board.purge(marker.subject, through=marker.seq)
            return
        phase = run.waiting_phase
        if not phase or await self.board.last(run.run_id, phase, leader=True) is not None:
            return  # nothing to dispatch, or a board page from a follower missed its entry
        pool = marker.body.pool or pool_of(run, "default")
        await watch.mark_dispatched(self.nc, run, phase, pool)
        sent = await watch.dispatch(self.nc, run, phase, pool)
        log.warning("unseen_phase_dispatched", run_id=run.run_id, phase=phase, pool=pool, sent=sent)

    async def _stale(self, beat: Beat, now: datetime) -> bool:
        timeout = await self._timeout(beat)
        start = beat.body.dispatched_at or beat.time  # a marker's rewrites keep the first
        since = max(start, self._watching_since) if self._watching_since else start
        return timeout > 0 and (now - since).total_seconds() > timeout

    def _recheck(self, beat: Beat, now: datetime) -> bool:
        """A `dispatched` marker due for the check that its message still exists."""
        marker = not beat.lease_id and beat.body.kind == DISPATCHED
        return marker and (now - beat.time).total_seconds() > self.redispatch_after

    async def _timeout(self, beat: Beat) -> int:
        """The entry's timeout: as it says, else from the run's configuration (cached)."""
        if beat.body.timeout >= 0:
            return beat.body.timeout
        key = _key(beat)
        if key not in self._timeouts:
            cfg = (await self._load(beat)).config
            if cfg is None:
                return 1  # no such run: stale at once, and purged
            self._timeouts[key] = cfg.heartbeat_timeout if key[1] else cfg.dispatch_timeout
        return self._timeouts[key]

    async def _load(self, beat: Beat) -> RunState:
        b = beat.body
        loaded = await self.app.load_run(b.org or "*", b.workspace or None, beat.run_id)
        return loaded.state

    async def _reap(self, beat: Beat, now: datetime, timed_out: bool = True) -> Verdict:
        async with self._slots:
            return await self._reap_one(beat, now, timed_out)

    async def _reap_one(self, beat: Beat, now: datetime, timed_out: bool = True) -> Verdict:
        run = await self._load(beat)
        verdict = judge(beat, run, timed_out=timed_out)
        if verdict != Verdict.KEEP and not await self._current(beat):
            return Verdict.KEEP  # the entry changed since the board was read: next round
        with structlog.contextvars.bound_contextvars(
            run_id=beat.run_id, phase=beat.phase, lease_id=beat.lease_id
        ):
            silence = (now - beat.time).total_seconds()
            match verdict:
                case Verdict.FAIL_SILENT | Verdict.FAIL_UNCLAIMED:
                    await self._fail(beat, run, verdict, silence)
                case Verdict.ADOPT:
                    await adopt(self.board, run)
                case Verdict.REDISPATCH:
                    await self._redispatch(beat, run)
                case Verdict.PURGE:
                    await self.board.purge(beat.subject, through=beat.seq)
                case Verdict.KEEP:
                    pass
        return verdict

    async def _current(self, beat: Beat) -> bool:
        """Whether the entry is still the subject's last, as the stream's leader has it
        (a page of the board may have come from a follower that is behind)."""
        last = await self.board.last(beat.run_id, beat.phase, leader=True)
        return last is not None and last.seq == beat.seq

    async def _redispatch(self, beat: Beat, run: RunState) -> None:
        """Dispatch a waiting phase again unless its pool's queue still holds its message;
        then rewrite the marker (unless it changed meanwhile) to time the next check."""
        pool = beat.body.pool or pool_of(run, "default")
        if watch.dispatch_id(run.run_id, beat.phase, run.released) not in await self._pending(pool):
            sent = await watch.dispatch(self.nc, run, beat.phase, pool)
            log.warning("phase_redispatched" if sent else "redispatch_deduplicated", pool=pool)
        since = beat.body.dispatched_at or beat.time
        body = msgspec.structs.replace(
            beat.body, pool=pool, recheck=self.redispatch_after, dispatched_at=since
        )
        await self.board.put(beat.subject, msgspec.json.encode(body), expected=beat.seq)

    async def _pending(self, pool: str) -> set[str]:
        now = asyncio.get_running_loop().time()
        read = self._queued.get(pool)
        if read is None or now - read[0] > self.redispatch_after / 4 or read[1].cancelled():
            read = (now, asyncio.create_task(queued(self.nc, pool), name=f"queued-{pool}"))
            self._queued[pool] = read
        try:
            return await asyncio.shield(read[1])
        except (BoardError, nats.errors.Error, TimeoutError):
            self._queued.pop(pool, None)  # read again next time
            raise

    async def _fail(self, beat: Beat, run: RunState, verdict: Verdict, silence: float) -> None:
        silent = verdict == Verdict.FAIL_SILENT
        cmd = FailRun(actor=ACTOR, reason=REASON, message=_message(beat, run, silent, silence))
        guard = silent_guard(beat) if silent else unclaimed_guard(beat)
        try:
            await self.app.run_command(run.org, run.workspace, run.run_id, cmd, guard=guard)
        except DomainError as e:  # another reaper, or the run itself, got there first
            log.info("reap_skipped", why=str(e))
            return
        log.warning("run_reaped", verdict=str(verdict), silence=round(silence, 3))
        await self.board.purge(beat.subject, through=beat.seq)


async def queued(nc: NATS, pool: str, *, timeout: float = 5.0) -> set[str]:
    """The `Nats-Msg-Id` of every message in a pool's work queue, every organization's
    and the pool's own (taken or not, a message stays until its claim is decided), as
    the stream's leader has it: a follower behind might not have a message published
    just now, and the phase would go twice."""
    ids: set[str] = set()
    for subject in (streams.pool_subjects(pool), streams.dispatch_subject(pool)):
        seq = 1
        while True:
            msg = await leader_get(
                nc,
                streams.DISPATCH,
                as_raw,
                subject=subject,
                seq=seq,
                what=f"the {pool} work queue",
                error=BoardError,
                timeout=timeout,
            )
            if msg is None:
                break
            ids.add(msg.headers.get("Nats-Msg-Id", ""))
            seq = msg.seq + 1
    return ids


def _key(beat: Beat) -> tuple[str, bool]:
    return beat.subject, bool(beat.lease_id)


def _message(beat: Beat, run: RunState, silent: bool, silence: float) -> str:
    cfg = run.config
    if silent:
        timeout = cfg.heartbeat_timeout if cfg else beat.body.timeout
        who = run.executor_id or beat.body.executor_id or "(unknown)"
        return (
            f"executor {who} sent no heartbeat for {silence:.0f}s during the {beat.phase} "
            f"phase (heartbeat timeout {timeout}s)"
        )
    timeout = cfg.dispatch_timeout if cfg else beat.body.timeout
    return f"no executor picked up the {beat.phase} phase within the dispatch timeout of {timeout}s"
