"""A draining executor gives a claimed phase back (`ReleasePhase`), given / when / then.

A plan goes back whenever; an apply only before its `apply` step began (exactly once); the
old lease is fenced off after it; the attempt is counted. Synchronous, no I/O."""

from __future__ import annotations

import pytest

from events.errors import DomainError, IllegalTransition, StaleLease
from events.run import (
    ClaimPhase,
    FinishStep,
    PhaseReleased,
    PhaseStarted,
    ReleasePhase,
    StartStep,
    Status,
    StepStarted,
)
from tests.core_support import APPLY_LEASE, OTHER_LEASE, PLAN_LEASE, RUN, history
from tests.gwt import NOW, given


def _released(phase: str, lease: str, executor: str, status: Status, attempt: int = 1) -> object:
    return PhaseReleased(
        at=NOW,
        actor="executor:a",
        phase=phase,
        lease_id=lease,
        executor_id=executor,
        reason="executor_draining",
        attempt=attempt,
        status=status,
        step_at=0 if phase == "plan" else 3,
    )


def _plan_step(step: str) -> StepStarted:
    return StepStarted(at=NOW, actor="exec-a", lease_id=PLAN_LEASE, step=step)


def test_a_planning_run_given_back_waits_again_under_no_lease() -> None:
    state = (
        given(RUN, *history(Status.PLANNING), _plan_step("checkout"), _plan_step("plan"))
        .when(ReleasePhase(actor="executor:a", lease_id=PLAN_LEASE))
        .then(_released("plan", PLAN_LEASE, "exec-a", Status.QUEUED))
    )
    assert (state.status, state.lease_id, state.waiting_phase) == (Status.QUEUED, "", "plan")
    assert state.released == 1


def test_after_a_release_the_old_lease_is_stale_and_a_new_claim_is_taken() -> None:
    released = _released("plan", PLAN_LEASE, "exec-a", Status.QUEUED)
    late = StartStep(actor="exec-a", lease_id=PLAN_LEASE, step="plan")
    given(RUN, *history(Status.PLANNING), released).when(late).then_error(StaleLease)
    given(RUN, *history(Status.PLANNING), released).when(
        FinishStep(actor="exec-a", lease_id=PLAN_LEASE, step="plan", ok=True, started_at=NOW)
    ).then_error(StaleLease)
    claim = ClaimPhase(actor="exec-b", phase="plan", lease_id="lease-2", executor_id="exec-b")
    state = (
        given(RUN, *history(Status.PLANNING), released)
        .when(claim)
        .then(
            PhaseStarted(
                at=NOW,
                actor="exec-b",
                phase="plan",
                lease_id="lease-2",
                executor_id="exec-b",
                status=Status.PLANNING,
            )
        )
    )
    assert (state.lease_id, state.phase_step, state.released) == ("lease-2", "", 1)


def test_the_second_release_is_the_second_attempt() -> None:
    first = _released("plan", PLAN_LEASE, "exec-a", Status.QUEUED)
    again = PhaseStarted(
        at=NOW, actor="exec-b", phase="plan", lease_id="lease-2", executor_id="exec-b"
    )
    given(RUN, *history(Status.PLANNING), first, again).when(
        ReleasePhase(actor="executor:b", lease_id="lease-2")
    ).then(
        PhaseReleased(
            at=NOW,
            actor="executor:b",
            phase="plan",
            lease_id="lease-2",
            executor_id="exec-b",
            attempt=2,
            status=Status.QUEUED,
            step_at=0,
        )
    )


@pytest.mark.parametrize("step", ["", "checkout", "init"])
def test_an_apply_is_given_back_before_its_apply_step(step: str) -> None:
    began = [StepStarted(at=NOW, actor="exec-b", lease_id=APPLY_LEASE, step=step)] if step else []
    state = (
        given(RUN, *history(Status.APPLYING), *began)
        .when(ReleasePhase(actor="executor:a", lease_id=APPLY_LEASE))
        .then(_released("apply", APPLY_LEASE, "exec-b", Status.APPLY_QUEUED))
    )
    assert (state.status, state.waiting_phase, state.lease_id) == (
        Status.APPLY_QUEUED,
        "apply",
        "",
    )


def test_an_apply_whose_apply_step_began_is_never_given_back() -> None:
    began = StepStarted(at=NOW, actor="exec-b", lease_id=APPLY_LEASE, step="apply")
    given(RUN, *history(Status.APPLYING), began).when(
        ReleasePhase(actor="executor:a", lease_id=APPLY_LEASE)
    ).then_error(IllegalTransition)


def test_a_release_under_another_lease_is_stale() -> None:
    given(RUN, *history(Status.PLANNING)).when(
        ReleasePhase(actor="executor:a", lease_id=OTHER_LEASE)
    ).then_error(StaleLease)


@pytest.mark.parametrize("status", [Status.QUEUED, Status.AWAITING_APPROVAL, Status.APPLIED])
def test_nothing_to_give_back_outside_a_running_phase(status: Status) -> None:
    lease = APPLY_LEASE if status == Status.APPLIED else PLAN_LEASE
    given(RUN, *history(status)).when(ReleasePhase(actor="x", lease_id=lease)).then_error(
        DomainError
    )
