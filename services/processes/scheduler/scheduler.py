"""The scheduler: per-workspace FIFO admission and dispatch of waiting phases.

It follows the event log through one durable pull consumer that all scheduler replicas
share (infra/consumer.py), and what it does about each event is the reaction
table's (events/react.py), decided on the run's or workspace's state folded through the
event. Every reaction is idempotent, so a message handled twice (redelivery after a
crash, or two replicas) changes nothing:

- admission is one optimistic append on the workspace subject (`App.admit_next`): of two
  schedulers racing, one wins and the other finds the workspace busy;
- it finishes what a writer that died left half done (services/app/commands.py): a run
  created and never enqueued is enqueued, and every terminal run event is followed by an
  admission attempt, which releases a workspace still held by a terminal run;
- dispatch publishes the waiting phase to the work queue with `Nats-Msg-Id =
  <run>:<phase>` (deduplicated by the server), and an executor's claim is itself an
  optimistic append, so a phase is never run twice (a second message of a phase, after
  the duplicate window, finds it claimed and is dropped). Its `dispatched` marker on the
  board lets the reaper dispatch it again if the message is lost (services/processes/scheduler/
  watch.py).

Every read a reaction decides on is at least as new as the message that caused it (the
event store's `floor`), so a follower that is behind never makes it decide nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from datetime import UTC, datetime
from types import TracebackType

import structlog
from nats.aio.client import Client as NATS

from events.codec import AnyEvent
from events.react import (
    Action,
    Admit,
    AdmitSpeculative,
    Deadline,
    Dispatch,
    Enqueue,
    Follow,
    Notify,
    StackChild,
    Watch,
    quiet,
    react,
)
from events.run import RunState
from infra import streams
from infra.consumer import Consumer, Received, Retry, Subscription, by_workspace
from infra.eventstore import floor
from infra.heartbeats import Board
from services.app.commands import App
from services.app.execute import Loaded
from services.processes.scheduler import limits, watch
from services.processes.scheduler.watch import pool_of

log = structlog.get_logger(__name__)

# How long a run may sit created and not enqueued before the scheduler enqueues it (its
# creator enqueues it right after `run.created`; this is for a creator that died).
ENQUEUE_GRACE = 1.0
# Workspaces whose last admission attempt is remembered (see `_admit`).
ADMITTED_KEPT = 10_000
RELEASED_KEPT = 10_000  # ended runs remembered as taken out of the open-runs quota


def _consulted(event: AnyEvent) -> bool:
    return not quiet(event)


def _latest(r: Received) -> Loaded[RunState] | None:
    """The run as the consumer just read it, if the event was its last then."""
    if isinstance(r.state, RunState) and r.last_seq == r.seq:
        return Loaded(subject=r.subject, seq=r.seq, state=r.state)
    return None


class Scheduler:
    """Admission and dispatch; run as many replicas as you like.

    It consumes the event log through the one consumer loop (infra/consumer.py,
    one lane per workspace, so a slow `git ls-remote` at admission holds only its own),
    with each run's or workspace's state folded through the event, and carries out what
    the reaction table says (events/react.py), in its order, then acks.

    `pool` is where phases go of runs whose workspace leaves `executor_pool` at its
    default; a run whose effective setting names a pool is dispatched to that pool.
    """

    def __init__(self, nc: NATS, app: App, *, batch: int = 256, pool: str = "default") -> None:
        self.nc = nc
        self.app = app
        self.batch = batch
        self.pool = pool
        self.board = Board(nc)
        subscription = Subscription(
            name="scheduler",
            handle=self._handle,
            subjects=("rp.>",),  # its own durable, declared below, takes the whole log
            lane=by_workspace,
            with_state=_consulted,  # the run's or workspace's, for what calls for something
            lane_limit=max(4 * batch, 64),  # as before: no lane put back, the room is shared
        )
        self.consumer = Consumer(
            nc,
            subscription,
            states=app.states,
            batch=batch,
            durable=streams.SCHEDULER_CONSUMER,
            declare=streams.ensure_scheduler_consumer,
        )
        self.ready = self.consumer.ready
        # By workspace: the highest stream sequence an admission attempt has read past.
        self._admitted: OrderedDict[str, int] = OrderedDict()
        # The ended runs this process has taken out of the open-runs quota, newest last.
        self._released: OrderedDict[str, None] = OrderedDict()

    async def __aenter__(self) -> Scheduler:
        await self.consumer.start()
        log.info("scheduler_started")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def stop(self) -> None:
        await self.consumer.stop()  # unacked messages are redelivered

    async def drain(self) -> None:
        """Wait until every message in hand is handled (tests and benchmarks)."""
        await self.consumer.drain()

    async def _handle(self, r: Received) -> None:
        """Carry out the event's reactions in order; a failure leaves the rest to the
        message's redelivery (every action is idempotent)."""
        for action in react(r.event, r.state):
            await self._act(action, r)
        if isinstance(r.state, RunState) and r.state.terminal and self.app.open_runs:
            await self._release(r.state)

    async def _release(self, run: RunState) -> None:
        """Take an ended run out of its organization's open runs (the quota's), once: the
        events that follow its end need no ledger read (after a restart, the first one
        seen releases it again, which changes nothing)."""
        if run.run_id in self._released:
            self._released.move_to_end(run.run_id)
            return
        assert self.app.open_runs is not None
        await self.app.open_runs.release(run.org, run.run_id)
        self._released[run.run_id] = None
        if len(self._released) > RELEASED_KEPT:
            self._released.popitem(last=False)

    async def _act(self, action: Action, r: Received) -> None:
        match action:
            case Admit(org=org, ws=ws, hint=hint):
                await self._admit(org, ws, hint, seq=r.seq)
            case Enqueue(org=org, ws=ws, run_id=run_id):
                await self._enqueued(r, org, ws, run_id)
            case AdmitSpeculative(org=org, ws=ws, run_id=run_id):
                await self._admit_speculative(org, ws, run_id)
            case Dispatch(org=org, ws=ws, run_id=run_id):
                await self._dispatch(org, ws, run_id, seen=_latest(r))
            case Watch():
                await watch.follow(self.nc, self.app, action)
            case Deadline(org=org, ws=ws, run_id=run_id):
                await limits.follow(self.app, self.board, org, ws, run_id, pool=self.pool)
            case Notify() | Follow() | StackChild():
                pass  # the subscribers' (services/processes/subscribers/)

    async def _admit(self, org: str, ws: str, hint: str = "", *, seq: int = 0) -> None:
        """An admission attempt, unless one already read past `seq`: of the events that
        call for one and arrive together (a run's end, then its release), the first's
        attempt reads at the newest fetched of its workspace and covers the others."""
        key = f"{org}.{ws}"
        if seq and self._admitted.get(key, 0) >= seq:
            return
        horizon = max(seq, self.consumer.horizon(key))
        floor.set(max(floor.get(), horizon))
        run_id = await self.app.admit_next(org, ws, hint=hint)
        self._admitted[key] = horizon
        self._admitted.move_to_end(key)
        while len(self._admitted) > ADMITTED_KEPT:
            self._admitted.popitem(last=False)
        if run_id:
            log.info("run_admitted", org=org, workspace=ws, run_id=run_id)

    async def _enqueued(self, r: Received, org: str, ws: str, run_id: str) -> None:
        """Make sure a created run is on its workspace. Its creator enqueues it right
        after `run.created`, so a fresh `run.created` is put back to come again once it is
        ENQUEUE_GRACE old (its deadline marker waits as long): off the way of the
        admission its `ws.run_enqueued` triggers. Then, if it is still not on its
        workspace (its creator died), it is enqueued here."""
        age = (datetime.now(UTC) - r.timestamp).total_seconds()
        if age < ENQUEUE_GRACE and r.num_delivered <= 1:
            raise Retry(ENQUEUE_GRACE - max(age, 0.0) + 0.05, "a fresh run: its creator's")
        if await self.app.is_enqueued(org, ws, run_id):
            return
        if await self.app.ensure_enqueued(org, ws, run_id, "scheduler"):
            log.info("run_enqueued", org=org, workspace=ws, run_id=run_id, repaired=True)

    async def _admit_speculative(self, org: str, ws: str, run_id: str) -> None:
        """A speculative plan is admitted at once, outside its workspace's queue."""
        if await self.app.admit_speculative(org, ws, run_id):
            log.info("run_admitted", org=org, workspace=ws, run_id=run_id, speculative=True)

    async def _dispatch(
        self, org: str, ws: str, run_id: str, *, seen: Loaded[RunState] | None = None
    ) -> None:
        """The run as it is now (the event may be old news: redelivered) waits for its
        snapshot, or for an executor to claim its phase. `seen`: the run as just read,
        when nothing came after the event (one read less)."""
        loaded = seen or await self.app.load_run(org, ws, run_id)
        state: RunState = loaded.state
        if state.pinning:  # its snapshot first; `run.pinned` comes back here to dispatch
            if await self.app.pin_run(org, ws, run_id, loaded=loaded):
                log.info("run_pinned", org=org, workspace=ws, run_id=run_id)
            return
        phase = state.waiting_phase
        if not phase:
            return
        pool = pool_of(state, self.pool)
        await watch.mark_dispatched(self.nc, state, phase, pool)  # before any executor beats
        await watch.dispatch(self.nc, state, phase, pool)
        log.info("phase_dispatched", org=org, workspace=ws, run_id=run_id, phase=phase)
