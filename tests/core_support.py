"""The run aggregate's past events for the pure core's tests: the events of one run
(`run-1` of acme/network) in order, its leases, and a history leading to each status
(`HISTORIES`, `history`). Holds no tests itself."""

from __future__ import annotations

from datetime import datetime, timedelta

import msgspec

from events import run
from events.run import (
    ApplyFinished,
    PhaseStarted,
    PlanFinished,
    PlanSummary,
    RunApproved,
    RunCanceled,
    RunCreated,
    RunDiscarded,
    RunEvent,
    RunFailed,
    RunQueued,
    Status,
)
from tests.gwt import NOW, Aggregate

RUN = Aggregate(initial=run.INITIAL, decide=run.decide, evolve=run.evolve)


def at(minutes: int) -> datetime:
    return NOW - timedelta(hours=1) + timedelta(minutes=minutes)


CONFIG = run.Workspace(
    repository="https://git.example.com/acme/infra.git", variables={"region": "eu-west-1"}
)
SUMMARY = PlanSummary(add=2, change=1, destroy=0)
PLAN_LEASE = "lease-plan-1"
APPLY_LEASE = "lease-apply-1"
OTHER_LEASE = "lease-someone-else"


def created(run_type: str = "apply") -> RunCreated:
    return RunCreated(
        at=at(0),
        actor="alice",
        run_id="run-1",
        org="acme",
        workspace="network",
        run_type=run_type,
        config=CONFIG,
        message="bump vpc",
    )


QUEUED = RunQueued(at=at(1), actor="scheduler")
PLAN_STARTED = PhaseStarted(
    at=at(2), actor="exec-a", phase="plan", lease_id=PLAN_LEASE, executor_id="exec-a"
)


def plan_finished(*, has_changes: bool = True, require_approval: bool = True) -> PlanFinished:
    return PlanFinished(
        at=at(3),
        actor="exec-a",
        lease_id=PLAN_LEASE,
        commit="c0ffee",
        has_changes=has_changes,
        summary=SUMMARY,
        plan_object="plans/run-1",
        plan_digest="sha256:abc",
        require_approval=require_approval,
    )


def plan_finished_now(
    status: Status, step_at: int, *, has_changes: bool = True, require_approval: bool = True
) -> PlanFinished:
    """The PlanFinished that `finish_plan(...)` decides at NOW: with where it leads."""
    return msgspec.structs.replace(
        plan_finished(has_changes=has_changes, require_approval=require_approval),
        at=NOW,
        status=status,
        step_at=step_at,
    )


APPROVED = RunApproved(at=at(4), actor="bob", acknowledged=["aws_instance.web"])
APPLY_STARTED = PhaseStarted(
    at=at(5), actor="exec-b", phase="apply", lease_id=APPLY_LEASE, executor_id="exec-b"
)
APPLY_FINISHED = ApplyFinished(at=at(6), actor="exec-b", lease_id=APPLY_LEASE, summary=SUMMARY)

_TO_AWAITING: list[RunEvent] = [QUEUED, PLAN_STARTED, plan_finished()]
HISTORIES: dict[Status, list[RunEvent]] = {
    Status.PENDING: [created()],
    Status.QUEUED: [created(), QUEUED],
    Status.PLANNING: [created(), QUEUED, PLAN_STARTED],
    Status.AWAITING_APPROVAL: [created(), *_TO_AWAITING],
    Status.APPLY_QUEUED: [created(), *_TO_AWAITING, APPROVED],
    Status.APPLYING: [created(), *_TO_AWAITING, APPROVED, APPLY_STARTED],
    Status.APPLIED: [created(), *_TO_AWAITING, APPROVED, APPLY_STARTED, APPLY_FINISHED],
    Status.PLANNED: [created("plan"), QUEUED, PLAN_STARTED, plan_finished()],
    Status.NO_CHANGES: [created(), QUEUED, PLAN_STARTED, plan_finished(has_changes=False)],
    Status.DRIFTED: [created("drift"), QUEUED, PLAN_STARTED, plan_finished()],
    Status.DISCARDED: [created(), *_TO_AWAITING, RunDiscarded(at=at(4), actor="bob")],
    Status.FAILED: [
        created(),
        QUEUED,
        PLAN_STARTED,
        RunFailed(at=at(3), actor="reaper", reason="executor_unavailable"),
    ],
    Status.CANCELED: [created(), RunCanceled(at=at(1), actor="alice", reason="canceled")],
}

# `running` (a custom step) exists in the vocabulary but no command leads there yet.
REACHABLE = [s for s in Status if s != Status.RUNNING]
TERMINAL = [s for s in REACHABLE if s in run.TERMINAL]
NON_TERMINAL = [s for s in REACHABLE if s not in run.TERMINAL]
LEASE_OF = {Status.PLANNING: PLAN_LEASE, Status.APPLYING: APPLY_LEASE}


def history(status: Status) -> list[RunEvent]:
    return list(HISTORIES[status])
