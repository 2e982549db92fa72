"""Per-resource apply states without I/O: `apply -json` records in, reports out, and the
projection's rows from the events. Records have the shapes Terraform 1.0.3 printed."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from events.run import (
    AdmitRun,
    ApproveRun,
    ClaimPhase,
    FailRun,
    FinishApply,
    FinishPlan,
    PlanSummary,
    ReportResource,
    RunCommand,
)
from events.values import ResourceChange
from executor.applystate import UNFINISHED, ApplyOutput, Report, Reporter, Tracker
from projections.changes import current_state
from tests.projection_support import CREATE, SUBJECT, Stream, decide_all

# ---------------------------------------------------------------- apply states


def hook(kind: str, address: str, action: str, message: str = "") -> dict[str, Any]:
    return {
        "type": kind,
        "@message": message,
        "hook": {"resource": {"addr": address}, "action": action},
    }


def diagnostic(summary: str, address: str | None = None, severity: str = "error") -> dict[str, Any]:
    d: dict[str, Any] = {"severity": severity, "summary": summary, "detail": "details"}
    if address:
        d["address"] = address
    return {"type": "diagnostic", "diagnostic": d}


def feed(tracker: Tracker, *records: dict[str, Any]) -> list[Report]:
    return [r for record in records for r in tracker.take(record)]


def test_a_replacement_reports_both_stages_in_the_order_they_ran() -> None:
    t = Tracker({"fake_thing.rep": "replace", "fake_thing.cbd": "replace"})
    got = feed(
        t,
        hook("apply_start", "fake_thing.rep", "delete"),
        hook("apply_start", "fake_thing.cbd", "create"),
        hook("apply_complete", "fake_thing.rep", "delete"),
        hook("apply_complete", "fake_thing.cbd", "create"),
        hook("apply_start", "fake_thing.rep", "create"),
        hook("apply_start", "fake_thing.cbd", "delete"),
        hook("apply_complete", "fake_thing.cbd", "delete"),
        hook("apply_complete", "fake_thing.rep", "create"),
    )
    stages = {a: [(r.action, r.state) for r in got if r.address == a] for a in t.planned}
    assert stages["fake_thing.rep"] == [
        ("delete", "applying"),
        ("delete", "done"),
        ("create", "applying"),
        ("create", "done"),
    ]
    assert stages["fake_thing.cbd"] == [
        ("create", "applying"),
        ("create", "done"),
        ("delete", "applying"),
        ("delete", "done"),
    ]
    assert t.finish() == []


def test_a_failure_waits_for_its_diagnostic_and_later_resources_are_not_applied() -> None:
    """Terraform prints the error after the apply: `failed` carries it; what never started
    is `not_applied`; the run's error is the resource's."""
    t = Tracker({"a.first": "create", "a.second": "create", "a.third": "create"})
    got = feed(
        t,
        hook("apply_start", "a.first", "create"),
        hook("apply_complete", "a.first", "create"),
        hook("apply_start", "a.second", "create"),
        hook("apply_errored", "a.second", "create", "a.second: Creation errored after 0s"),
    )
    assert [(r.address, r.state) for r in got] == [
        ("a.first", "applying"),
        ("a.first", "done"),
        ("a.second", "applying"),
    ]
    (failed,) = feed(t, diagnostic("second failed on purpose", "a.second"))
    assert failed == Report(
        "a.second", "create", "failed", "Error: second failed on purpose\ndetails"
    )
    assert t.finish() == [Report("a.third", "create", "not_applied")]
    assert t.run_error() == "a.second: Error: second failed on purpose\ndetails"


def test_an_error_that_names_no_resource_is_the_runs() -> None:
    t = Tracker({"a.x": "update"})
    assert (
        feed(t, diagnostic("Provider crashed"), diagnostic("just a warning", severity="warning"))
        == []
    )
    assert t.run_error() == "Error: Provider crashed\ndetails"
    assert t.finish() == [Report("a.x", "update", "not_applied")]


def test_a_diagnostic_before_the_errored_hook_is_used_when_it_comes() -> None:
    t = Tracker({"a.x": "update"})
    feed(t, hook("apply_start", "a.x", "update"), diagnostic("boom", "a.x"))
    (failed,) = feed(t, hook("apply_errored", "a.x", "update"))
    assert (failed.state, failed.error) == ("failed", "Error: boom\ndetails")


def test_what_the_end_leaves_open_is_failed_or_not_applied() -> None:
    """An errored hook never explained keeps its own message; a change in flight failed;
    a replacement that ran one stage has its other stage not applied."""
    t = Tracker({"a.err": "create", "a.flight": "update", "a.rep": "replace"})
    feed(
        t,
        hook("apply_start", "a.err", "create"),
        hook("apply_errored", "a.err", "create", "a.err: Creation errored after 1s"),
        hook("apply_start", "a.flight", "update"),
        hook("apply_start", "a.rep", "delete"),
        hook("apply_complete", "a.rep", "delete"),
    )
    assert t.finish() == [
        Report("a.err", "create", "failed", "a.err: Creation errored after 1s"),
        Report("a.flight", "update", "failed", UNFINISHED),
        Report("a.rep", "create", "not_applied"),
    ]


def test_a_resource_that_fails_before_it_starts_is_failed_only() -> None:
    t = Tracker({"a.x": "update"})
    (failed,) = feed(t, diagnostic("Provider configuration not present", "a.x"))
    assert (failed.action, failed.state) == ("update", "failed")
    assert t.finish() == []


class _Sent(Reporter):
    """The reports in the order the apply's output sends them (no run to send them to)."""

    def __init__(self) -> None:
        self.sent: list[Report] = []

    def send(self, reports: list[Report]) -> None:
        self.sent += reports


async def test_the_apply_reads_the_plans_changes_beside_terraform_and_a_diagnostic_waits() -> None:
    """The plan's changes are read while Terraform starts (executor/applystate.py
    `track`): hooks go out at once, but a diagnostic naming a planned resource waits for
    them (read first, it would be the run's error, not the resource's) and so does all
    that follows it, in order."""
    planned: asyncio.Future[dict[str, str]] = asyncio.get_running_loop().create_future()
    sent = _Sent()
    out = ApplyOutput(Tracker({}), sent, planned)

    def line(record: dict[str, Any]) -> str:  # as Terraform prints it
        return json.dumps(record, separators=(",", ":"))

    out.feed(line(hook("apply_start", "a.x", "update")))
    assert sent.sent == [Report("a.x", "update", "applying")]
    out.feed(line(diagnostic("boom", "a.x")))
    out.feed(line(hook("apply_errored", "a.x", "update")))
    assert len(sent.sent) == 1  # held until the changes are known
    planned.set_result({"a.x": "update", "a.y": "create"})
    out.feed(line(hook("apply_start", "a.y", "create")))
    assert sent.sent[1:] == [
        Report("a.x", "update", "failed", "Error: boom\ndetails"),
        Report("a.y", "create", "applying"),
    ]
    assert out.tracker.run_error() == "a.x: Error: boom\ndetails"


def test_an_error_after_completion_fails_the_resource() -> None:
    t = Tracker({"a.x": "create"})
    feed(t, hook("apply_start", "a.x", "create"), hook("apply_complete", "a.x", "create"))
    (failed,) = feed(t, diagnostic("Provider produced inconsistent result after apply", "a.x"))
    assert (failed.action, failed.state) == ("create", "failed")
    assert t.finish() == []


# ---------------------------------------------------------------- projection rows


PLAN = [
    ResourceChange(address="t.a", type="t", action="create"),
    ResourceChange(address="t.rep", type="t", action="replace", replace_paths=["name"]),
    ResourceChange(address="t.c", type="t", action="update"),
    ResourceChange(address="data.t.d", type="t", action="read"),
]


def _approved() -> list[RunCommand]:
    return [
        CREATE,
        AdmitRun(actor="s"),
        ClaimPhase(actor="x", phase="plan", lease_id="l1", executor_id="x"),
        FinishPlan(
            actor="x",
            lease_id="l1",
            commit="c",
            has_changes=True,
            summary=PlanSummary(add=1),
            changes=PLAN,
        ),
        ApproveRun(actor="bob"),
    ]


def _states(s: Stream) -> dict[str, list[tuple[str, str]]]:
    rows = sorted(s.w.rows["resource_states"].values(), key=lambda r: (r["address"], r["stage"]))
    out: dict[str, list[tuple[str, str]]] = {}
    for r in rows:
        out.setdefault(r["address"], []).append((r["action"], r["state"]))
    return out


def test_approval_makes_every_planned_resource_pending() -> None:
    s = Stream()
    s.add(SUBJECT, *decide_all(_approved()))
    assert [r["address"] for r in s.w.rows_of("changes", "r1")] == [
        "t.a",
        "t.rep",
        "t.c",
        "data.t.d",
    ]
    assert _states(s) == {
        "t.a": [("create", "pending")],
        "t.rep": [("replace", "pending")],
        "t.c": [("update", "pending")],
    }


def test_reports_move_stages_and_the_end_closes_what_is_left() -> None:
    """A replacement gets two stages; when the run fails, pending is not_applied and
    applying is failed."""
    claim = ClaimPhase(actor="x", phase="apply", lease_id="l2", executor_id="x")

    def report(address: str, action: str, state: str) -> ReportResource:
        return ReportResource(actor="x", lease_id="l2", address=address, action=action, state=state)

    s = Stream()
    s.add(
        SUBJECT,
        *decide_all(
            [
                *_approved(),
                claim,
                report("t.rep", "delete", "applying"),
                report("t.rep", "delete", "done"),
                report("t.rep", "create", "applying"),
                report("t.rep", "create", "done"),
                report("t.c", "update", "applying"),
                FailRun(actor="x", lease_id="l2", reason="executor_unavailable"),
            ]
        ),
    )
    states = _states(s)
    assert states["t.rep"] == [("delete", "done"), ("create", "done")]
    assert states["t.a"] == [("create", "not_applied")]
    assert states["t.c"] == [("update", "failed")]
    (c,) = [r for r in s.w.rows["resource_states"].values() if r["address"] == "t.c"]
    assert c["error"] == "the run ended (failed: executor_unavailable) before this change finished"


def test_an_applied_run_keeps_its_reported_states() -> None:
    events = decide_all(
        [
            *_approved(),
            ClaimPhase(actor="x", phase="apply", lease_id="l2", executor_id="x"),
            *(
                ReportResource(actor="x", lease_id="l2", address=a, action=act, state=st)
                for a, act, st in [
                    ("t.a", "create", "applying"),
                    ("t.a", "create", "failed"),
                    ("t.rep", "replace", "not_applied"),
                    ("t.c", "update", "not_applied"),
                ]
            ),
            FinishApply(actor="x", lease_id="l2", summary=PlanSummary()),
        ]
    )
    s = Stream()
    s.add(SUBJECT, *events)
    assert _states(s) == {
        "t.a": [("create", "failed")],
        "t.rep": [("replace", "not_applied")],
        "t.c": [("update", "not_applied")],
    }


@pytest.mark.parametrize(
    ("planned", "states", "now"),
    [
        ("replace", ["pending"], "pending"),
        ("replace", ["done"], "applying"),
        ("replace", ["done", "done"], "done"),
        ("replace", ["done", "not_applied"], "not_applied"),
        ("replace", ["failed", "not_applied"], "failed"),
        ("update", ["done"], "done"),
        (None, ["applying"], "applying"),
    ],
)
def test_a_resources_state_follows_its_stages(
    planned: str | None, states: list[str], now: str
) -> None:
    assert current_state(planned, states) == now
