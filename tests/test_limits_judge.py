"""The run limits' pure parts: deadlines from the run's events, and what a due marker
calls for in each status. Synchronous, no I/O."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import msgspec
import pytest

from events.run import RunState, Snapshot, Status
from infra.heartbeats import Beat, Body
from services.processes.scheduler.limits import Limit, deadlines, judge, stale

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def run(status: Status, **settings: int) -> RunState:
    snap = Snapshot(settings={k: {"value": v, "origin": "workspace"} for k, v in settings.items()})
    return RunState(run_id="r", status=status, snapshot=snap)


def marker(run_at: int | None = None, approval_at: int | None = None) -> Beat:
    body = Body(
        kind="deadline",
        run_deadline=None if run_at is None else T0 + timedelta(seconds=run_at),
        approval_deadline=None if approval_at is None else T0 + timedelta(seconds=approval_at),
    )
    return Beat(subject="rp.hb.r.deadline", seq=1, time=T0, run_id="r", phase="deadline", body=body)


def test_run_timeout_counts_from_creation_and_approval_timeout_from_the_plan() -> None:
    times = {"created": T0, "planned": T0 + timedelta(seconds=30)}
    waiting = run(Status.AWAITING_APPROVAL, run_timeout=100, approval_timeout=20)
    assert deadlines(waiting, times) == (T0 + timedelta(seconds=100), T0 + timedelta(seconds=50))


def test_a_limit_of_zero_sets_no_deadline_and_approval_only_counts_while_awaiting() -> None:
    times = {"created": T0, "planned": T0}
    assert deadlines(run(Status.QUEUED, run_timeout=0), times) == (None, None)
    assert deadlines(run(Status.APPLY_QUEUED, approval_timeout=5), times) == (None, None)


def test_a_pending_run_without_a_snapshot_uses_the_effective_settings() -> None:
    pending = msgspec.structs.replace(run(Status.PENDING), snapshot=None)
    fallback = {"run_timeout": {"value": 7, "origin": "org"}}
    assert deadlines(pending, {"created": T0}, fallback) == (T0 + timedelta(seconds=7), None)


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (Status.PENDING, Limit.FAIL),
        (Status.QUEUED, Limit.FAIL),
        (Status.PLANNING, Limit.FAIL),
        (Status.AWAITING_APPROVAL, Limit.FAIL),
        (Status.APPLY_QUEUED, Limit.FAIL),
        (Status.APPLYING, Limit.MARK),
        (Status.APPLIED, Limit.PURGE),
        (Status.CANCELED, Limit.PURGE),
    ],
)
def test_past_the_run_deadline_an_open_run_fails_but_an_apply_is_only_marked(
    status: Status, expected: Limit
) -> None:
    assert judge(marker(run_at=10), run(status), T0 + timedelta(seconds=11)) == expected


def test_an_apply_marked_once_is_kept_and_nothing_is_due_before_its_time() -> None:
    marked = msgspec.structs.replace(run(Status.APPLYING), limit_exceeded="run_timeout")
    assert judge(marker(run_at=10), marked, T0 + timedelta(seconds=11)) == Limit.KEEP
    assert judge(marker(run_at=10), run(Status.QUEUED), T0 + timedelta(seconds=9)) == Limit.KEEP


def test_past_the_approval_deadline_only_a_run_still_awaiting_approval_is_discarded() -> None:
    later = T0 + timedelta(seconds=6)
    assert judge(marker(approval_at=5), run(Status.AWAITING_APPROVAL), later) == Limit.DISCARD
    assert judge(marker(approval_at=5), run(Status.APPLY_QUEUED), later) == Limit.KEEP


def test_a_marker_is_written_again_well_before_the_streams_24_hour_max_age() -> None:
    assert not stale(marker(run_at=10), T0 + timedelta(hours=11))
    assert stale(marker(run_at=10), T0 + timedelta(hours=13))
