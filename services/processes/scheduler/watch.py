"""What the scheduler puts on the heartbeat board as runs move, so the reaper sees them.

- When it dispatches a phase, a `dispatched` marker (published before the work-queue
  message, so no executor beat can precede it, and only on an empty subject, so a
  redelivered dispatch keeps the first time). Every dispatched phase has one, with a
  dispatch timeout or without (`timeout` 0: it may wait for ever): the reaper checks every
  `recheck` seconds that its work-queue message still exists, and dispatches it again if
  it does not (services/processes/scheduler/reaper.py), so a lost message never leaves a run
  waiting unseen.
- When a phase is claimed (`run.phase_started`), a beat on the new lease's behalf unless
  the executor already beat: an executor that dies between its claim and its first beat
  is then reaped like any other silent one.
- When a phase ends, its entry is purged, so the board lists only live phases.
"""

from __future__ import annotations

import structlog
from nats.aio.client import Client as NATS

from events import wire
from events.codec import valid_id
from events.react import Watch
from events.run import RunState
from events.settings import DEFAULT_ORIGIN
from events.templates import phase_of
from infra import streams, tracing
from infra.heartbeats import CLAIMED, DISPATCHED, Board, body, subject
from services.app.commands import App

log = structlog.get_logger(__name__)

# Seconds between the reaper's checks that an unclaimed phase's message still exists.
RECHECK = 60


def pool_of(state: RunState, default: str) -> str:
    """The executor pool a run's phases go to: the `executor_pool` its snapshot pinned,
    unless that is only the setting's default; then `default` (the scheduler's pool)."""
    entry = state.snapshot.settings.get("executor_pool") if state.snapshot else None
    value = entry.get("value") if isinstance(entry, dict) else entry
    origin = entry.get("origin") if isinstance(entry, dict) else ""
    if isinstance(value, str) and valid_id(value) and origin != DEFAULT_ORIGIN:
        return value
    return default


def dispatch_message(state: RunState, phase: str) -> bytes:
    """The work-queue message of a phase; an apply's names the executor that planned."""
    planner = state.executor_id if phase == "apply" and state.planned else ""
    return wire.encode(
        wire.Dispatch(
            org=state.org,
            workspace=state.workspace,
            run_id=state.run_id,
            phase=phase,
            planner=planner,
        )
    )


def dispatch_id(run_id: str, phase: str, attempt: int = 0) -> str:
    """The work-queue message's `Nats-Msg-Id`: a phase is one message (deduplicated by the
    server for its duplicate window), however often it is dispatched. A phase given back
    by a draining executor (`attempt` claims given back, `RunState.released`) is a new
    message: the first one's id may still be in the window."""
    return f"{run_id}:{phase}:{attempt}" if attempt else f"{run_id}:{phase}"


async def dispatch(nc: NATS, run: RunState, phase: str, pool: str) -> bool:
    """Publish a phase to its pool's work queue; False if the server dropped it as a
    duplicate of a message published within its duplicate window."""
    with tracing.span("dispatch", run_id=run.run_id, phase=phase, pool=pool):
        ack = await nc.jetstream().publish(
            streams.dispatch_subject(pool, run.org),
            dispatch_message(run, phase),
            # the trace of the event that caused it (the executor's phase span follows it)
            headers=tracing.inject({"Nats-Msg-Id": dispatch_id(run.run_id, phase, run.released)}),
        )
    return not ack.duplicate


def marker(run: RunState, pool: str, *, recheck: int = RECHECK, since: str | None = None) -> bytes:
    """The `dispatched` marker of a phase: `timeout` is the dispatch timeout (0: none)."""
    cfg = run.config
    return body(
        lease_id="",
        kind=DISPATCHED,
        org=run.org,
        workspace=run.workspace,
        timeout=cfg.dispatch_timeout if cfg is not None else 0,
        pool=pool,
        recheck=recheck,
        dispatched_at=since,
    )


async def mark_dispatched(nc: NATS, run: RunState, phase: str, pool: str = "") -> None:
    """Start the dispatch clock of a phase (kept if it runs already: a redelivery)."""
    await Board(nc).put(subject(run.run_id, phase), marker(run, pool), expected=0)


async def adopt(board: Board, run: RunState) -> bool:
    """Beat on behalf of the run's current lease, unless a beat of that lease exists.

    Conditional on the subject's last sequence, so a beat the executor sends meanwhile
    is never overwritten by this older news. True if the beat was published.
    """
    beat = body(
        lease_id=run.lease_id,
        executor_id=run.executor_id,
        kind=CLAIMED,
        org=run.org,
        workspace=run.workspace,
        timeout=run.config.heartbeat_timeout if run.config else -1,
    )
    subj = subject(run.run_id, run.phase)
    for leader in (False, True):  # a refused put may mean a follower was behind: ask the leader
        last = await board.last(run.run_id, run.phase, leader=leader)
        if last is not None and last.lease_id == run.lease_id:
            return False
        if await board.put(subj, beat, expected=last.seq if last else 0):
            return True
    return False


async def follow(nc: NATS, app: App, action: Watch) -> None:
    """Carry out a `Watch` of the reaction table (events/react.py): purge the entries of
    the phases that ended, or adopt a claimed phase's lease (idempotent: a redelivery is
    harmless)."""
    board = Board(nc)
    org, ws, run_id = action.org, action.ws, action.run_id
    for phase in action.purge:
        await board.purge(subject(run_id, phase))
    if action.custom:
        await _purge_custom(board, app, org, ws, run_id)
    if action.adopt:
        run: RunState = (await app.load_run(org, ws, run_id)).state
        if run.lease_id and run.phase:  # still running: it may have ended already
            await adopt(board, run)


async def _purge_custom(board: Board, app: App, org: str, ws: str, run_id: str) -> None:
    """Purge the entries of the run's custom steps that ran, but the one live now."""
    run: RunState = (await app.load_run(org, ws, run_id)).state
    live = set() if run.terminal else {run.phase, run.waiting_phase}
    for s in run.steps[: run.step_at + 1]:
        phase = phase_of(s)
        if s.kind == "custom" and phase not in live:
            await board.purge(subject(run_id, phase))
