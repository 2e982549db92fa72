"""The scheduler: per-workspace FIFO admission and dispatch of waiting phases.

It follows the event log through one durable pull consumer that all scheduler replicas
share. Every reaction is idempotent, so a message handled twice (redelivery after a
crash, or two replicas) changes nothing:

- admission is one optimistic append on the workspace subject (`App.admit_next`): of two
  schedulers racing, one wins and the other finds the workspace busy;
- dispatch publishes the waiting phase to the work queue with `Nats-Msg-Id =
  <run>:<phase>` (deduplicated by the server), and an executor's claim is itself an
  optimistic append, so a phase is never run twice.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from types import TracebackType

import nats.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from events.errors import DomainError
from events.run import WAITING_PHASE, RunState
from services.commands import App
from services.infra import streams
from services.infra.eventstore import StoreError
from services.infra.heartbeats import Board
from services.infra.tasks import cancel_and_wait
from services.scheduler import limits, watch

log = structlog.get_logger(__name__)

# Events after which a workspace may admit its next run.
_ADMISSION_TYPES = frozenset({"ws.created", "ws.run_enqueued", "ws.run_released", "ws.unlocked"})
# Events after which a run may have a phase waiting for an executor.
_DISPATCH_TYPES = frozenset({"run.queued", "run.approved", "run.plan_finished"})
# Events after which a run's deadlines (services/scheduler/limits.py) may have moved.
_LIMIT_TYPES = frozenset(
    {
        "run.created",
        "run.queued",
        "run.plan_finished",
        "run.approved",
        "run.apply_finished",
        "run.discarded",
        "run.canceled",
        "run.failed",
    }
)


def dispatch_message(state: RunState, phase: str) -> bytes:
    return json.dumps(
        {"org": state.org, "workspace": state.workspace, "run_id": state.run_id, "phase": phase}
    ).encode()


class Scheduler:
    """Admission and dispatch; run as many replicas as you like."""

    def __init__(self, nc: NATS, app: App, *, batch: int = 256, pool: str = "default") -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.app = app
        self.batch = batch
        self.pool = pool
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.ready = asyncio.Event()

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

    async def run(self) -> None:
        sub = await self.js.pull_subscribe_bind(
            durable=streams.SCHEDULER_CONSUMER, stream=streams.EVENTS
        )
        self.ready.set()
        log.info("scheduler_started")
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
            await self._handle_batch(msgs)

    async def _handle_batch(self, msgs: list[Msg]) -> None:
        """Handle a batch: workspaces in parallel, each workspace's messages in order."""
        groups: dict[str, list[Msg]] = defaultdict(list)
        for m in msgs:
            groups[".".join(m.subject.split(".")[2:4])].append(m)
        await asyncio.gather(*(self._handle_group(g) for g in groups.values()))

    async def _handle_group(self, msgs: list[Msg]) -> None:
        admitted = False
        for m in msgs:
            try:
                kind = (m.headers or {}).get("Rp-Type", "")
                parts = m.subject.split(".")
                if parts[1] == "org":
                    await m.ack()
                    continue
                org, ws = parts[2], parts[3]
                if kind in _ADMISSION_TYPES and not admitted:
                    # One admission attempt per workspace per batch is enough: it reloads.
                    await self._admit(org, ws)
                    admitted = True
                elif kind in _DISPATCH_TYPES:
                    await self._dispatch(org, ws, parts[4])
                if kind in watch.WATCHED:  # the reaper's board
                    await watch.follow(self.nc, self.app, kind, org, ws, parts[4])
                if kind in _LIMIT_TYPES:  # the run's deadline marker, on the same board
                    await limits.follow(self.app, Board(self.nc), org, ws, parts[4])
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

    async def _admit(self, org: str, ws: str) -> None:
        run_id = await self.app.admit_next(org, ws)
        if run_id:
            log.info("run_admitted", org=org, workspace=ws, run_id=run_id)

    async def _dispatch(self, org: str, ws: str, run_id: str) -> None:
        loaded = await self.app.load_run(org, ws, run_id)
        state: RunState = loaded.state
        phase = WAITING_PHASE.get(state.status) if state.status else None
        if not phase:
            return
        await watch.mark_dispatched(self.nc, state, phase)  # before any executor can beat
        await self.js.publish(
            streams.dispatch_subject(self.pool),
            dispatch_message(state, phase),
            headers={"Nats-Msg-Id": f"{run_id}:{phase}"},
        )
        log.info("phase_dispatched", org=org, workspace=ws, run_id=run_id, phase=phase)
