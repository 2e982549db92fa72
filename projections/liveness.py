"""Who is responsible for an open run right now: a live owner, or a deadline. Pure.

Decided on the heartbeat board's entries (RP_HEARTBEATS, infra/heartbeats.py) as the
read model holds them: `run_liveness`, one row per entry, folded by
projections/board.py. The owner is the executor whose beats hold the running phase's
lease; the deadline the earliest of the run's limits (services/processes/scheduler/
limits.py) and, while a phase waits for an executor, its dispatch timeout; a phase that
may wait for ever shows instead when the reaper next checks that it is dispatched
(`dispatch_check`, services/processes/scheduler/reaper.py). A run that has ended has
neither, whatever the board still holds. Times are the server's.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from events.run import TERMINAL, WAITING, Status
from infra.heartbeats import DEADLINE, Beat

Row = dict[str, Any]

_ENDED = frozenset(str(s) for s in TERMINAL)
_RUNNING = frozenset({str(Status.PLANNING), str(Status.APPLYING), str(Status.RUNNING)})
_WAITING = frozenset(str(s) for s in WAITING)
_NEITHER: Row = {"owner": None, "deadline": None}

# `run_liveness` joined to a run's row twice: the entry of the phase it runs or waits for
# (the runs table's `phase`), and its deadline marker. Each a primary-key probe.
JOIN = (
    "LEFT JOIN run_liveness p ON p.run_id = runs.id AND p.phase = runs.phase "
    f"LEFT JOIN run_liveness d ON d.run_id = runs.id AND d.phase = '{DEADLINE}'"
)
COLUMNS = (
    "p.seq AS p_seq, p.at AS p_at, p.lease_id AS p_lease_id, p.executor_id AS p_executor_id, "
    "p.timeout AS p_timeout, p.recheck AS p_recheck, p.dispatched_at AS p_dispatched_at, "
    "d.seq AS d_seq, d.run_deadline AS d_run_deadline, "
    "d.approval_deadline AS d_approval_deadline"
)


class Entry(NamedTuple):
    """A phase's last board entry: an executor's beat (`lease_id` set), the scheduler's
    beat for a fresh lease, or the `dispatched` marker while nobody holds the phase."""

    at: datetime  # the server's receipt time
    lease_id: str
    executor_id: str
    timeout: int  # dispatch timeout of a marker, seconds (0 or less: none)
    recheck: int  # how often the reaper checks a marker's dispatch, seconds (0: never)
    dispatched_at: datetime | None  # a marker's first dispatch (None: its own time)


class Limits(NamedTuple):
    """A run's deadline marker: when its limits pass."""

    run_deadline: datetime | None
    approval_deadline: datetime | None


def liveness(status: str, phase: str | None, entry: Entry | None, limits: Limits | None) -> Row:
    """`owner` and `deadline` of a run with this status and phase (the one it runs or
    waits for), given its phase's board entry and its deadline marker."""
    if status in _ENDED:
        return dict(_NEITHER)
    owner = None
    deadlines: list[tuple[datetime, str]] = []
    check = None  # a phase waiting for ever: when the reaper makes sure it is dispatched
    if phase and entry is not None:
        if status in _RUNNING and entry.lease_id:
            owner = {
                "executor_id": entry.executor_id or None,
                "lease_id": entry.lease_id,
                "last_beat_at": iso(entry.at),
            }
        if status in _WAITING and not entry.lease_id:
            start = entry.dispatched_at or entry.at
            if entry.timeout > 0:
                deadlines.append((start + timedelta(seconds=entry.timeout), "dispatch_timeout"))
            if entry.recheck > 0:
                check = (entry.at + timedelta(seconds=entry.recheck), "dispatch_check")
    if limits is not None:
        deadlines += _limits(limits, status)
    if not deadlines and check is not None:
        deadlines.append(check)
    first = min(deadlines) if deadlines else None
    deadline = {"kind": first[1], "at": iso(first[0])} if first else None
    return {"owner": owner, "deadline": deadline}


def _limits(limits: Limits, status: str) -> list[tuple[datetime, str]]:
    out = []
    if limits.run_deadline is not None and status != Status.APPLYING:  # never interrupted
        out.append((limits.run_deadline, "run_timeout"))
    if limits.approval_deadline is not None and status == Status.AWAITING_APPROVAL:
        out.append((limits.approval_deadline, "approval_timeout"))
    return out


# ---------------------------------------------------------------- stored values


def project_beat(beat: Beat) -> tuple[Any, ...]:
    """A board entry as its `run_liveness` row (values in the table's column order)."""
    b = beat.body
    return (
        beat.run_id,
        beat.phase,
        beat.seq,
        iso(beat.time),
        b.lease_id,
        b.executor_id,
        b.timeout,
        b.recheck,
        iso(b.dispatched_at),
        iso(b.run_deadline),
        iso(b.approval_deadline),
    )


def of_row(row: Any) -> Row:
    """`owner` and `deadline` of a run row read with `COLUMNS` through `JOIN`."""
    status = row["status"]
    if status in _ENDED:
        return dict(_NEITHER)
    entry = None
    if row["p_seq"] is not None:
        entry = Entry(
            at=datetime.fromisoformat(row["p_at"]),
            lease_id=row["p_lease_id"] or "",
            executor_id=row["p_executor_id"] or "",
            timeout=row["p_timeout"] or 0,
            recheck=row["p_recheck"] or 0,
            dispatched_at=_parse(row["p_dispatched_at"]),
        )
    limits = None
    if row["d_seq"] is not None:
        limits = Limits(_parse(row["d_run_deadline"]), _parse(row["d_approval_deadline"]))
    return liveness(status, row["phase"], entry, limits)


def iso(dt: datetime | None) -> str | None:
    """A time as the API shows every time: UTC, to the microsecond, with `Z`."""
    if dt is None:
        return None
    return dt.astimezone(UTC).replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"


def _parse(text: str | None) -> datetime | None:
    return None if text is None else datetime.fromisoformat(text)
