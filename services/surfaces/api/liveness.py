"""Who is responsible for an open run right now: a live owner, or a deadline.

Read from the heartbeat board (RP_HEARTBEATS, see infra/heartbeats.py), not the
read model: the owner is the executor whose beats hold the running phase's lease, the
deadline the earliest of the run's limits (services/processes/scheduler/limits.py) and, while a
phase waits for an executor, its dispatch timeout; a phase that may wait for ever shows
instead when the reaper next checks that it is dispatched (`dispatch_check`, services/
scheduler/reaper.py). Times are the server's.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from infra.heartbeats import DEADLINE, Beat, Board
from services.surfaces.api.render import _time

Row = dict[str, Any]
_RUNNING = frozenset({"planning", "applying", "running"})
_WAITING = frozenset({"queued", "apply_queued"})


async def liveness(board: Board, run: Row) -> Row:
    """`owner` and `deadline` of a run row (both null once it has ended)."""
    status, run_id = run["status"], run["id"]
    owner = None
    deadlines: list[tuple[datetime, str]] = []
    phase = run.get("phase") or ""  # the phase running, or waiting for an executor
    if phase and status in _RUNNING:
        beat = await board.last(run_id, phase)
        if beat is not None and beat.lease_id:
            owner = {
                "executor_id": beat.body.executor_id or None,
                "lease_id": beat.lease_id,
                "last_beat_at": _time(beat.time),
            }
    check = None  # a phase waiting for ever: when the reaper makes sure it is dispatched
    if phase and status in _WAITING:
        beat = await board.last(run_id, phase)
        if beat is not None and not beat.lease_id:
            start = beat.body.dispatched_at or beat.time
            if beat.body.timeout > 0:
                deadlines.append((start + timedelta(seconds=beat.body.timeout), "dispatch_timeout"))
            if beat.body.recheck > 0:
                check = (beat.time + timedelta(seconds=beat.body.recheck), "dispatch_check")
    if (marker := await board.last(run_id, DEADLINE)) is not None:
        deadlines += _limits(marker, status)
    if not deadlines and check is not None:
        deadlines.append(check)
    first = min(deadlines) if deadlines else None
    deadline = {"kind": first[1], "at": _time(first[0])} if first else None
    return {"owner": owner, "deadline": deadline}


def _limits(marker: Beat, status: str) -> list[tuple[datetime, str]]:
    b = marker.body
    out = []
    if b.run_deadline is not None and status != "applying":  # an apply is never interrupted
        out.append((b.run_deadline, "run_timeout"))
    if b.approval_deadline is not None and status == "awaiting_approval":
        out.append((b.approval_deadline, "approval_timeout"))
    return out
