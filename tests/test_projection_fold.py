"""The projection's folds, without I/O: given events, then rows."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import get_args

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events import run as run_agg
from events import vcs_report as vr
from events.codec import AnyEvent, ws_subject
from events.run import (
    AdmitRun,
    ClaimPhase,
    CreateRun,
    FailRun,
    FinishStep,
    StartStep,
)
from events.workspace import RunAdmitted, RunEnqueued, RunReleased, WorkspaceCreated
from projections.project import FOLDS
from projections.working import Unprojectable, iso, meta_of
from tests.projection_support import CONFIG, CREATE, SUBJECT, T0, Stream, decide_all, random_history


@settings(max_examples=300, deadline=None)
@given(run_type=st.sampled_from(run_agg.RUN_TYPES), length=st.integers(0, 40), data=st.data())
def test_projected_run_agrees_with_the_core_fold_after_every_event(
    run_type: str, length: int, data: st.DataObject
) -> None:
    """Status, phase, summaries and approval in the row equal events.run.fold of the prefix."""
    events = random_history(run_type, length, data)
    s = Stream()
    for i, event in enumerate(events, 1):
        s.add(SUBJECT, event)
        expected = run_agg.fold(events[:i])
        row = s.run("r1")
        assert row["status"] == str(expected.status)
        assert row["phase"] == (expected.phase or expected.waiting_phase or None)
        assert row["executor_id"] == (expected.executor_id or None)
        assert row["plan_add"] == (expected.plan_summary.add if expected.plan_summary else None)
        assert row["apply_add"] == (expected.apply_summary.add if expected.apply_summary else None)
        assert row["approved_by"] == (expected.approved_by or None)
        assert row["last_seq"] == i
    if run_agg.fold(events).terminal:
        steps = s.w.rows_of("steps", "r1")
        assert all(step["status"] != "running" for step in steps)


def test_a_failed_run_keeps_its_own_message_and_records_the_error_apart() -> None:
    """The core's RunState.message is overwritten by run.failed; the row keeps both."""
    create = CreateRun(
        actor="alice",
        run_id="r1",
        org="acme",
        workspace="net",
        run_type="plan",
        config=CONFIG,
        message="bump vpc",
    )
    events = decide_all([create, FailRun(actor="reaper", reason="timeout", message="took 2h")])
    s = Stream()
    s.add(SUBJECT, *events)
    row = s.run("r1")
    assert (row["status"], row["message"], row["reason"], row["error_message"]) == (
        "failed",
        "bump vpc",
        "timeout",
        "took 2h",
    )


def test_a_run_that_fails_under_a_running_step_fails_that_step() -> None:
    """The executor vanished mid-step: the step must not stay 'running' forever."""
    events = decide_all(
        [
            CREATE,
            AdmitRun(actor="s"),
            ClaimPhase(actor="x", phase="plan", lease_id="l1", executor_id="x1"),
            StartStep(actor="x", lease_id="l1", step="checkout"),
            FinishStep(actor="x", lease_id="l1", step="checkout", ok=True, started_at=T0),
            StartStep(actor="x", lease_id="l1", step="init"),
            FailRun(actor="reaper", reason="executor_unavailable"),
        ]
    )
    s = Stream()
    s.add(SUBJECT, *events)
    steps = {r["step"]: r for r in s.w.rows_of("steps", "r1")}
    assert steps["checkout"]["status"] == "ok"
    assert steps["init"]["status"] == "failed"
    assert steps["init"]["error"] == "run failed: executor_unavailable"
    assert steps["init"]["phase"] == "plan"
    assert steps["init"]["ended_at"] == iso(events[-1].at)


def test_step_duration_runs_from_step_started_to_step_finished() -> None:
    events = decide_all(
        [
            CREATE,
            AdmitRun(actor="s"),
            ClaimPhase(actor="x", phase="plan", lease_id="l1", executor_id="x1"),
            StartStep(actor="x", lease_id="l1", step="init"),
            FinishStep(actor="x", lease_id="l1", step="init", ok=False, started_at=T0, error="no"),
        ]
    )
    s = Stream()
    s.add(SUBJECT, *events)
    (step,) = s.w.rows_of("steps", "r1")
    assert step["duration_ms"] == 1000  # decide_all ticks one second per command
    assert (step["status"], step["error"]) == ("failed", "no")


def test_workspace_queue_follows_enqueue_admit_and_release() -> None:
    s = Stream()
    subject = ws_subject("acme", "net")
    s.add(subject, WorkspaceCreated(at=T0, actor="a", org="acme", name="net", config=CONFIG))
    s.add(subject, *(RunEnqueued(at=T0, actor="a", run_id=r) for r in ("r1", "r2", "r3")))
    s.add(subject, RunAdmitted(at=T0, actor="s", run_id="r1"))
    s.add(subject, RunReleased(at=T0, actor="a", run_id="r3", status="canceled"))
    queue = sorted(s.w.rows["ws_queue"].values(), key=lambda r: r["position"])
    assert [r["run_id"] for r in queue] == ["r2"]
    assert s.w.rows["workspaces"][("acme", "net")]["active_run"] == "r1"
    s.add(subject, RunReleased(at=T0, actor="a", run_id="r1", status="applied"))
    assert s.w.rows["workspaces"][("acme", "net")]["active_run"] is None


def test_events_of_aggregates_never_created_are_unprojectable() -> None:
    s = Stream()
    queued = run_agg.RunQueued(at=T0, actor="s")
    with pytest.raises(Unprojectable, match="never created"):
        s.add(SUBJECT, queued)
    with pytest.raises(Unprojectable, match="never created"):
        s.add(ws_subject("acme", "net"), RunEnqueued(at=T0, actor="a", run_id="r1"))


def test_times_are_fixed_width_utc_text() -> None:
    """Fixed width keeps text order equal to time order for ORDER BY created_at."""
    plus2 = timezone(timedelta(hours=2))
    assert iso(datetime(2025, 1, 1, 2, 0, tzinfo=plus2)) == "2025-01-01T00:00:00.000000Z"
    assert iso(datetime(2025, 1, 1, 0, 0, 0, 5, tzinfo=UTC)) == "2025-01-01T00:00:00.000005Z"


@settings(max_examples=2000)
@given(st.datetimes(timezones=st.just(UTC)))
def test_times_are_the_isoformat_text_of_their_utc_time(dt: datetime) -> None:
    """`iso` of a UTC time is what `isoformat` gives, for every time of every year
    (msgspec's RFC 3339 encoder does the work: a change of its format must not change
    the stored text)."""
    assert iso(dt) == dt.replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"


def test_subjects_name_their_aggregate() -> None:
    def parts(subject: str) -> tuple[str, str | None, str | None, str | None]:
        m = meta_of(1, subject, 0)
        return m.kind, m.org, m.workspace, m.run_id

    assert parts("rp.run.acme.net.r1") == ("run", "acme", "net", "r1")
    assert parts("rp.ws.acme.net") == ("ws", "acme", "net", None)
    assert parts("rp.org.acme") == ("org", "acme", None, None)
    assert parts("rp.other") == ("", None, None, None)
    stored = meta_of(1, "rp.org.acme", 1_500_000_000_123_456_789).stored_at
    assert stored == "2017-07-14T02:40:00.123456Z"


def test_every_event_type_the_codec_decodes_has_a_fold() -> None:
    """The projection is a table of folds by event type: a type missing from it would
    stop the batch that meets it, so every member of `AnyEvent` has its entry."""
    assert set(get_args(AnyEvent)) - set(FOLDS) == set()


def test_a_pull_requests_report_is_kept_in_the_audit_history_and_skipped_by_nothing() -> None:
    """The VCS reporter's events (rows, comment claims and links) are the audit's only: they
    used to fall to the run fold, which found no run in their subject (Unprojectable: the
    batch recorded each as skipped, with a warning)."""
    s = Stream()
    subject = vr.subject("acme", "k1")
    s.add(subject, vr.CommentClaimed(at=T0, actor="vcs", claim="c1"))
    s.add(subject, vr.CommentLinked(at=T0, actor="vcs", claim="c1", comment_id=7))
    assert [row[5] for row in s.w.audit] == ["org.vcs_comment_claimed", "org.vcs_comment_linked"]
    assert s.w.dirty.get("skipped", {}) == {}
