"""The schedule loop: every scheduler replica runs one, and each fire time makes one run.

It lives in the scheduler process, not the subscribers host: it is driven by the clock,
not by events (a subscriber acks a message; a fire time is no message), and schedules
are the scheduler's part of the architecture (admission, dispatch, the reaper, cron).

Each `tick(now)` reads what schedule definitions are new (one wildcard read of every
workspace's schedules subject, `rp.org.*.sched.*`: the event store keeps what it read
and fetches only what came since), and handles every schedule whose next fire time is
at or before `now`:

1. its definition and its fire state are read again from the stream's leader: the
   index may come from a follower that is behind, and a deleted, disabled or changed
   schedule must not fire on it (a change's new cron counts from the change);
2. `due` (events/schedule.py) names the one fire time to handle: several due (no
   scheduler ran across them) are one fire or one skip, by the schedule's `missed`;
3. the run's id is derived from the schedule and the fire time, so `create_run` of a
   time already fired finds that run (`Result.existed`) and writes nothing;
4. the fire (or skip) is recorded on the schedule's fires subject by an append checked
   against the state read in 1: of two replicas, the second's append conflicts, and
   its reload finds the time handled.

A scheduler killed between 3 and 4 left a run and no record: the next tick (its own
after a restart, or another replica's) derives the same id and records it. Racing
replicas therefore make one run per fire time; a skip recorded while another replica
made the run is the one window left (the run stands; the history shows both).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime
from types import TracebackType

import structlog

from events import schedule as sc
from events.errors import Conflict, DomainError
from events.run_events import Status
from events.values import Cause
from infra.eventstore import LATEST
from infra.tasks import cancel_and_wait
from services.app.commands import App
from services.app.ids import derived_id, utcnow
from services.processes.schedules import store

log = structlog.get_logger(__name__)

ACTOR = "schedule"
TICK_S = 5.0  # the longest a due fire waits for the loop (and a new schedule to be seen)
PARALLEL = 16  # fires handled at once in a tick (a minute boundary may make many due)
WAITING = frozenset({Status.PENDING, Status.QUEUED})  # a run that has not started

Key = tuple[str, str, str]  # org, workspace, schedule id


def run_id_for(schedule_id: str, fire_time: datetime) -> str:
    """The id of the run a schedule's fire time makes: the same on every replica."""
    return derived_id(schedule_id, fire_time.astimezone(UTC).isoformat())


class ScheduleLoop:
    """`async with ScheduleLoop(app):` fires schedules until the block ends. `clock` is
    injected: tests call `tick(now)` with a simulated one and never start the task."""

    def __init__(
        self, app: App, *, clock: Callable[[], datetime] = utcnow, interval: float = TICK_S
    ) -> None:
        self.app = app
        self.clock = clock
        self.interval = interval
        self.schedules: dict[Key, sc.Schedule] = {}
        self._state: dict[tuple[str, str], sc.SchedulesState] = {}
        self._read = 0  # the last sequence of the definitions folded into `schedules`
        self._next: dict[Key, datetime | None] = {}  # None: fires no more (disabled)
        self._task: asyncio.Task[None] | None = None
        self.ticks = 0  # ticks run by the loop's task

    async def __aenter__(self) -> ScheduleLoop:
        self._task = asyncio.create_task(self._run(), name="schedule-loop")
        log.info("schedule_loop_started", interval=self.interval)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)

    async def _run(self) -> None:
        while True:
            now = self.clock()
            try:
                await self.tick(now)
            except Exception as e:  # noqa: BLE001 - NATS away: the next tick tries again
                log.warning("schedule_tick_failed", error=repr(e))
            self.ticks += 1
            await asyncio.sleep(self._pause(self.clock()))

    def _pause(self, now: datetime) -> float:
        soonest = min((t for t in self._next.values() if t is not None), default=None)
        if soonest is None:
            return self.interval
        return min(self.interval, max(0.05, (soonest - now).total_seconds()))

    # ------------------------------------------------------------ the index

    async def refresh(self) -> None:
        """Fold the schedule definitions appended since the last refresh.

        The read starts after the stream's last sequence of the previous refresh, not
        after the last definition: a wildcard read makes the server walk the stream from
        where it starts, and from the last definition (or the stream's start, with none)
        each tick walked all of it (admission at 10,000 workspaces fell from 287 to 146
        runs/s in the scheduler process the loop shares: bench/README.md). The read is at
        least as new as that sequence (`min_seq`), so no definition below it is missed."""
        top = await self.app.store.last_seq()
        envs = await self.app.store.read(sc.ALL_SCHEDULES, after=self._read, min_seq=top)
        for env in envs:
            if not isinstance(env.event, sc.ScheduleSaved | sc.ScheduleDeleted):
                continue
            parts = env.subject.split(".")  # rp.org.<org>.sched.<ws>
            org, ws = parts[2], parts[4]
            before = self._state.get((org, ws), sc.SchedulesState())
            self._state[(org, ws)] = sc.evolve(before, env.event)
            self._reindex(org, ws, before)
        self._read = max(self._read, top, envs[-1].seq if envs else 0)

    def _reindex(self, org: str, ws: str, before: sc.SchedulesState) -> None:
        after = self._state[(org, ws)].schedules
        for sid in before.schedules.keys() | after.keys():
            key = (org, ws, sid)
            if before.schedules.get(sid) != after.get(sid):
                self._next.pop(key, None)  # changed: its next fire time is planned again
            if sid in after and (after[sid].org, after[sid].workspace) == (org, ws):
                self.schedules[key] = after[sid]
            else:
                self.schedules.pop(key, None)

    # ------------------------------------------------------------ firing

    async def tick(self, now: datetime) -> list[sc.ScheduleFired | sc.ScheduleSkipped]:
        """Handle every schedule due at `now`; what was recorded (by this replica)."""
        await self.refresh()
        room = asyncio.Semaphore(PARALLEL)

        async def one(key: Key) -> sc.ScheduleFired | sc.ScheduleSkipped | None:
            async with room:
                try:
                    return await self._maybe_fire(key, now)
                except Exception as e:  # noqa: BLE001 - one schedule's trouble is its own:
                    # logged, and its fire time is tried again next tick.
                    log.warning("schedule_fire_failed", schedule=key[2], error=repr(e))
                    self._next.pop(key, None)
                    return None

        done = await asyncio.gather(*(one(k) for k in list(self.schedules)))
        return [d for d in done if d is not None]

    async def _maybe_fire(
        self, key: Key, now: datetime
    ) -> sc.ScheduleFired | sc.ScheduleSkipped | None:
        if key not in self._next:
            fires = await store.fire_state(self.app, *key)
            self._plan(key, self.schedules[key], fires)
        nxt = self._next.get(key)
        if nxt is None or nxt > now:
            return None
        return await self.fire(key, now)

    def _plan(self, key: Key, s: sc.Schedule, fires: sc.FireState) -> None:
        if not s.enabled:
            self._next[key] = None
            return
        start = max(s.since, fires.last_fire) if fires.last_fire else s.since
        upcoming = sc.next_fires(s, start)
        self._next[key] = upcoming[0] if upcoming else None

    async def fire(self, key: Key, now: datetime) -> sc.ScheduleFired | sc.ScheduleSkipped | None:
        """Handle the schedule's due fire time, deciding on reads from the stream's
        leader; None if nothing was due after all (deleted, disabled, changed, or
        handled by another replica)."""
        org, ws, sid = key
        state, _ = await store.load(self.app, org, ws, latest=True)
        s = state.schedules.get(sid)
        if s is None or (s.org, s.workspace) != (org, ws):
            # deleted (the index was behind); or a definition that names another
            # workspace than the subject it is on: never a run outside that workspace
            self.schedules.pop(key, None)
            self._next.pop(key, None)
            return None
        for _ in range(self.app.attempts):
            fires = await store.fire_state(self.app, org, ws, sid)
            d = sc.due(s, fires, now)
            if d is None:
                self._plan(key, s, fires)
                return None
            event = await self._decide(s, fires, d)
            try:
                seq = await store.record(self.app, org, ws, fires, event)
            except Conflict:
                continue  # another replica recorded a fire: reload, most likely nothing due
            self._plan(key, s, sc.fire_state(event, seq))
            _logged(s, event)
            return event
        raise Conflict(f"schedule {sid}: the fire record kept moving")

    async def _decide(
        self, s: sc.Schedule, fires: sc.FireState, d: sc.Due
    ) -> sc.ScheduleFired | sc.ScheduleSkipped:
        """Fire `d` (make its run, or find the one made before), or say why not."""
        run_id = run_id_for(s.id, d.fire_time)

        def skipped(reason: str, waiting: str = "", detail: str = "") -> sc.ScheduleSkipped:
            return sc.ScheduleSkipped(
                at=self.app.clock(),
                actor=ACTOR,
                schedule_id=s.id,
                fire_time=d.fire_time,
                reason=reason,
                waiting_run=waiting,
                last_run=fires.last_run,
                missed=d.missed,
                detail=detail,
            )

        if d.skip:
            return skipped(sc.MISSED_SKIPPED)
        if fires.last_run and await self._waits(s, fires.last_run):
            if not await self._exists(s, run_id):  # (else made, its record lost: record it)
                return skipped(sc.WAITING, waiting=fires.last_run)
        try:
            await self._create(s, d.fire_time, run_id)
        except DomainError as e:
            if e.retryable and await self._workspace_exists(s):
                raise
            return skipped(sc.REFUSED, detail=str(e)[:200])
        return sc.ScheduleFired(
            at=self.app.clock(),
            actor=ACTOR,
            schedule_id=s.id,
            fire_time=d.fire_time,
            run_id=run_id,
            missed=d.missed,
        )

    async def _create(self, s: sc.Schedule, t: datetime, run_id: str) -> None:
        """The fire time's run (`Result.existed` if a replica, or this one before a
        crash, made it already: nothing is written then)."""
        await self.app.create_run(
            s.org,
            s.workspace,
            s.run_type,
            ACTOR,
            message=f"schedule {s.id}: {s.cron} ({s.timezone})",
            template=s.template,
            cause=Cause(kind="schedule", schedule=s.id, fire_time=t),
            run_id=run_id,
        )

    async def _waits(self, s: sc.Schedule, run_id: str) -> bool:
        r = await self.app.load_run(s.org, s.workspace, run_id, min_seq=LATEST)
        return bool(r.state.exists and r.state.status in WAITING)

    async def _exists(self, s: sc.Schedule, run_id: str) -> bool:
        r = await self.app.load_run(s.org, s.workspace, run_id, min_seq=LATEST)
        return bool(r.state.exists)

    async def _workspace_exists(self, s: sc.Schedule) -> bool:
        """Whether a retryable refusal is worth retrying: the workspace is still there
        (a deleted one's refusal is recorded once, not retried every tick)."""
        state = (await self.app.load_ws(s.org, s.workspace)).state
        return bool(state.exists and not getattr(state, "deleted", False))


def _logged(s: sc.Schedule, event: sc.ScheduleFired | sc.ScheduleSkipped) -> None:
    fields = {
        "org": s.org,
        "workspace": s.workspace,
        "schedule": s.id,
        "fire_time": event.fire_time.isoformat(),
        "missed": event.missed,
    }
    if isinstance(event, sc.ScheduleFired):
        log.info("schedule_fired", run_id=event.run_id, **fields)
    else:
        log.info("schedule_skipped", reason=event.reason, waiting_run=event.waiting_run, **fields)
