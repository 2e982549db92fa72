"""Workspace locks, given / when / then: who may lock and unlock, and that a locked
workspace queues runs but admits none."""

from __future__ import annotations

from datetime import timedelta

import pytest

from events import workspace as ws
from events.errors import Forbidden, IllegalTransition, Invalid, NotFound
from events.run import Workspace
from events.workspace import (
    AdmitNext,
    EnqueueRun,
    Lock,
    LockWorkspace,
    ReleaseRun,
    RunAdmitted,
    RunEnqueued,
    RunReleased,
    UnlockWorkspace,
    WorkspaceCreated,
    WorkspaceLocked,
    WorkspaceUnlocked,
)
from tests.gwt import NOW, Aggregate, given

WS = Aggregate(initial=ws.INITIAL, decide=ws.decide, evolve=ws.evolve)
EARLIER = NOW - timedelta(hours=1)
CREATED = WorkspaceCreated(
    at=EARLIER, actor="admin", org="acme", name="network", config=Workspace(repository="r")
)
LOCKED = WorkspaceLocked(at=EARLIER, actor="alice", reason="provider upgrade")
ADMIT = AdmitNext(actor="scheduler")


def enqueued(run_id: str) -> RunEnqueued:
    return RunEnqueued(at=EARLIER, actor="bob", run_id=run_id)


def test_locking_records_holder_reason_and_time() -> None:
    state = (
        given(WS, CREATED)
        .when(LockWorkspace(actor="alice", reason="provider upgrade"))
        .then(WorkspaceLocked(at=NOW, actor="alice", reason="provider upgrade"))
    )
    assert state.lock == Lock(holder="alice", reason="provider upgrade", locked_at=NOW)


def test_locking_a_locked_workspace_is_refused_naming_the_holder() -> None:
    error = (
        given(WS, CREATED, LOCKED)
        .when(LockWorkspace(actor="bob", reason="mine now"))
        .then_error(IllegalTransition)
    )
    assert "alice" in str(error) and "provider upgrade" in str(error)
    assert error.status == "locked"


@pytest.mark.parametrize("reason", ["", "   "])
def test_a_lock_without_a_reason_is_invalid(reason: str) -> None:
    given(WS, CREATED).when(LockWorkspace(actor="alice", reason=reason)).then_error(Invalid)


def test_locking_or_unlocking_a_missing_workspace_is_not_found() -> None:
    given(WS).when(LockWorkspace(actor="alice", reason="x")).then_error(NotFound)
    given(WS).when(UnlockWorkspace(actor="alice")).then_error(NotFound)


def test_unlocking_an_unlocked_workspace_is_an_illegal_transition() -> None:
    error = given(WS, CREATED).when(UnlockWorkspace(actor="alice")).then_error(IllegalTransition)
    assert error.status == "unlocked"


def test_the_holder_unlocks_and_the_event_keeps_the_lock_it_lifted() -> None:
    state = (
        given(WS, CREATED, LOCKED)
        .when(UnlockWorkspace(actor="alice"))
        .then(WorkspaceUnlocked(at=NOW, actor="alice", holder="alice", reason="provider upgrade"))
    )
    assert state.lock is None


def test_someone_else_may_not_unlock_but_an_org_admin_may() -> None:
    error = given(WS, CREATED, LOCKED).when(UnlockWorkspace(actor="bob")).then_error(Forbidden)
    assert "alice" in str(error)
    given(WS, CREATED, LOCKED).when(UnlockWorkspace(actor="carol", admin=True)).then(
        WorkspaceUnlocked(at=NOW, actor="carol", holder="alice", reason="provider upgrade")
    )


def test_runs_still_queue_while_locked_but_none_is_admitted() -> None:
    history = [CREATED, LOCKED, enqueued("run-1")]
    state = (
        given(WS, *history)
        .when(EnqueueRun(actor="bob", run_id="run-2"))
        .then(RunEnqueued(at=NOW, actor="bob", run_id="run-2"))
    )
    assert state.queue == ("run-1", "run-2")
    given(WS, *history, enqueued("run-2")).when(ADMIT).then_nothing()


def test_unlocking_lets_the_oldest_waiting_run_be_admitted() -> None:
    unlocked = WorkspaceUnlocked(at=EARLIER, actor="alice", holder="alice")
    history = [CREATED, LOCKED, enqueued("run-1"), enqueued("run-2"), unlocked]
    given(WS, *history).when(ADMIT).then(RunAdmitted(at=NOW, actor="scheduler", run_id="run-1"))


def test_a_lock_taken_while_a_run_is_active_leaves_it_active_and_blocks_the_next() -> None:
    active = RunAdmitted(at=EARLIER, actor="scheduler", run_id="run-1")
    history = [CREATED, enqueued("run-1"), enqueued("run-2"), active, LOCKED]
    state = WS.fold(history)
    assert (state.active, state.queue) == ("run-1", ("run-2",))
    done = RunReleased(at=NOW, actor="exec", run_id="run-1", status="applied")
    given(WS, *history).when(ReleaseRun(actor="exec", run_id="run-1", status="applied")).then(done)
    given(WS, *history, done).when(ADMIT).then_nothing()


def test_a_workspace_can_be_locked_again_after_an_unlock() -> None:
    unlocked = WorkspaceUnlocked(at=EARLIER, actor="alice", holder="alice")
    given(WS, CREATED, LOCKED, unlocked).when(LockWorkspace(actor="bob", reason="again")).then(
        WorkspaceLocked(at=NOW, actor="bob", reason="again")
    )
