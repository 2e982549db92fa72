"""Stopping a planning run and marking limits, given / when / then. Synchronous, no I/O."""

from __future__ import annotations

import pytest

from events.errors import IllegalTransition, StaleLease
from events.run import (
    CancelRun,
    ExceedLimit,
    RunCanceled,
    RunLimitExceeded,
    RunStopRequested,
    Status,
)
from tests.core_support import APPLY_LEASE, OTHER_LEASE, PLAN_LEASE, RUN, TERMINAL, history
from tests.gwt import NOW, given

STOP = RunStopRequested(at=NOW, actor="alice", reason="wrong branch")


def test_cancel_of_a_planning_run_records_a_stop_request_and_keeps_planning() -> None:
    state = (
        given(RUN, *history(Status.PLANNING))
        .when(CancelRun(actor="alice", reason="wrong branch"))
        .then(STOP)
    )
    assert (state.status, state.stop_requested_by, state.lease_id) == (
        Status.PLANNING,
        "alice",
        PLAN_LEASE,
    )


def test_a_second_stop_request_records_nothing() -> None:
    given(RUN, *history(Status.PLANNING), STOP).when(CancelRun(actor="bob")).then()


def test_the_executor_cancels_a_stopped_phase_under_its_lease_with_the_requested_reason() -> None:
    state = (
        given(RUN, *history(Status.PLANNING), STOP)
        .when(CancelRun(actor="executor:a", lease_id=PLAN_LEASE))
        .then(RunCanceled(at=NOW, actor="executor:a", reason="wrong branch"))
    )
    assert (state.status, state.lease_id) == (Status.CANCELED, "")


def test_an_executor_cancel_without_a_stop_request_is_refused() -> None:
    given(RUN, *history(Status.PLANNING)).when(
        CancelRun(actor="executor:a", lease_id=PLAN_LEASE)
    ).then_error(IllegalTransition)


def test_an_executor_cancel_under_another_lease_is_refused_as_stale() -> None:
    given(RUN, *history(Status.PLANNING), STOP).when(
        CancelRun(actor="executor:a", lease_id=OTHER_LEASE)
    ).then_error(StaleLease)


def test_a_limit_during_an_apply_is_recorded_once_and_the_apply_goes_on() -> None:
    mark = ExceedLimit(actor="reaper", limit="run_timeout", message="open for 5s")
    event = RunLimitExceeded(at=NOW, actor="reaper", limit="run_timeout", message="open for 5s")
    state = given(RUN, *history(Status.APPLYING)).when(mark).then(event)
    assert (state.status, state.lease_id, state.limit_exceeded) == (
        Status.APPLYING,
        APPLY_LEASE,
        "run_timeout",
    )
    given(RUN, *history(Status.APPLYING), event).when(mark).then()


@pytest.mark.parametrize("status", [Status.QUEUED, Status.AWAITING_APPROVAL, *TERMINAL])
def test_a_limit_is_only_marked_on_an_applying_run(status: Status) -> None:
    given(RUN, *history(status)).when(ExceedLimit(actor="reaper", limit="run_timeout")).then_error(
        IllegalTransition
    )
