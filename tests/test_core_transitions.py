"""Transitions are recorded facts, and the approval rule is the core's: given / when / then.

- `decide` stamps where a run goes on the event that moves it (`status`, `step_at`), and
  `evolve` copies it: a stamp is obeyed even where today's derivation would differ.
- An event recorded before it carried its outcome is upcast (the frozen derivation of
  its day): a stream with every stamp stripped folds to the same states (hypothesis).
- `ApproveRun` / `DiscardRun` are refused by the core, for any writer: approvers by
  person or group, roles, four-eyes, confirm_destructive on the run's own destructive
  addresses; `via` is recorded.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import msgspec
from hypothesis import given as hgiven
from hypothesis import settings
from hypothesis import strategies as st

from events import run
from events.approval import Caller, Unacknowledged
from events.errors import DomainError, Forbidden, IllegalTransition, Invalid
from events.policies import PolicyResult
from events.run import (
    ApplyFinished,
    ApproveRun,
    DiscardRun,
    FinishPlan,
    PlanFinished,
    PlanSummary,
    ResourceChange,
    RunApproved,
    RunDiscarded,
    RunEvent,
    RunFailed,
    RunQueued,
    Snapshot,
    Status,
)
from events.run_upcast import upcast
from tests.gwt import NOW, Aggregate, given
from tests.projection_support import random_history

RUN = Aggregate(initial=run.INITIAL, decide=run.decide, evolve=run.evolve)
T = NOW - timedelta(hours=1)
CHANGES = [
    ResourceChange(address="a.x", type="a", action="replace"),
    ResourceChange(address="a.y", type="a", action="delete"),
    ResourceChange(address="a.z", type="a", action="create"),
]
OUTCOME = ("status", "step_at")


def snap(**values: Any) -> Snapshot:
    return Snapshot(settings={k: {"value": v, "origin": "workspace"} for k, v in values.items()})


def awaiting(snapshot: Snapshot | None = None, creator: str = "carol") -> list[RunEvent]:
    """A built-in apply run awaiting approval of a plan that replaces a.x and deletes a.y,
    as `decide` records it (stamps included)."""
    create = run.CreateRun(
        actor=creator,
        run_id="r1",
        org="acme",
        workspace="net",
        run_type="apply",
        config=run.Workspace(repository="/repo"),
    )
    commands: list[Any] = [
        create,
        run.AdmitRun(actor="scheduler", snapshot=snapshot),
        run.ClaimPhase(actor="x", phase="plan", lease_id="l1", executor_id="x"),
        FinishPlan(
            actor="x",
            lease_id="l1",
            commit="c",
            has_changes=True,
            summary=PlanSummary(add=1, destroy=2),
            changes=CHANGES,
        ),
    ]
    state = run.INITIAL
    events: list[RunEvent] = []
    for c in commands:
        new = run.decide(state, c, now=T, new_id=lambda: "id")
        state, events = run.fold(new, state), events + new
    assert state.status == Status.AWAITING_APPROVAL
    return events


def strip(event: RunEvent) -> RunEvent:
    """The event as it was recorded before events carried their outcome."""
    fields = {f: None for f in OUTCOME if f in event.__struct_fields__}
    return msgspec.structs.replace(event, **fields) if fields else event


# ---------------------------------------------------------------- recorded facts


def test_every_event_that_moves_the_run_carries_the_status_it_leads_to() -> None:
    """Admission, the plan's end and the approval each record where the run went."""
    events = awaiting()
    queued, started, planned = events[1], events[2], events[3]
    assert isinstance(queued, RunQueued) and isinstance(started, run.PhaseStarted)
    assert isinstance(planned, PlanFinished)
    assert (queued.status, queued.step_at) == (Status.QUEUED, 0)
    assert started.status == Status.PLANNING
    assert (planned.status, planned.step_at) == (Status.AWAITING_APPROVAL, 2)
    (approved,) = given(RUN, *events).when(ApproveRun(actor="bob")).events or []
    assert (approved.status, approved.step_at) == (Status.APPLY_QUEUED, 3)


def test_evolve_copies_the_recorded_status_and_derives_none() -> None:
    """A plan_finished that says `planned` leaves an apply run planned, although today's
    derivation would have it await approval: replay never re-decides a recorded run."""
    events = awaiting()
    planned = msgspec.structs.replace(events[3], status=Status.PLANNED, step_at=4)
    state = run.fold([*events[:3], planned])
    assert (state.status, state.step_at) == (Status.PLANNED, 4)


def test_an_event_recorded_without_its_outcome_gets_the_one_of_its_day() -> None:
    """Each stripped event folds to the state its stamped twin gives: the upcaster fills
    what `decide` would have stamped then."""
    events = awaiting()
    for i, event in enumerate(events):
        before = run.fold(events[:i])
        assert run.evolve(before, strip(event)) == run.evolve(before, event), event


def test_an_event_that_carries_its_outcome_is_not_upcast() -> None:
    event = RunQueued(at=T, actor="s", status=Status.PLANNED, step_at=7)
    assert upcast(run.INITIAL, event) is event


def test_a_hard_policy_failure_ends_the_run_in_one_event_run_failed() -> None:
    """The plan's event keeps the run planning; the failure in the same batch ends it."""
    events = awaiting()[:3]
    hard = PolicyResult(name="p", enforcement="hard-mandatory", scope="org", passed=False)
    finish = FinishPlan(
        actor="x",
        lease_id="l1",
        commit="c",
        has_changes=True,
        summary=PlanSummary(add=1),
        policies=[hard],
    )
    planned, failed = given(RUN, *events).when(finish).events or []
    assert isinstance(planned, PlanFinished) and isinstance(failed, RunFailed)
    assert planned.status == Status.PLANNING
    state = run.fold([*events, planned, failed])
    assert (state.status, state.reason) == (Status.FAILED, "policy_failed")
    assert state == run.fold([strip(e) for e in [*events, planned, failed]])


@settings(max_examples=200, deadline=None)
@hgiven(run_type=st.sampled_from(run.RUN_TYPES), length=st.integers(0, 40), data=st.data())
def test_a_history_with_every_outcome_stripped_folds_to_the_same_final_state(
    run_type: str, length: int, data: st.DataObject
) -> None:
    """Upcast-then-evolve round trip: old streams replay as new ones do."""
    events = random_history(run_type, length, data)
    assert run.fold([strip(e) for e in events]) == run.fold(events)


def test_the_apply_finished_event_says_the_run_ended_applied() -> None:
    """A run's end carries its final status (what a reaction table reads)."""
    events = awaiting()
    approved = RunApproved(at=T, actor="bob", status=Status.APPLY_QUEUED, step_at=3)
    claim = run.ClaimPhase(actor="x", phase="apply", lease_id="l2", executor_id="x")
    g = given(RUN, *events, approved)
    started = g.when(claim).events or []
    done = given(RUN, *events, approved, *started).when(
        run.FinishApply(actor="x", lease_id="l2", summary=PlanSummary())
    )
    (finished,) = done.events or []
    assert isinstance(finished, ApplyFinished)
    assert (finished.status, finished.step_at) == (Status.APPLIED, 4)


# ---------------------------------------------------------------- approval in decide


def approve(user: str, role: str = "operator", **caller: Any) -> ApproveRun:
    return ApproveRun(actor=user, caller=Caller(user=user, role=role, **caller), via="api")


def test_the_core_refuses_a_caller_the_approvers_do_not_name_for_any_writer() -> None:
    g = given(RUN, *awaiting(snap(approvers=["alice", "group:ops"])))
    error = g.when(approve("zed", "admin")).then_error(Forbidden)
    assert "zed is not among the workspace's approvers (alice, group:ops)" in str(error)
    g.when(DiscardRun(actor="zed", caller=Caller(user="zed", role="admin"))).then_error(Forbidden)
    assert g.when(approve("bob", groups=["ops"])).error is None  # a member of ops
    assert g.when(approve("alice")).error is None


def test_with_no_approvers_a_viewer_is_refused_and_an_operator_approves() -> None:
    g = given(RUN, *awaiting())
    error = g.when(approve("zed", "viewer")).then_error(Forbidden)
    assert "role viewer may not approve" in str(error)
    (approved,) = g.when(approve("zed", "operator")).events or []
    assert isinstance(approved, RunApproved) and approved.via == "api"


def test_four_eyes_refuses_the_creator_even_as_the_admin_or_the_system() -> None:
    g = given(RUN, *awaiting(snap(four_eyes=True), creator="carol"))
    error = g.when(approve("carol", "admin", superuser=True)).then_error(Forbidden)
    assert "carol created this run" in str(error)
    g.when(ApproveRun(actor="carol")).then_error(Forbidden)
    assert g.when(approve("dave")).error is None
    assert g.when(DiscardRun(actor="carol", caller=Caller(user="carol", role="operator"))).events


def test_confirm_destructive_needs_every_destructive_address_the_run_kept() -> None:
    """The run's state keeps what its plan deletes or replaces; the approval must name all."""
    events = awaiting(snap(confirm_destructive=True))
    assert run.fold(events).destructive == ["a.x", "a.y"]
    g = given(RUN, *events)
    error = g.when(approve("bob")).then_error(Unacknowledged)
    assert (error.missing, error.status) == (["a.x", "a.y"], "awaiting_approval")
    partly = ApproveRun(
        actor="bob", acknowledged=["a.y"], caller=Caller(user="bob", role="operator")
    )
    assert g.when(partly).then_error(Unacknowledged).missing == ["a.x"]
    both = msgspec.structs.replace(partly, acknowledged=["a.x", "a.y"])
    (approved,) = g.when(both).events or []
    assert isinstance(approved, RunApproved) and approved.acknowledged == ["a.x", "a.y"]


def test_the_rule_comes_before_the_status_and_a_stale_run_is_409() -> None:
    """A refused caller hears why whatever the status; an allowed one hears the status."""
    events = awaiting(snap(approvers=["alice"]))
    g = given(RUN, *events, RunDiscarded(at=T, actor="alice", reason="no"))
    g.when(approve("zed")).then_error(Forbidden)
    assert "a run that is discarded" in str(g.when(approve("alice")).then_error(IllegalTransition))


def test_a_caller_who_is_not_the_commands_actor_is_invalid() -> None:
    command = ApproveRun(actor="bob", caller=Caller(user="alice", role="admin"))
    given(RUN, *awaiting()).when(command).then_error(Invalid)


def test_the_systems_discard_passes_the_approvers_rule_and_records_no_via() -> None:
    """The reaper's approval timeout: no caller, so no approvers rule applies to it."""
    g = given(RUN, *awaiting(snap(approvers=["alice"])))
    (discarded,) = g.when(DiscardRun(actor="reaper", reason="approval_timeout")).events or []
    assert isinstance(discarded, RunDiscarded) and discarded.via == ""


def test_every_refusal_is_a_domain_error_the_shell_answers() -> None:
    assert issubclass(Unacknowledged, IllegalTransition)
    assert issubclass(Unacknowledged, DomainError) and not Unacknowledged.retryable
