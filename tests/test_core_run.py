"""The run aggregate, given / when / then: lifecycle per run type, discard, cancel, fail,
fencing of executor reports, claims, creation. Synchronous, no I/O."""

from __future__ import annotations

from typing import Any

import pytest

from events import run
from events.errors import AlreadyExists, IllegalTransition, Invalid, NotFound, StaleLease
from events.run import (
    AdmitRun,
    ApplyFinished,
    ApproveRun,
    CancelRun,
    ClaimPhase,
    CreateRun,
    DiscardRun,
    FailRun,
    FinishApply,
    FinishPlan,
    FinishStep,
    PhaseStarted,
    RunApproved,
    RunCanceled,
    RunCreated,
    RunDiscarded,
    RunFailed,
    RunQueued,
    StartStep,
    Status,
    StepFinished,
    StepStarted,
)
from tests.core_support import (
    APPLY_LEASE,
    CONFIG,
    LEASE_OF,
    NON_TERMINAL,
    OTHER_LEASE,
    PLAN_LEASE,
    PLAN_STARTED,
    QUEUED,
    REACHABLE,
    RUN,
    SUMMARY,
    TERMINAL,
    at,
    created,
    history,
    plan_finished_now,
)
from tests.gwt import NOW, Given, Ids, given


def in_status(status: Status) -> Given[run.RunState]:
    return given(RUN, *history(status))


# ---------------------------------------------------------------- commands


ADMIT = AdmitRun(actor="scheduler")
APPROVE = ApproveRun(actor="bob", acknowledged=["aws_instance.web"])


def create(run_type: str = "apply") -> CreateRun:
    return CreateRun(
        actor="alice",
        run_id="run-1",
        org="acme",
        workspace="network",
        run_type=run_type,
        config=CONFIG,
        message="bump vpc",
    )


def claim(phase: str, lease: str, executor: str = "exec-a") -> ClaimPhase:
    return ClaimPhase(actor=executor, phase=phase, lease_id=lease, executor_id=executor)


def finish_plan(
    lease: str = PLAN_LEASE, *, has_changes: bool = True, require_approval: bool = True
) -> FinishPlan:
    return FinishPlan(
        actor="exec-a",
        lease_id=lease,
        commit="c0ffee",
        has_changes=has_changes,
        summary=SUMMARY,
        plan_object="plans/run-1",
        plan_digest="sha256:abc",
        require_approval=require_approval,
    )


def finish_apply(lease: str = APPLY_LEASE) -> FinishApply:
    return FinishApply(actor="exec-b", lease_id=lease, summary=SUMMARY)


def executor_reports(lease: str) -> dict[str, Any]:
    """Every command an executor sends under its lease."""
    return {
        "start_step": StartStep(actor="exec", lease_id=lease, step="init"),
        "finish_step": FinishStep(
            actor="exec", lease_id=lease, step="init", ok=True, started_at=at(2)
        ),
        "finish_plan": finish_plan(lease),
        "finish_apply": finish_apply(lease),
        "fail": FailRun(actor="exec", lease_id=lease, reason="step_failed"),
    }


REPORT_KINDS = list(executor_reports("x"))


def drive(commands: list[Any]) -> list[Status | None]:
    """Decide and evolve each command in turn; return the statuses passed through."""
    state = run.INITIAL
    statuses = []
    for i, command in enumerate(commands):
        for event in run.decide(state, command, now=at(10 + i), new_id=Ids()):
            state = run.evolve(state, event)
        statuses.append(state.status)
    return statuses


# ---------------------------------------------------------------- the fixtures themselves


@pytest.mark.parametrize("status", REACHABLE)
def test_each_history_fixture_folds_to_the_status_it_is_named_after(status: Status) -> None:
    assert RUN.fold(history(status)).status == status


# ---------------------------------------------------------------- creation


def test_create_records_a_pending_run_with_its_workspace_snapshot() -> None:
    state = (
        given(RUN)
        .when(create("apply"))
        .then(
            RunCreated(
                at=NOW,
                actor="alice",
                run_id="run-1",
                org="acme",
                workspace="network",
                run_type="apply",
                config=CONFIG,
                message="bump vpc",
            )
        )
    )
    assert state.status == Status.PENDING
    assert (state.run_id, state.org, state.workspace) == ("run-1", "acme", "network")
    assert state.config == CONFIG
    assert state.created_by == "alice"
    assert state.created_at == NOW
    assert state.version == 1


@pytest.mark.parametrize("status", [Status.PENDING, Status.APPLYING, Status.APPLIED])
def test_creating_a_run_that_exists_is_refused_as_already_exists(status: Status) -> None:
    in_status(status).when(create()).then_error(AlreadyExists)


@pytest.mark.parametrize("run_type", ["", "import", "APPLY", "refresh"])
def test_creating_a_run_of_an_unknown_type_is_refused_as_invalid(run_type: str) -> None:
    given(RUN).when(create(run_type)).then_error(Invalid)


@pytest.mark.parametrize(
    "command",
    [
        ADMIT,
        claim("plan", PLAN_LEASE),
        *executor_reports(PLAN_LEASE).values(),
        APPROVE,
        DiscardRun(actor="bob"),
        CancelRun(actor="alice"),
        FailRun(actor="reaper", reason="timed_out"),
    ],
    ids=lambda c: type(c).__name__,
)
def test_every_command_but_create_on_a_missing_run_is_refused_as_not_found(command: Any) -> None:
    given(RUN).when(command).then_error(NotFound)


# ---------------------------------------------------------------- the happy paths, step by step


def test_admit_moves_a_pending_run_to_queued_waiting_for_its_plan_phase() -> None:
    state = (
        in_status(Status.PENDING)
        .when(ADMIT)
        .then(RunQueued(at=NOW, actor="scheduler", phase="plan", status=Status.QUEUED, step_at=0))
    )
    assert state.status == Status.QUEUED


def test_claiming_the_plan_phase_starts_planning_under_the_claimed_lease() -> None:
    state = (
        in_status(Status.QUEUED)
        .when(claim("plan", PLAN_LEASE))
        .then(
            PhaseStarted(
                at=NOW,
                actor="exec-a",
                phase="plan",
                lease_id=PLAN_LEASE,
                executor_id="exec-a",
                status=Status.PLANNING,
            )
        )
    )
    assert (state.status, state.phase, state.lease_id, state.executor_id) == (
        Status.PLANNING,
        "plan",
        PLAN_LEASE,
        "exec-a",
    )


@pytest.mark.parametrize("status", [Status.PLANNING, Status.APPLYING])
def test_step_reports_under_the_current_lease_are_recorded_and_keep_the_status(
    status: Status,
) -> None:
    lease = LEASE_OF[status]
    state = (
        in_status(status)
        .when(StartStep(actor="exec", lease_id=lease, step="init"))
        .then(StepStarted(at=NOW, actor="exec", lease_id=lease, step="init"))
    )
    assert state.status == status
    finish = FinishStep(
        actor="exec", lease_id=lease, step="init", ok=False, started_at=at(2), error="boom"
    )
    state = (
        in_status(status)
        .when(finish)
        .then(
            StepFinished(
                at=NOW,
                actor="exec",
                lease_id=lease,
                step="init",
                ok=False,
                started_at=at(2),
                error="boom",
            )
        )
    )
    assert state.status == status


def test_a_plan_run_with_changes_ends_planned_and_keeps_the_plan() -> None:
    g = given(RUN, created("plan"), QUEUED, PLAN_STARTED)
    state = g.when(finish_plan()).then(plan_finished_now(Status.PLANNED, 2))
    assert state.status == Status.PLANNED
    assert (state.commit, state.plan_summary, state.plan_digest) == (
        "c0ffee",
        SUMMARY,
        "sha256:abc",
    )
    assert state.lease_id == ""


@pytest.mark.parametrize("run_type", run.RUN_TYPES)
@pytest.mark.parametrize("require_approval", [True, False])
def test_a_plan_without_changes_ends_no_changes_for_every_run_type(
    run_type: str, require_approval: bool
) -> None:
    g = given(RUN, created(run_type), QUEUED, PLAN_STARTED)
    steps = len(run.fold(g.history).steps)  # past the last step: the run ended
    state = g.when(finish_plan(has_changes=False, require_approval=require_approval)).then(
        plan_finished_now(
            Status.NO_CHANGES, steps, has_changes=False, require_approval=require_approval
        )
    )
    assert state.status == Status.NO_CHANGES


def test_a_drift_run_that_finds_changes_ends_drifted() -> None:
    g = given(RUN, created("drift"), QUEUED, PLAN_STARTED)
    state = g.when(finish_plan()).then(plan_finished_now(Status.DRIFTED, 2))
    assert state.status == Status.DRIFTED


@pytest.mark.parametrize("run_type", ["apply", "destroy"])
def test_an_apply_or_destroy_plan_with_changes_awaits_approval_when_required(
    run_type: str,
) -> None:
    g = given(RUN, created(run_type), QUEUED, PLAN_STARTED)
    awaiting = plan_finished_now(Status.AWAITING_APPROVAL, 2)
    state = g.when(finish_plan(require_approval=True)).then(awaiting)
    assert state.status == Status.AWAITING_APPROVAL
    assert state.lease_id == ""


@pytest.mark.parametrize("run_type", ["apply", "destroy"])
def test_an_apply_or_destroy_plan_without_required_approval_goes_straight_to_apply_queued(
    run_type: str,
) -> None:
    g = given(RUN, created(run_type), QUEUED, PLAN_STARTED)
    state = g.when(finish_plan(require_approval=False)).then(
        plan_finished_now(Status.APPLY_QUEUED, 3, require_approval=False)
    )
    assert state.status == Status.APPLY_QUEUED
    assert state.approved_by == ""


def test_approve_moves_an_awaiting_run_to_apply_queued_and_records_the_approver() -> None:
    state = (
        in_status(Status.AWAITING_APPROVAL)
        .when(APPROVE)
        .then(
            RunApproved(
                at=NOW,
                actor="bob",
                acknowledged=["aws_instance.web"],
                status=Status.APPLY_QUEUED,
                step_at=3,
            )
        )
    )
    assert state.status == Status.APPLY_QUEUED
    assert (state.approved_by, state.acknowledged) == ("bob", ["aws_instance.web"])


def test_claiming_the_apply_phase_starts_applying_under_a_fresh_lease() -> None:
    state = (
        in_status(Status.APPLY_QUEUED)
        .when(claim("apply", APPLY_LEASE, "exec-b"))
        .then(
            PhaseStarted(
                at=NOW,
                actor="exec-b",
                phase="apply",
                lease_id=APPLY_LEASE,
                executor_id="exec-b",
                status=Status.APPLYING,
            )
        )
    )
    assert (state.status, state.lease_id) == (Status.APPLYING, APPLY_LEASE)


def test_finishing_the_apply_ends_applied_with_its_summary_and_releases_the_lease() -> None:
    state = (
        in_status(Status.APPLYING)
        .when(finish_apply())
        .then(
            ApplyFinished(
                at=NOW,
                actor="exec-b",
                lease_id=APPLY_LEASE,
                summary=SUMMARY,
                status=Status.APPLIED,
                step_at=4,
            )
        )
    )
    assert (state.status, state.apply_summary, state.lease_id) == (Status.APPLIED, SUMMARY, "")


@pytest.mark.parametrize("run_type", ["apply", "destroy"])
def test_an_approved_apply_or_destroy_walks_every_status_in_order(run_type: str) -> None:
    statuses = drive(
        [
            create(run_type),
            ADMIT,
            claim("plan", PLAN_LEASE),
            StartStep(actor="exec-a", lease_id=PLAN_LEASE, step="plan"),
            finish_plan(require_approval=True),
            APPROVE,
            claim("apply", APPLY_LEASE),
            finish_apply(),
        ],
    )
    assert statuses == [
        Status.PENDING,
        Status.QUEUED,
        Status.PLANNING,
        Status.PLANNING,
        Status.AWAITING_APPROVAL,
        Status.APPLY_QUEUED,
        Status.APPLYING,
        Status.APPLIED,
    ]


@pytest.mark.parametrize("run_type", ["apply", "destroy"])
def test_an_auto_approved_apply_or_destroy_skips_awaiting_approval(run_type: str) -> None:
    statuses = drive(
        [
            create(run_type),
            ADMIT,
            claim("plan", PLAN_LEASE),
            finish_plan(require_approval=False),
            claim("apply", APPLY_LEASE),
            finish_apply(),
        ],
    )
    assert statuses == [
        Status.PENDING,
        Status.QUEUED,
        Status.PLANNING,
        Status.APPLY_QUEUED,
        Status.APPLYING,
        Status.APPLIED,
    ]


@pytest.mark.parametrize(
    ("run_type", "has_changes", "end"),
    [
        ("plan", True, Status.PLANNED),
        ("plan", False, Status.NO_CHANGES),
        ("drift", True, Status.DRIFTED),
        ("drift", False, Status.NO_CHANGES),
    ],
)
def test_plan_only_run_types_walk_pending_queued_planning_then_end(
    run_type: str, has_changes: bool, end: Status
) -> None:
    statuses = drive(
        [create(run_type), ADMIT, claim("plan", PLAN_LEASE), finish_plan(has_changes=has_changes)],
    )
    assert statuses == [Status.PENDING, Status.QUEUED, Status.PLANNING, end]


def test_evolve_counts_versions_and_tracks_the_last_update() -> None:
    state = RUN.fold(history(Status.APPLIED))
    assert state.version == len(history(Status.APPLIED))
    assert state.created_at == at(0)
    assert state.updated_at == at(6)


# ---------------------------------------------------------------- admission, approval


@pytest.mark.parametrize("status", [s for s in REACHABLE if s != Status.PENDING])
def test_admit_is_refused_unless_pending(status: Status) -> None:
    err = in_status(status).when(ADMIT).then_error(IllegalTransition)
    assert err.status == status


@pytest.mark.parametrize("status", [s for s in REACHABLE if s != Status.AWAITING_APPROVAL])
def test_approve_is_refused_unless_awaiting_approval(status: Status) -> None:
    err = in_status(status).when(APPROVE).then_error(IllegalTransition)
    assert err.status == status


# ---------------------------------------------------------------- discard


def test_discard_of_an_awaiting_run_ends_discarded_with_its_reason() -> None:
    state = (
        in_status(Status.AWAITING_APPROVAL)
        .when(DiscardRun(actor="bob", reason="wrong region"))
        .then(RunDiscarded(at=NOW, actor="bob", reason="wrong region"))
    )
    assert (state.status, state.reason) == (Status.DISCARDED, "wrong region")


def test_discard_without_a_reason_records_discarded_as_the_reason() -> None:
    in_status(Status.AWAITING_APPROVAL).when(DiscardRun(actor="bob")).then(
        RunDiscarded(at=NOW, actor="bob", reason="discarded")
    )


@pytest.mark.parametrize("status", [s for s in REACHABLE if s != Status.AWAITING_APPROVAL])
def test_discard_is_refused_unless_awaiting_approval(status: Status) -> None:
    err = in_status(status).when(DiscardRun(actor="bob")).then_error(IllegalTransition)
    assert err.status == status


# ---------------------------------------------------------------- cancel


@pytest.mark.parametrize("status", [Status.PENDING, Status.QUEUED, Status.APPLY_QUEUED])
def test_cancel_of_a_waiting_run_ends_canceled(status: Status) -> None:
    state = (
        in_status(status)
        .when(CancelRun(actor="alice", reason="not today"))
        .then(RunCanceled(at=NOW, actor="alice", reason="not today"))
    )
    assert (state.status, state.reason) == (Status.CANCELED, "not today")


def test_cancel_without_a_reason_records_canceled_as_the_reason() -> None:
    in_status(Status.PENDING).when(CancelRun(actor="alice")).then(
        RunCanceled(at=NOW, actor="alice", reason="canceled")
    )


def test_cancel_of_a_run_awaiting_approval_is_refused_carrying_its_status() -> None:
    err = (
        in_status(Status.AWAITING_APPROVAL)
        .when(CancelRun(actor="alice"))
        .then_error(IllegalTransition)
    )
    assert err.status == "awaiting_approval"


def test_cancel_of_an_applying_run_is_refused_carrying_its_status() -> None:
    err = in_status(Status.APPLYING).when(CancelRun(actor="alice")).then_error(IllegalTransition)
    assert err.status == "applying"


@pytest.mark.parametrize("status", TERMINAL)
def test_cancel_is_refused_once_terminal(status: Status) -> None:
    err = in_status(status).when(CancelRun(actor="alice")).then_error(IllegalTransition)
    assert err.status == status


# ---------------------------------------------------------------- failure


@pytest.mark.parametrize("status", NON_TERMINAL)
def test_fail_without_a_lease_ends_failed_from_every_non_terminal_status_with_its_reason(
    status: Status,
) -> None:
    command = FailRun(actor="reaper", reason="timed_out", message="run limit 2h")
    state = (
        in_status(status)
        .when(command)
        .then(RunFailed(at=NOW, actor="reaper", reason="timed_out", message="run limit 2h"))
    )
    assert (state.status, state.reason, state.error_message) == (
        Status.FAILED,
        "timed_out",
        "run limit 2h",
    )
    assert state.message == "bump vpc", "the run's own message survives its failure"
    assert state.lease_id == ""


@pytest.mark.parametrize("status", [Status.PLANNING, Status.APPLYING])
def test_fail_under_the_current_lease_ends_failed_and_records_the_lease(status: Status) -> None:
    lease = LEASE_OF[status]
    state = (
        in_status(status)
        .when(FailRun(actor="exec", reason="step_failed", lease_id=lease))
        .then(RunFailed(at=NOW, actor="exec", reason="step_failed", lease_id=lease))
    )
    assert (state.status, state.reason, state.lease_id) == (Status.FAILED, "step_failed", "")


@pytest.mark.parametrize("status", TERMINAL)
def test_fail_without_a_lease_is_refused_once_terminal(status: Status) -> None:
    err = (
        in_status(status)
        .when(FailRun(actor="reaper", reason="timed_out"))
        .then_error(IllegalTransition)
    )
    assert err.status == status


def test_a_failure_without_a_reason_is_refused_or_still_records_one() -> None:
    outcome = in_status(Status.QUEUED).when(FailRun(actor="reaper", reason=""))
    if outcome.error is not None:
        assert isinstance(outcome.error, Invalid)
    else:
        assert RUN.fold(outcome.events or [], outcome.before).reason != ""


# ---------------------------------------------------------------- fencing

STALE_CASES = [
    # (status, lease presented, why it is stale)
    (Status.PLANNING, OTHER_LEASE),
    (Status.PLANNING, ""),
    (Status.APPLYING, OTHER_LEASE),
    (Status.APPLYING, PLAN_LEASE),  # the plan phase's lease, after the apply phase began
    (Status.AWAITING_APPROVAL, PLAN_LEASE),  # no phase runs: the plan lease ended
    (Status.APPLY_QUEUED, PLAN_LEASE),
    (Status.QUEUED, OTHER_LEASE),
    (Status.FAILED, PLAN_LEASE),  # reaped while planning: the executor is a zombie
    (Status.APPLIED, APPLY_LEASE),
    (Status.CANCELED, OTHER_LEASE),
]


@pytest.mark.parametrize(
    ("kind", "status", "lease"),
    [
        (kind, status, lease)
        for status, lease in STALE_CASES
        for kind in REPORT_KINDS
        # a FailRun without a lease is the reaper's or an operator's, not fenced
        if not (kind == "fail" and lease == "")
    ],
)
def test_an_executor_report_under_a_stale_or_wrong_lease_is_refused_as_stale_lease(
    kind: str, status: Status, lease: str
) -> None:
    in_status(status).when(executor_reports(lease)[kind]).then_error(StaleLease)


@pytest.mark.parametrize("kind", REPORT_KINDS)
def test_after_the_reaper_failed_a_run_a_late_report_from_its_old_lease_is_refused(
    kind: str,
) -> None:
    g = given(
        RUN,
        created(),
        QUEUED,
        PLAN_STARTED,
        StepStarted(at=at(3), actor="exec-a", lease_id=PLAN_LEASE, step="plan"),
        RunFailed(at=at(9), actor="reaper", reason="executor_unavailable"),
    )
    g.when(executor_reports(PLAN_LEASE)[kind]).then_error(StaleLease)


def test_after_an_executor_failed_its_run_a_second_failure_from_the_same_lease_is_refused() -> None:
    g = given(
        RUN,
        *history(Status.APPLYING),
        RunFailed(at=at(7), actor="exec-b", reason="step_failed", lease_id=APPLY_LEASE),
    )
    g.when(FailRun(actor="exec-b", reason="step_failed", lease_id=APPLY_LEASE)).then_error(
        StaleLease
    )


def test_finishing_an_apply_while_planning_is_refused_even_under_the_current_lease() -> None:
    err = in_status(Status.PLANNING).when(finish_apply(PLAN_LEASE)).then_error(IllegalTransition)
    assert err.status == "planning"


def test_finishing_a_plan_while_applying_is_refused_even_under_the_current_lease() -> None:
    err = in_status(Status.APPLYING).when(finish_plan(APPLY_LEASE)).then_error(IllegalTransition)
    assert err.status == "applying"


# ---------------------------------------------------------------- claims


def test_claiming_the_apply_phase_of_a_run_queued_for_its_plan_is_refused() -> None:
    err = in_status(Status.QUEUED).when(claim("apply", APPLY_LEASE)).then_error(IllegalTransition)
    assert err.status == "queued"


def test_claiming_the_plan_phase_of_a_run_queued_for_its_apply_is_refused() -> None:
    err = (
        in_status(Status.APPLY_QUEUED).when(claim("plan", PLAN_LEASE)).then_error(IllegalTransition)
    )
    assert err.status == "apply_queued"


def test_claiming_an_unknown_phase_is_refused() -> None:
    in_status(Status.QUEUED).when(claim("custom", PLAN_LEASE)).then_error(IllegalTransition)


@pytest.mark.parametrize(
    "status", [s for s in REACHABLE if s not in (Status.QUEUED, Status.APPLY_QUEUED)]
)
@pytest.mark.parametrize("phase", ["plan", "apply"])
def test_a_phase_can_be_claimed_only_while_it_waits_so_it_runs_at_most_once(
    status: Status, phase: str
) -> None:
    err = in_status(status).when(claim(phase, "lease-second")).then_error(IllegalTransition)
    assert err.status == status


def test_claiming_a_phase_with_an_empty_lease_is_refused_as_invalid() -> None:
    in_status(Status.QUEUED).when(claim("plan", "")).then_error(Invalid)
