"""Run limits: `approval_timeout` and `run_timeout`, kept as deadline markers on the board.

The scheduler keeps one marker per open run, `rp.hb.<run>.deadline`, in RP_HEARTBEATS
beside the phases' beats: `{"kind": "deadline", "run_deadline", "approval_deadline",
"version", "pool"}` (both deadlines null when the run has no limit: the marker still says
the run is open, so the reaper sees every open run, see services/processes/scheduler/reaper.py).
Deadlines are computed from the run's own events and their server receipt times
(`Nats-Time-Stamp`): `run_timeout` counts from `run.created`, `approval_timeout` from the
`run.plan_finished` that left the run awaiting approval. So a restarted scheduler or
reaper finds them where they were, and no clock but the server's enters. A marker is
rewritten as the run moves (conditionally, and only by news of a newer run version) and
purged once the run ends.

The reaper compares them with the server's "now" every round:

- awaiting approval past `approval_deadline`: discarded, reason `approval_timeout`;
- open past `run_deadline`: failed, reason `run_timeout`, unless an apply is in
  progress: an apply is never interrupted by a limit, so it is marked once
  (`run.limit_exceeded`) and the run ends as the apply does.

Each action is guarded by the status it was judged on, so replicas act at most once, and
taken only on a marker the stream's leader still has as the run's last.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

import msgspec
import structlog

from events.errors import DomainError, IllegalTransition
from events.run import (
    TERMINAL,
    DiscardRun,
    ExceedLimit,
    FailRun,
    PlanFinished,
    RunCreated,
    RunState,
    Status,
)
from events.run import fold as fold_run
from infra.heartbeats import DEADLINE, Beat, Board, body, subject
from services.app.commands import App
from services.processes.scheduler.watch import pool_of

log = structlog.get_logger(__name__)

ACTOR = "reaper"
APPROVAL = "approval_timeout"
RUN = "run_timeout"


class Limit(StrEnum):
    KEEP = "keep"
    DISCARD = "discard"  # awaiting approval past its approval_timeout
    FAIL = "fail"  # open past its run_timeout
    MARK = "mark"  # past its run_timeout during an apply: recorded, not interrupted
    PURGE = "purge"  # the run ended: the marker is garbage


def setting(run: RunState, name: str, fallback: dict[str, Any] | None = None) -> int:
    """A limit in seconds from the run's admission snapshot, else from `fallback`."""
    settings = run.snapshot.settings if run.snapshot else (fallback or {})
    entry = settings.get(name)
    value = entry.get("value") if isinstance(entry, dict) else entry
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def deadlines(
    run: RunState, times: dict[str, datetime], fallback: dict[str, Any] | None = None
) -> tuple[datetime | None, datetime | None]:
    """(run deadline, approval deadline) of an open run; `times` holds the server times
    of its `created` and last `plan_finished` events. Pure."""
    run_s, approval_s = setting(run, RUN, fallback), setting(run, APPROVAL, fallback)
    created, planned = times.get("created"), times.get("planned")
    run_at = created + timedelta(seconds=run_s) if run_s and created else None
    waiting = run.status == Status.AWAITING_APPROVAL
    approval_at = planned + timedelta(seconds=approval_s) if approval_s and planned else None
    return run_at, approval_at if waiting else None


def judge(beat: Beat, run: RunState, now: datetime) -> Limit:
    """What a deadline marker calls for now. Pure."""
    if not run.exists or run.terminal:
        return Limit.PURGE
    b = beat.body
    if b.approval_deadline and b.approval_deadline <= now:
        if run.status == Status.AWAITING_APPROVAL:
            return Limit.DISCARD
    if b.run_deadline and b.run_deadline <= now:
        if run.status == Status.APPLYING:
            return Limit.KEEP if run.limit_exceeded else Limit.MARK
        return Limit.FAIL
    return Limit.KEEP


# RP_HEARTBEATS keeps messages 24 h: a marker older than this is written again, unchanged.
REFRESH_AFTER = timedelta(hours=12)


def stale(beat: Beat, now: datetime) -> bool:
    """A marker to write again before the stream's max age drops it (limits reach 30 d)."""
    return now - beat.time > REFRESH_AFTER


async def refresh(board: Board, beat: Beat) -> None:
    """Write a marker again as it is (unless it changed meanwhile)."""
    data = msgspec.json.encode(beat.body)
    await board.put(beat.subject, data, expected=beat.seq)


def due(beat: Beat, now: datetime) -> bool:
    b = beat.body
    return any(d is not None and d <= now for d in (b.run_deadline, b.approval_deadline))


# ------------------------------------------------------------ the scheduler's side


async def follow(
    app: App, board: Board, org: str, ws: str, run_id: str, *, pool: str = "default"
) -> None:
    """Bring the run's deadline marker up to date (idempotent; only newer news wins).
    `pool` is the scheduler's: where the run's phases go unless its settings say."""
    envs = await app.store.read(f"rp.run.{org}.{ws}.{run_id}")
    run = fold_run([e.event for e in envs])  # type: ignore[misc]  # a run subject holds run events
    subj = subject(run_id, DEADLINE)
    if not run.exists or run.status in TERMINAL:
        await board.purge(subj)
        return
    times: dict[str, datetime] = {}
    for e in envs:
        if e.time is not None and isinstance(e.event, RunCreated):
            times["created"] = e.time
        elif e.time is not None and isinstance(e.event, PlanFinished):
            times["planned"] = e.time
    fallback = None if run.snapshot else await app.effective_settings(org, ws)
    run_at, approval_at = deadlines(run, times, fallback)
    if run.status == Status.PENDING and run_at is None and approval_at is None:
        # A pending run with no limit needs no marker yet: it waits behind the run that
        # holds its workspace (which has one), and one on no queue is enqueued by its
        # `run.created`, redelivered until it is; its `run.queued` writes the marker. A
        # write here sat in front of every admission (create->queued p99 6 -> 24 ms).
        return
    await _publish(board, subj, run, run_at, approval_at, pool_of(run, pool))


async def _publish(
    board: Board,
    subj: str,
    run: RunState,
    run_at: datetime | None,
    approval_at: datetime | None,
    pool: str,
) -> None:
    for i in range(3):  # after a refused put, from the leader (a follower may be behind)
        last = await board.last(run.run_id, DEADLINE, leader=i > 0)
        if last is not None and last.body.version >= run.version:
            return
        marker = body(
            kind=DEADLINE,
            org=run.org,
            workspace=run.workspace,
            run_deadline=run_at.isoformat() if run_at else None,
            approval_deadline=approval_at.isoformat() if approval_at else None,
            version=run.version,
            pool=pool,
        )
        if await board.put(subj, marker, expected=last.seq if last else 0):
            return


# ------------------------------------------------------------ the reaper's side


async def enforce(app: App, board: Board, beat: Beat, now: datetime) -> Limit:
    """Act on one due deadline marker, guarded by the status it was judged on."""
    b = beat.body
    loaded = await app.load_run(b.org or "*", b.workspace or None, beat.run_id)
    run: RunState = loaded.state
    verdict = judge(beat, run, now)
    if verdict != Limit.KEEP and not await _current(board, beat):
        return Limit.KEEP  # the marker changed since the board was read: next round
    with structlog.contextvars.bound_contextvars(run_id=beat.run_id, limit=str(verdict)):
        try:
            await _act(app, run, verdict, now)
        except DomainError as e:  # another reaper, or the run itself, got there first
            log.info("limit_skipped", why=str(e))
            return Limit.KEEP
    if verdict in (Limit.PURGE, Limit.DISCARD, Limit.FAIL):
        await board.purge(beat.subject, through=beat.seq)
    return verdict


async def _current(board: Board, beat: Beat) -> bool:
    """Whether the marker is still its subject's last as the stream's leader has it: the
    board may have been read from a follower that is behind, with a deadline since moved
    (a new plan awaiting approval has a new approval deadline)."""
    last = await board.last(beat.run_id, DEADLINE, leader=True)
    return last is not None and last.seq == beat.seq


async def _act(app: App, run: RunState, verdict: Limit, now: datetime) -> None:
    # A pending run has no snapshot yet: its limits are the workspace's effective ones.
    fallback = None if run.snapshot else await app.effective_settings(run.org, run.workspace)
    seconds = setting(run, APPROVAL if verdict == Limit.DISCARD else RUN, fallback)
    match verdict:
        case Limit.DISCARD:
            cmd: Any = DiscardRun(actor=ACTOR, reason=APPROVAL)
        case Limit.FAIL:
            message = f"the run was open longer than its run_timeout of {seconds}s"
            cmd = FailRun(actor=ACTOR, reason=RUN, message=message)
        case Limit.MARK:
            message = (
                f"the run was open longer than its run_timeout of {seconds}s; "
                "the apply in progress is not interrupted"
            )
            cmd = ExceedLimit(actor=ACTOR, limit=RUN, message=message)
        case _:
            return
    await app.run_command(run.org, run.workspace, run.run_id, cmd, guard=_same(run))
    log.warning("run_limit_exceeded", status=str(run.status), action=str(verdict))


def _same(judged: RunState) -> Any:
    """Act only while the run is as it was judged: same status, same lease."""

    def guard(run: RunState) -> None:
        if run.status != judged.status or run.lease_id != judged.lease_id:
            raise IllegalTransition("the run moved on since it was judged", status=str(run.status))

    return guard
