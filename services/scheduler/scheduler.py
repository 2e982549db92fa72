"""The scheduler: per-workspace FIFO admission and dispatch of waiting phases.

It follows the event log through one durable pull consumer that all scheduler replicas
share. Every reaction is idempotent, so a message handled twice (redelivery after a
crash, or two replicas) changes nothing:

- admission is one optimistic append on the workspace subject (`App.admit_next`): of two
  schedulers racing, one wins and the other finds the workspace busy;
- it finishes what a writer that died left half done (services/commands.py): a run
  created and never enqueued is enqueued, and every terminal run event is followed by an
  admission attempt, which releases a workspace still held by a terminal run;
- dispatch publishes the waiting phase to the work queue with `Nats-Msg-Id =
  <run>:<phase>` (deduplicated by the server), and an executor's claim is itself an
  optimistic append, so a phase is never run twice (a second message of a phase, after
  the duplicate window, finds it claimed and is dropped). Its `dispatched` marker on the
  board lets the reaper dispatch it again if the message is lost (services/scheduler/
  watch.py).

Every read a reaction decides on is at least as new as the message that caused it (the
event store's `floor`), so a follower that is behind never makes it decide nothing.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

import msgspec
import nats.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from events.codec import decode
from events.errors import DomainError
from events.run import RunState
from services.commands import App
from services.infra import streams, tracing
from services.infra.eventstore import StoreError, floor
from services.infra.heartbeats import Board
from services.infra.tasks import cancel_and_wait
from services.scheduler import limits, watch
from services.scheduler.watch import pool_of

log = structlog.get_logger(__name__)

PROGRESS_EVERY = 2.0  # well inside streams.SCHEDULER_ACK_WAIT

# Events after which a workspace may admit its next run.
_ADMISSION_TYPES = frozenset({"ws.created", "ws.run_enqueued", "ws.run_released", "ws.unlocked"})
# Run events that may end a run: its workspace may have to be released, then admit.
_RELEASE_TYPES = frozenset(
    {
        "run.plan_finished",
        "run.approved",  # a template whose last step is the approval ends there
        "run.apply_finished",
        "run.custom_finished",
        "run.discarded",
        "run.canceled",
        "run.failed",
    }
)
# How long a run may sit created and not enqueued before the scheduler enqueues it (its
# creator enqueues it right after `run.created`; this is for a creator that died).
ENQUEUE_GRACE = 1.0
# Events after which a run may have a phase waiting for an executor.
_DISPATCH_TYPES = frozenset(
    {
        "run.queued",
        "run.pinned",
        "run.approved",
        "run.plan_finished",
        "run.apply_finished",
        "run.custom_finished",
    }
)
# Events after which a run's deadlines (services/scheduler/limits.py) may have moved.
_LIMIT_TYPES = frozenset(
    {
        "run.created",
        "run.queued",
        "run.pinned",
        "run.plan_finished",
        "run.approved",
        "run.apply_finished",
        "run.custom_finished",
        "run.discarded",
        "run.canceled",
        "run.failed",
    }
)


def _field(data: bytes, name: str) -> Any:
    """A field of the event a message carries; None if it has none or does not decode."""
    try:
        return getattr(decode(data), name, None)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


class Scheduler:
    """Admission and dispatch; run as many replicas as you like.

    `pool` is where phases go of runs whose workspace leaves `executor_pool` at its
    default; a run whose effective setting names a pool is dispatched to that pool.
    """

    def __init__(self, nc: NATS, app: App, *, batch: int = 256, pool: str = "default") -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.app = app
        self.batch = batch
        self.pool = pool
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.ready = asyncio.Event()
        # One lane per workspace: its messages in order, other workspaces never wait for
        # it (a slow `git ls-remote` at admission holds only its own workspace).
        self._lanes: dict[str, list[Msg]] = {}
        self._lane_tasks: dict[str, asyncio.Task[None]] = {}
        self._in_flight = asyncio.Semaphore(max(4 * batch, 64))
        # Messages fetched and not yet handled: told "in progress" every PROGRESS_EVERY
        # seconds, so the consumer's short ack wait redelivers only a dead scheduler's.
        self._in_hand: dict[int, Msg] = {}  # by id(): a Msg is an unhashable dataclass

    async def __aenter__(self) -> Scheduler:
        await streams.ensure_scheduler_consumer(self.js)
        self._task = asyncio.create_task(self.run(), name="scheduler")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def stop(self) -> None:
        self._stopping.set()
        await cancel_and_wait(self._task)
        self._task = None
        for task in list(self._lane_tasks.values()):
            await cancel_and_wait(task)  # unacked messages are redelivered
        self._lane_tasks.clear()
        self._lanes.clear()

    async def run(self) -> None:
        sub = await self.js.pull_subscribe_bind(
            durable=streams.SCHEDULER_CONSUMER, stream=streams.EVENTS
        )
        self.ready.set()
        log.info("scheduler_started")
        progress = asyncio.create_task(self._progress(), name="scheduler-progress")
        try:
            await self._fetching(sub)
        finally:
            await cancel_and_wait(progress)

    async def _progress(self) -> None:
        while True:
            await asyncio.sleep(PROGRESS_EVERY)
            for m in list(self._in_hand.values()):
                try:
                    await m.in_progress()
                except (nats.errors.Error, OSError):  # reconnecting: redelivered if it lasts
                    pass

    async def _fetching(self, sub: JetStreamContext.PullSubscription) -> None:
        while not self._stopping.is_set():
            try:
                msgs = await sub.fetch(self.batch, timeout=1.0)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError):
                await asyncio.sleep(0.5)
                continue
            except Exception:  # keep scheduling through broker hiccups
                log.exception("scheduler_fetch_failed")
                await asyncio.sleep(0.5)
                continue
            try:
                await self._handle_batch(msgs)
            except Exception:  # unhandled ones are redelivered after the ack wait
                log.exception("scheduler_batch_failed")

    async def _handle_batch(self, msgs: list[Msg]) -> None:
        """Hand a batch to the workspaces' lanes and return without waiting for them
        (only for room: at most `4 * batch` messages are in hand at once)."""
        for m in msgs:
            await self._in_flight.acquire()
            self._in_hand[id(m)] = m
            key = ".".join(m.subject.split(".")[2:4])
            self._lanes.setdefault(key, []).append(m)
            if key not in self._lane_tasks:
                self._lane_tasks[key] = asyncio.create_task(self._lane(key), name=f"lane-{key}")

    async def drain(self) -> None:
        """Wait until every message in hand is handled (tests and benchmarks)."""
        while self._lane_tasks:
            await asyncio.gather(*list(self._lane_tasks.values()), return_exceptions=True)

    async def _lane(self, key: str) -> None:
        """Handle a workspace's messages in order, in chunks of what arrived meanwhile."""
        try:
            while msgs := self._lanes.pop(key, []):
                try:
                    await self._handle_group(msgs)
                finally:
                    for m in msgs:
                        self._in_hand.pop(id(m), None)
                        self._in_flight.release()
        finally:
            self._lane_tasks.pop(key, None)
            leftover = self._lanes.pop(key, [])  # only if cancelled: redelivered later
            for m in leftover:
                self._in_hand.pop(id(m), None)
                self._in_flight.release()

    async def _handle_group(self, msgs: list[Msg]) -> None:
        admitted = False
        for m in msgs:
            # Every read for this message is at least as new as the message itself: on a
            # cluster a follower that is behind would show the run before the event that
            # woke us, and we would decide nothing (services/infra/eventstore.py).
            floor.set(max(floor.get(), m.metadata.sequence.stream))
            tracing.follow(m.headers)  # what this message causes carries its trace
            try:
                kind = (m.headers or {}).get("Rp-Type", "")
                parts = m.subject.split(".")
                if parts[1] == "org":
                    await m.ack()
                    continue
                org, ws = parts[2], parts[3]
                if kind in _ADMISSION_TYPES and not admitted:
                    # One admission attempt per workspace per batch is enough: it reloads.
                    hint = _field(m.data, "run_id") if kind == "ws.run_enqueued" else ""
                    await self._admit(org, ws, str(hint or ""))
                    admitted = True
                elif kind in _DISPATCH_TYPES:
                    await self._dispatch(org, ws, parts[4])
                elif kind == "run.created":
                    if _field(m.data, "speculative"):
                        await self._admit_speculative(org, ws, parts[4])
                    elif not await self._enqueued(m, org, ws, parts[4]):
                        continue  # told to come back later
                if kind in _RELEASE_TYPES and not admitted:
                    await self._admit(org, ws)  # releases a terminal run still holding
                    admitted = True
                if kind in watch.WATCHED:  # the reaper's board
                    await watch.follow(self.nc, self.app, kind, org, ws, parts[4])
                # the run's deadline marker, on the same board (a run queued pinning has
                # it brought up to date by the `run.pinned` that follows)
                pinning = kind == "run.queued" and _field(m.data, "pinning")
                if kind in _LIMIT_TYPES and not pinning:
                    await limits.follow(self.app, Board(self.nc), org, ws, parts[4], pool=self.pool)
                await m.ack()
            except (StoreError, DomainError, nats.errors.Error, TimeoutError) as e:
                retry = getattr(e, "retryable", True)
                log.warning(
                    "scheduler_retry" if retry else "scheduler_drop",
                    subject=m.subject,
                    error=str(e),
                )
                await (m.nak(delay=0.5) if retry else m.term())
            except Exception:  # one bad message must not stop scheduling
                log.exception("scheduler_handler_failed", subject=m.subject)
                await m.nak(delay=2)

    async def _admit(self, org: str, ws: str, hint: str = "") -> None:
        run_id = await self.app.admit_next(org, ws, hint=hint)
        if run_id:
            log.info("run_admitted", org=org, workspace=ws, run_id=run_id)

    async def _enqueued(self, m: Msg, org: str, ws: str, run_id: str) -> bool:
        """Make sure a created run is on its workspace. Its creator enqueues it right
        after `run.created`, so a fresh `run.created` is put back to come again once it is
        ENQUEUE_GRACE old (its deadline marker waits as long): off the way of the
        admission its `ws.run_enqueued` triggers. Then, if it is still not on its
        workspace (its creator died), it is enqueued here. False: put back."""
        age = (datetime.now(UTC) - m.metadata.timestamp).total_seconds()
        if age < ENQUEUE_GRACE and m.metadata.num_delivered <= 1:
            await m.nak(delay=ENQUEUE_GRACE - max(age, 0.0) + 0.05)
            return False
        if await self.app.is_enqueued(org, ws, run_id):
            return True
        if await self.app.ensure_enqueued(org, ws, run_id, "scheduler"):
            log.info("run_enqueued", org=org, workspace=ws, run_id=run_id, repaired=True)
        return True

    async def _admit_speculative(self, org: str, ws: str, run_id: str) -> None:
        """A speculative plan is admitted at once, outside its workspace's queue."""
        if await self.app.admit_speculative(org, ws, run_id):
            log.info("run_admitted", org=org, workspace=ws, run_id=run_id, speculative=True)

    async def _dispatch(self, org: str, ws: str, run_id: str) -> None:
        loaded = await self.app.load_run(org, ws, run_id)
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
