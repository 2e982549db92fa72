"""The workspace aggregate, given / when / then: its FIFO run queue and its one active slot."""

from __future__ import annotations

from datetime import timedelta

import pytest

from events import workspace as ws
from events.errors import AlreadyExists, Invalid, NotFound
from events.run import Workspace
from events.workspace import (
    AdmitNext,
    CreateWorkspace,
    EnqueueRun,
    ReleaseRun,
    RunAdmitted,
    RunEnqueued,
    RunReleased,
    WorkspaceCreated,
)
from tests.gwt import NOW, Aggregate, given

WS = Aggregate(initial=ws.INITIAL, decide=ws.decide, evolve=ws.evolve)
CONFIG = Workspace(repository="https://git.example.com/acme/infra.git", directory="network")
EARLIER = NOW - timedelta(hours=1)

CREATED = WorkspaceCreated(at=EARLIER, actor="alice", org="acme", name="network", config=CONFIG)
ADMIT = AdmitNext(actor="scheduler")


def enqueued(run_id: str) -> RunEnqueued:
    return RunEnqueued(at=EARLIER, actor="alice", run_id=run_id)


def admitted(run_id: str) -> RunAdmitted:
    return RunAdmitted(at=EARLIER, actor="scheduler", run_id=run_id)


def released(run_id: str, status: str = "applied") -> RunReleased:
    return RunReleased(at=EARLIER, actor="scheduler", run_id=run_id, status=status)


def test_create_records_the_workspace_with_an_empty_queue_and_no_active_run() -> None:
    state = (
        given(WS)
        .when(CreateWorkspace(actor="alice", org="acme", name="network", config=CONFIG))
        .then(WorkspaceCreated(at=NOW, actor="alice", org="acme", name="network", config=CONFIG))
    )
    assert (state.org, state.name, state.config, state.created_at) == (
        "acme",
        "network",
        CONFIG,
        NOW,
    )
    assert (state.queue, state.active) == ((), "")


def test_creating_a_workspace_that_exists_is_refused_as_already_exists() -> None:
    given(WS, CREATED).when(
        CreateWorkspace(actor="bob", org="acme", name="network", config=CONFIG)
    ).then_error(AlreadyExists)


def test_enqueueing_into_a_missing_workspace_is_refused_as_not_found() -> None:
    given(WS).when(EnqueueRun(actor="alice", run_id="run-1")).then_error(NotFound)


def test_enqueued_runs_wait_in_arrival_order() -> None:
    state = (
        given(WS, CREATED, enqueued("run-1"), enqueued("run-2"))
        .when(EnqueueRun(actor="alice", run_id="run-3"))
        .then(RunEnqueued(at=NOW, actor="alice", run_id="run-3"))
    )
    assert state.queue == ("run-1", "run-2", "run-3")
    assert state.active == ""


@pytest.mark.parametrize(
    "history",
    [
        [CREATED, enqueued("run-1")],
        [CREATED, enqueued("run-1"), admitted("run-1")],
    ],
    ids=["queued", "active"],
)
def test_enqueueing_a_run_that_is_queued_or_active_is_refused_as_invalid(
    history: list[ws.WorkspaceEvent],
) -> None:
    given(WS, *history).when(EnqueueRun(actor="alice", run_id="run-1")).then_error(Invalid)


def test_admit_next_admits_the_oldest_run_when_nothing_is_active() -> None:
    state = (
        given(WS, CREATED, enqueued("run-1"), enqueued("run-2"))
        .when(ADMIT)
        .then(RunAdmitted(at=NOW, actor="scheduler", run_id="run-1"))
    )
    assert (state.active, state.queue) == ("run-1", ("run-2",))


def test_admit_next_decides_nothing_while_a_run_is_active() -> None:
    given(WS, CREATED, enqueued("run-1"), enqueued("run-2"), admitted("run-1")).when(
        ADMIT
    ).then_nothing()


def test_admit_next_decides_nothing_when_the_queue_is_empty() -> None:
    given(WS, CREATED).when(ADMIT).then_nothing()


def test_admit_next_decides_nothing_for_a_missing_workspace() -> None:
    given(WS).when(ADMIT).then_nothing()


def test_releasing_the_active_run_frees_the_slot_for_the_next_oldest() -> None:
    history = [CREATED, enqueued("run-1"), enqueued("run-2"), admitted("run-1")]
    state = (
        given(WS, *history)
        .when(ReleaseRun(actor="scheduler", run_id="run-1", status="applied"))
        .then(RunReleased(at=NOW, actor="scheduler", run_id="run-1", status="applied"))
    )
    assert (state.active, state.queue) == ("", ("run-2",))
    given(WS, *history, released("run-1")).when(ADMIT).then(
        RunAdmitted(at=NOW, actor="scheduler", run_id="run-2")
    )


def test_releasing_a_waiting_run_removes_it_from_the_queue_and_keeps_the_active_one() -> None:
    history = [CREATED, enqueued("run-1"), enqueued("run-2"), enqueued("run-3"), admitted("run-1")]
    state = (
        given(WS, *history)
        .when(ReleaseRun(actor="alice", run_id="run-2", status="canceled"))
        .then(RunReleased(at=NOW, actor="alice", run_id="run-2", status="canceled"))
    )
    assert (state.active, state.queue) == ("run-1", ("run-3",))


def test_a_released_waiting_run_is_skipped_by_admission() -> None:
    history = [CREATED, enqueued("run-1"), enqueued("run-2"), released("run-1", "canceled")]
    given(WS, *history).when(ADMIT).then(RunAdmitted(at=NOW, actor="scheduler", run_id="run-2"))


@pytest.mark.parametrize(
    "history",
    [
        [CREATED],
        [CREATED, enqueued("run-1"), admitted("run-1"), released("run-1")],
        [],
    ],
    ids=["never-enqueued", "already-released", "missing-workspace"],
)
def test_releasing_an_unknown_run_decides_nothing(history: list[ws.WorkspaceEvent]) -> None:
    given(WS, *history).when(
        ReleaseRun(actor="scheduler", run_id="run-1", status="failed")
    ).then_nothing()


def test_evolve_counts_one_version_per_event() -> None:
    history = [CREATED, enqueued("run-1"), admitted("run-1"), released("run-1")]
    assert WS.fold(history).version == 4
