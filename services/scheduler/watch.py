"""What the scheduler puts on the heartbeat board as runs move, so the reaper sees them.

- When it dispatches a phase of a run with a dispatch timeout, a `dispatched` marker
  (published before the work-queue message, so no executor beat can precede it, and only
  on an empty subject, so a redelivered dispatch keeps the first time).
- When a phase is claimed (`run.phase_started`), a beat on the new lease's behalf unless
  the executor already beat: an executor that dies between its claim and its first beat
  is then reaped like any other silent one.
- When a phase ends, its entry is purged, so the board lists only live phases.
"""

from __future__ import annotations

import structlog
from nats.aio.client import Client as NATS

from events.run import RunState
from events.templates import phase_of
from services.commands import App
from services.infra.heartbeats import CLAIMED, DISPATCHED, PHASES, Board, body, subject

log = structlog.get_logger(__name__)

# Event types after which a phase's board entry is garbage, and which phases they end.
_ENDS = {
    "run.plan_finished": ("plan",),
    "run.apply_finished": ("apply",),
    "run.failed": PHASES,
    "run.canceled": PHASES,
}
# Event types after which a custom step's phase (`custom-<number>`) may have ended.
_CUSTOM_ENDS = frozenset({"run.custom_finished", "run.failed", "run.canceled"})
WATCHED = frozenset({"run.phase_started", *_ENDS, *_CUSTOM_ENDS})


async def mark_dispatched(nc: NATS, run: RunState, phase: str) -> None:
    """Start the dispatch clock of a phase, if the run has a dispatch timeout."""
    cfg = run.config
    if cfg is None or cfg.dispatch_timeout <= 0:
        return
    marker = body(
        lease_id="",
        kind=DISPATCHED,
        org=run.org,
        workspace=run.workspace,
        timeout=cfg.dispatch_timeout,
    )
    await Board(nc).put(subject(run.run_id, phase), marker, expected=0)


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


async def follow(nc: NATS, app: App, kind: str, org: str, ws: str, run_id: str) -> None:
    """React to one run event of a type in WATCHED (idempotent: redelivery is harmless)."""
    board = Board(nc)
    if kind != "run.phase_started":
        for phase in _ENDS.get(kind, ()):
            await board.purge(subject(run_id, phase))
        if kind in _CUSTOM_ENDS:
            await _purge_custom(board, app, org, ws, run_id)
        return
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
