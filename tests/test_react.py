"""The reaction table, given / when / then: given a run's (or workspace's) past events,
when one more event comes, then exactly these actions, decided from the state folded
through it. Pure: no broker, no clock.

    given(*history).when(event).then(Admit(...), Deadline(...))

Every event type of the codec is reacted to (exhaustive: `react` ends in `assert_never`,
and `test_every_event_type_of_the_codec_is_handled` fails on a new type without a sample
here), and every notification trigger is raised by a recorded run (tests/golden/).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import pytest

from events import react as rx
from events import run as R
from events import workspace as W
from events.codec import AnyEvent, decode, tag_of
from events.react import (
    Admit,
    AdmitSpeculative,
    Deadline,
    Dispatch,
    Enqueue,
    Follow,
    Notify,
    Watch,
    notifications,
    react,
)
from events.values import Workspace

GOLDEN = Path(__file__).parent / "golden"
AT = datetime(2026, 11, 3, 9, 0, tzinfo=UTC)
ORG, WS = "acme", "net"
CONFIG = Workspace(repository="https://git.example.com/acme/net.git")


def golden(name: str) -> list[Any]:
    return [decode(line) for line in (GOLDEN / f"{name}.jsonl").read_bytes().splitlines()]


def _fold(history: tuple[Any, ...]) -> Any:
    if isinstance(history[0], R.RunCreated):
        return R.fold(list(history))
    return W.fold(list(history))


@dataclass(frozen=True)
class Given:
    history: tuple[Any, ...]

    def when(self, event: Any) -> When:
        return When(event, _fold((*self.history, event)))


@dataclass(frozen=True)
class When:
    event: Any
    state: Any

    @property
    def actions(self) -> list[rx.Action]:
        return react(self.event, self.state)

    def then(self, *expected: rx.Action) -> None:
        assert self.actions == list(expected)

    def then_triggers(self, *triggers: str) -> None:
        assert [n.trigger for n in notifications(self.actions)] == list(triggers)


def given(*history: Any) -> Given:
    return Given(history)


def run_at(name: str, tag: str, nth: int = 1) -> tuple[Given, Any]:
    """A golden run up to (not including) the `nth` event of type `tag`, and that event."""
    events = golden(name)
    seen = 0
    for i, e in enumerate(events):
        if tag_of(e) == tag:
            seen += 1
            if seen == nth:
                return given(*events[:i]), e
    raise AssertionError(f"{name} has no {nth}th {tag}")


def key(run: str) -> Any:  # the keyword arguments of an action
    """The action key of a run: `run` is its id, or the name of a golden run."""
    path = GOLDEN / f"{run}.jsonl"
    run_id = golden(run)[0].run_id if path.exists() else run
    return {"org": "acme", "ws": "net", "run_id": run_id}


# ------------------------------------------------------------------ run events


def created(run_id: str = "r1", **kw: Any) -> R.RunCreated:
    return R.RunCreated(
        at=AT,
        actor="alice",
        run_id=run_id,
        org=ORG,
        workspace=WS,
        run_type=kw.pop("run_type", "apply"),
        config=CONFIG,
        **kw,
    )


def test_a_created_run_is_enqueued_its_deadline_kept_and_announced() -> None:
    given().when(created()).then(
        Enqueue(**key("r1")), Deadline(**key("r1")), Notify(trigger=rx.CREATED, **key("r1"))
    )


def test_a_created_speculative_plan_is_admitted_at_once_outside_the_queue() -> None:
    given().when(created(run_type="plan", speculative=True)).then(
        AdmitSpeculative(**key("r1")),
        Deadline(**key("r1")),
        Notify(trigger=rx.CREATED, **key("r1")),
    )


def test_a_run_queued_pinning_waits_for_its_snapshot_before_anything_else() -> None:
    g, queued = run_at("apply-applied", "run.queued")
    assert queued.pinning
    g.when(queued).then(Dispatch(**key("apply-applied"), pin=True))


def test_a_pinned_run_has_its_first_phase_dispatched_and_its_deadline_kept() -> None:
    g, pinned = run_at("apply-applied", "run.pinned")
    g.when(pinned).then(
        Dispatch(**key("apply-applied"), phase="plan"), Deadline(**key("apply-applied"))
    )


def test_a_run_queued_with_its_snapshot_is_dispatched_at_once() -> None:
    g, queued = run_at("plan-planned", "run.queued")
    assert not queued.pinning
    g.when(queued).then(
        Dispatch(**key("plan-planned"), phase="plan"), Deadline(**key("plan-planned"))
    )


def test_a_run_queued_for_a_custom_step_is_dispatched_to_that_step() -> None:
    g, queued = run_at("custom-only", "run.queued")
    g.when(queued).then(
        Dispatch(**key("custom-only"), phase="custom-100"), Deadline(**key("custom-only"))
    )


def test_a_claimed_plan_is_watched_on_its_lease_and_announced_planning() -> None:
    g, started = run_at("apply-applied", "run.phase_started")
    g.when(started).then(
        Watch(**key("apply-applied"), adopt=True),
        Notify(trigger=rx.PLANNING, **key("apply-applied")),
    )


def _given_back(phase: str, nth: int = 1) -> tuple[Given, R.PhaseReleased]:
    """A golden run up to just after its `nth` claim, and a drain's release of it."""
    g, started = run_at("apply-applied", "run.phase_started", nth)
    g = given(*g.history, started)
    status = R.Status.APPLY_QUEUED if phase == "apply" else R.Status.QUEUED
    ran: R.RunState = R.fold(list(g.history))
    released = R.PhaseReleased(
        at=AT,
        actor="executor:a",
        phase=phase,
        lease_id=started.lease_id,
        executor_id=started.executor_id,
        status=status,
        step_at=ran.step_at,
    )
    return g, released


@pytest.mark.parametrize(("phase", "nth"), [("plan", 1), ("apply", 2)])
def test_a_phase_given_back_is_purged_from_the_board_and_dispatched_again(
    phase: str, nth: int
) -> None:
    """The draining executor's release: the old lease's beats go, then the phase is
    dispatched afresh (a new message: `released` counts it) and its deadline kept."""
    g, released = _given_back(phase, nth)
    g.when(released).then(
        Watch(**key("apply-applied"), purge=(phase,)),
        Dispatch(**key("apply-applied"), phase=phase),
        Deadline(**key("apply-applied")),
    )


def test_a_claimed_apply_is_announced_applying() -> None:
    g, started = run_at("apply-applied", "run.phase_started", 2)
    g.when(started).then_triggers(rx.APPLYING)


def test_a_claimed_custom_step_is_watched_and_announces_nothing() -> None:
    g, started = run_at("custom-only", "run.phase_started")
    g.when(started).then(Watch(**key("custom-only"), adopt=True))


@pytest.mark.parametrize(
    "tag",
    [
        "run.step_started",
        "run.step_finished",
        "run.resource_state",
        "run.state_version",
    ],
)
def test_the_progress_of_a_phase_calls_for_nothing(tag: str) -> None:
    g, event = run_at("apply-applied", tag)
    g.when(event).then()


def test_a_stop_request_calls_for_nothing_its_executor_cancels() -> None:
    g, event = run_at("canceled-stopped", "run.stop_requested")
    g.when(event).then()


def test_a_limit_passed_during_an_apply_calls_for_nothing() -> None:
    g, event = run_at("apply-limit-marked", "run.limit_exceeded")
    g.when(event).then()


def test_a_plan_awaiting_approval_purges_its_board_entry_and_needs_attention() -> None:
    g, finished = run_at("apply-applied", "run.plan_finished")
    k = key("apply-applied")
    g.when(finished).then(
        Watch(**k, purge=("plan",)), Deadline(**k), Notify(trigger=rx.NEEDS_ATTENTION, **k)
    )


def test_a_plan_with_a_soft_failed_policy_needs_attention_for_its_override() -> None:
    g, finished = run_at("policy-soft-overridden", "run.plan_finished")
    g.when(finished).then_triggers(rx.NEEDS_ATTENTION)


def test_an_approved_plan_has_its_apply_dispatched() -> None:
    g, approved = run_at("apply-applied", "run.approved")
    k = key("apply-applied")
    g.when(approved).then(Dispatch(**k, phase="apply"), Deadline(**k))


def test_a_plan_without_approval_goes_straight_to_its_apply() -> None:
    g, finished = run_at("apply-no-approval", "run.plan_finished")
    k = key("apply-no-approval")
    g.when(finished).then(Dispatch(**k, phase="apply"), Watch(**k, purge=("plan",)), Deadline(**k))


def test_an_applied_run_releases_its_workspace_and_completes() -> None:
    g, finished = run_at("apply-applied", "run.apply_finished")
    k = key("apply-applied")
    g.when(finished).then(
        Admit(org="acme", ws="net"),
        Watch(**k, purge=("apply",)),
        Deadline(**k),
        Notify(trigger=rx.COMPLETED, **k),
        Follow(**k),  # it changed something: its workspace's followers get a run
    )


def _follows(name: str) -> int:
    """How many `Follow` actions a whole golden run calls for."""
    state, n = R.INITIAL, 0
    for e in golden(name):
        state = R.evolve(state, e)
        n += sum(isinstance(a, Follow) for a in react(e, state))
    return n


@pytest.mark.parametrize(
    ("name", "follows"),
    [
        ("apply-applied", 1),
        ("apply-no-approval", 1),
        ("destroy-applied", 1),
        ("custom-applied", 1),  # on the custom step after the apply that ends the run
        ("stamped-apply-applied", 1),
        ("apply-no-changes", 0),  # nothing to change: no apply
        ("plan-planned", 0),  # a plan-only run
        ("drift-drifted", 0),
        ("failed-apply", 0),  # an errored run
        ("apply-discarded", 0),
        ("canceled-apply-queued", 0),
    ],
)
def test_a_run_that_ends_applied_having_changed_something_has_its_followers_run_once(
    name: str, follows: int
) -> None:
    assert _follows(name) == follows


def test_an_apply_whose_summary_counts_no_resource_starts_nothing() -> None:
    """Its plan changed only outputs: the apply ran and changed no resource."""
    g, finished = run_at("apply-applied", "run.apply_finished")
    empty = msgspec.structs.replace(finished, summary=R.PlanSummary())
    assert not any(isinstance(a, Follow) for a in g.when(empty).actions)
    assert g.when(empty).state.status == R.Status.APPLIED


@pytest.mark.parametrize("name", ["plan-planned", "apply-no-changes", "drift-no-changes"])
def test_a_plan_that_ends_the_run_releases_it_and_completes(name: str) -> None:
    g, finished = run_at(name, "run.plan_finished")
    k = key(name)
    g.when(finished).then(
        Admit(org="acme", ws="net"),
        Watch(**k, purge=("plan",)),
        Deadline(**k),
        Notify(trigger=rx.COMPLETED, **k),
    )


def test_a_drift_run_that_found_drift_completes_and_is_drifted() -> None:
    g, finished = run_at("drift-drifted", "run.plan_finished")
    g.when(finished).then_triggers(rx.COMPLETED, rx.DRIFTED)


def test_a_speculative_plan_ends_without_a_release_it_never_held_the_workspace() -> None:
    g, finished = run_at("plan-speculative-no-changes", "run.plan_finished")
    k = key("plan-speculative-no-changes")
    g.when(finished).then(
        Watch(**k, purge=("plan",)), Deadline(**k), Notify(trigger=rx.COMPLETED, **k)
    )


def test_a_plan_a_hard_policy_failed_stays_planning_its_run_failed_says_it() -> None:
    name = "stamped-failed-hard-policy"
    g, finished = run_at(name, "run.plan_finished")
    k = key(name)
    g.when(finished).then(Watch(**k, purge=("plan",)), Deadline(**k))
    g, failed = run_at(name, "run.failed")
    g.when(failed).then(
        Admit(org="acme", ws="net"),
        Watch(**k, purge=rx.PHASES, custom=True),
        Deadline(**k),
        Notify(trigger=rx.ERRORED, **k),
        Notify(trigger=rx.POLICY_FAILED, **k),
    )


def test_a_finished_custom_step_purges_custom_entries_and_dispatches_the_next() -> None:
    g, finished = run_at("custom-applied", "run.custom_finished")
    k = key("custom-applied")
    g.when(finished).then(Dispatch(**k, phase="plan"), Watch(**k, custom=True), Deadline(**k))


def test_a_custom_step_that_ends_the_run_releases_it_and_completes() -> None:
    g, finished = run_at("custom-only", "run.custom_finished")
    k = key("custom-only")
    g.when(finished).then(
        Admit(org="acme", ws="net"),
        Watch(**k, custom=True),
        Deadline(**k),
        Notify(trigger=rx.COMPLETED, **k),
    )


@pytest.mark.parametrize("name", ["apply-discarded", "apply-approval-timeout"])
def test_a_discarded_run_releases_its_workspace_and_is_discarded(name: str) -> None:
    g, discarded = run_at(name, "run.discarded")
    k = key(name)
    g.when(discarded).then(
        Admit(org="acme", ws="net"), Deadline(**k), Notify(trigger=rx.DISCARDED, **k)
    )


@pytest.mark.parametrize(
    "name", ["canceled-pending", "canceled-queued", "canceled-apply-queued", "canceled-stopped"]
)
def test_a_canceled_run_releases_purges_every_phase_and_is_canceled(name: str) -> None:
    g, canceled = run_at(name, "run.canceled")
    k = key(name)
    g.when(canceled).then(
        Admit(org="acme", ws="net"),
        Watch(**k, purge=rx.PHASES, custom=True),
        Deadline(**k),
        Notify(trigger=rx.CANCELED, **k),
    )


@pytest.mark.parametrize(
    "name", ["failed-apply", "failed-executor-unavailable", "failed-plan-step", "custom-failed"]
)
def test_a_failed_run_releases_purges_every_phase_and_errored(name: str) -> None:
    g, failed = run_at(name, "run.failed")
    k = key(name)
    g.when(failed).then(
        Admit(org="acme", ws="net"),
        Watch(**k, purge=rx.PHASES, custom=True),
        Deadline(**k),
        Notify(trigger=rx.ERRORED, **k),
    )


def test_an_apply_that_ended_after_its_limit_passed_still_completes() -> None:
    g, finished = run_at("apply-limit-marked", "run.apply_finished")
    g.when(finished).then_triggers(rx.COMPLETED)


def test_a_recorded_stamp_is_obeyed_where_todays_derivation_would_differ() -> None:
    """`react` decides from the state, which copies the event's stamp: a plan stamped
    awaiting approval is awaited, whatever its `require_approval` says today."""
    g, finished = run_at("apply-no-approval", "run.plan_finished")
    approval = [s.kind for s in g.when(finished).state.steps].index("approval")
    stamped = msgspec.structs.replace(finished, status=R.Status.AWAITING_APPROVAL, step_at=approval)
    g.when(stamped).then_triggers(rx.NEEDS_ATTENTION)
    assert not any(isinstance(a, Dispatch) for a in g.when(stamped).actions)


# ------------------------------------------------------------------ workspace events


def ws_created() -> W.WorkspaceCreated:
    return W.WorkspaceCreated(at=AT, actor="alice", org=ORG, name=WS, config=CONFIG)


def test_a_new_workspace_tries_an_admission() -> None:
    given().when(ws_created()).then(Admit(org=ORG, ws=WS))


def test_an_enqueued_run_tries_an_admission_hinting_at_itself() -> None:
    given(ws_created()).when(W.RunEnqueued(at=AT, actor="alice", run_id="r1")).then(
        Admit(org=ORG, ws=WS, hint="r1")
    )


def test_a_released_run_or_an_unlock_tries_the_next_admission() -> None:
    enq = W.RunEnqueued(at=AT, actor="alice", run_id="r1")
    adm = W.RunAdmitted(at=AT, actor="scheduler", run_id="r1")
    rel = W.RunReleased(at=AT, actor="scheduler", run_id="r1", status="applied")
    given(ws_created(), enq, adm).when(rel).then(Admit(org=ORG, ws=WS))
    lock = W.WorkspaceLocked(at=AT, actor="alice", reason="maintenance")
    unlock = W.WorkspaceUnlocked(at=AT, actor="alice", holder="alice")
    given(ws_created(), lock).when(unlock).then(Admit(org=ORG, ws=WS))


@pytest.mark.parametrize(
    "event",
    [
        W.RunAdmitted(at=AT, actor="scheduler", run_id="r1"),
        W.VariablesSet(at=AT, actor="alice", variables={"a": "b"}),
        W.SettingsSet(at=AT, actor="alice", changes={"run_timeout": 60}),
        W.WorkspaceLocked(at=AT, actor="alice", reason="maintenance"),
    ],
)
def test_other_workspace_events_call_for_nothing(event: Any) -> None:
    given(ws_created(), W.RunEnqueued(at=AT, actor="a", run_id="r1")).when(event).then()


def test_a_run_or_workspace_event_without_its_state_is_refused_not_guessed() -> None:
    with pytest.raises(ValueError):
        react(created(), None)
    with pytest.raises(ValueError):
        react(ws_created(), None)


# ------------------------------------------------------------------ every type, every trigger


def _samples() -> list[tuple[Any, Any]]:
    """(event, state folded through it) for one event of every type at least."""
    out: list[tuple[Any, Any]] = []
    for path in sorted(GOLDEN.glob("*.jsonl")):
        events = golden(path.name.removesuffix(".jsonl"))
        state = R.INITIAL
        for e in events:
            state = R.evolve(state, e)
            out.append((e, state))
    g, released = _given_back("plan")
    before: R.RunState = R.fold(list(g.history))
    out.append((released, R.evolve(before, released)))
    # retention's record, after the last golden run ended (services/processes/retention.py)
    objects = [R.PrunedObject(name="r/plan/init.log", sha256="0" * 64, size=1)]
    pruned = R.LogPruned(at=AT, actor="retention", objects=objects, days=0)
    out.append((pruned, R.evolve(state, pruned)))
    removed = R.RunRemoved(at=AT, actor="retention", objects=objects, rows=["runs"], days=1)
    out.append((removed, R.evolve(out[-1][1], removed)))
    ws_history: list[Any] = [
        ws_created(),
        W.RunEnqueued(at=AT, actor="a", run_id="r1"),
        W.RunAdmitted(at=AT, actor="s", run_id="r1"),
        W.RunReleased(at=AT, actor="s", run_id="r1", status="applied"),
        W.VariablesSet(at=AT, actor="a", variables={}),
        W.SettingsSet(at=AT, actor="a", changes={}),
        W.WorkspaceLocked(at=AT, actor="a", reason="x"),
        W.WorkspaceUnlocked(at=AT, actor="a"),
        W.StatePushed(at=AT, actor="a", serial=1, lineage="l", digest="d", object="o", size=1),
        W.ConfigChanged(at=AT, actor="a", changes={"branch": "prod"}),
        W.WorkspaceDeleted(at=AT, actor="a"),
        W.WorkspacePurged(at=AT, actor="a"),
    ]
    ws_state = W.INITIAL
    for e in ws_history:
        ws_state = W.evolve(ws_state, e)
        out.append((e, ws_state))
    org_events: list[dict[str, Any]] = [
        {"type": "org.created", "name": "acme"},
        {"type": "org.token_issued", "token_id": "t", "token_hash": "h", "user": "u", "role": "r"},
        {"type": "org.token_revoked", "token_id": "t"},
        {"type": "org.token_used", "token_id": "t"},
        {"type": "org.folder_created", "name": "f"},
        {"type": "org.settings_set", "changes": {}},
        {"type": "org.folder_settings_set", "folder": "f", "changes": {}},
        {"type": "org.group_set", "name": "g", "members": []},
        {"type": "org.user_added", "user_id": "u-1", "email": "a@b.io", "name": "a"},
        {"type": "org.user_suspended", "user_id": "u-1"},
        {"type": "org.user_reactivated", "user_id": "u-1"},
        {"type": "org.user_linked", "user_id": "u-1", "issuer": "i", "subject": "s"},
        {"type": "org.team_set", "name": "net"},
        {"type": "org.team_members_set", "name": "net", "members": ["u-1"]},
        {"type": "org.user_teams_synced", "user_id": "u-1", "teams": ["net"]},
        {"type": "org.access_granted", "team": "net", "target": "org", "level": "read"},
        {"type": "org.access_revoked", "team": "net", "target": "org"},
        {"type": "org.team_deleted", "name": "net"},
        {
            "type": "org.template_set",
            "template": {"name": "t", "steps": [{"number": 1, "kind": "plan"}]},
        },
        {"type": "org.template_deleted", "name": "t"},
        {
            "type": "org.policy_set",
            "policy": {"name": "p", "enforcement": "advisory", "source": "x"},
        },
        {"type": "org.policy_deleted", "name": "p"},
        {
            "type": "org.notify_config_saved",
            "config": {
                "id": "n",
                "org": "acme",
                "name": "n",
                "destination": "generic",
                "url": "https://93.184.215.14/",
                "created_at": AT,
                "created_by": "a",
            },
        },
        {"type": "org.notify_config_deleted", "config_id": "n"},
        {
            "type": "org.notify_delivery_scheduled",
            "delivery_id": "d",
            "config_id": "n",
            "org": "acme",
            "workspace": "net",
            "run_id": "r",
            "trigger": "run:created",
            "event_seq": 1,
            "body": "{}",
        },
        {
            "type": "org.notify_delivery_attempted",
            "delivery_id": "d",
            "config_id": "n",
            "attempt": 1,
            "trigger": "run:created",
            "run_id": "r",
            "outcome": "delivered",
        },
        # chat-ops (events/chat.py): its own subjects, nothing for react
        {"type": "chat.slack_configured", "team_id": "T1"},
        {"type": "chat.slack_removed"},
        {"type": "chat.slack_user_mapped", "slack_id": "U1", "user": "u"},
        {"type": "chat.slack_user_unmapped", "slack_id": "U1"},
        {
            "type": "chat.slack_request_received",
            "request_id": "r",
            "kind": "command",
            "team_id": "T1",
            "slack_user": "U1",
        },
        {"type": "chat.slack_request_done", "request_id": "r", "outcome": "ok"},
        {
            "type": "chat.slack_message_linked",
            "run_id": "r1",
            "request_id": "r",
            "response_url": "x",
        },  # schedules (events/schedule.py): the schedule loop reads them itself
        {
            "type": "org.schedule_saved",
            "schedule": {
                "id": "s",
                "org": "acme",
                "workspace": "net",
                "cron": "* * * * *",
                "run_type": "drift",
                "since": AT,
                "created_at": AT,
                "created_by": "a",
                "updated_at": AT,
            },
        },
        # VCS connections (events/vcs.py): nothing for react
        {
            "type": "org.vcs_connection_saved",
            "connection": {
                "id": "c",
                "org": "acme",
                "name": "gh",
                "provider": "github",
                "api_url": "https://api.github.com",
                "created_at": AT,
                "created_by": "a",
            },
        },
        {"type": "org.vcs_connection_deleted", "connection_id": "c"},
        {
            "type": "org.vcs_delivery_accepted",
            "connection_id": "c",
            "delivery": "d",
            "event": "push",
        },
        {
            "type": "org.vcs_push_claimed",
            "connection_id": "c",
            "ref": "refs/heads/main",
            "commit": "6113728f27ae82c7b1a177c8d03f9e96e0adf246",
            "delivery": "d",
        },
        # the VCS reporter's (events/vcs_report.py): its own subjects, nothing for react
        {
            "type": "org.vcs_pr_row_set",
            "connection": "c",
            "repository": "acme/net",
            "pull_request": 1,
            "row": {
                "workspace": "net",
                "run_id": "r1",
                "commit": "abc1234",
                "status": "planned",
                "created_at": AT,
                "event_seq": 1,
            },
        },
        {"type": "org.vcs_comment_claimed", "claim": "c1"},
        {"type": "org.vcs_comment_linked", "claim": "c1", "comment_id": 7},
        # run triggers (events/run_triggers.py): the graph, read when an apply ends
        {"type": "org.run_trigger_added", "source": "net", "target": "app"},
        {"type": "org.run_trigger_removed", "source": "net", "target": "app"},
        {"type": "org.schedule_deleted", "schedule_id": "s"},
        {"type": "org.schedule_fired", "schedule_id": "s", "fire_time": AT, "run_id": "r"},
        {"type": "org.schedule_skipped", "schedule_id": "s", "fire_time": AT, "reason": "waiting"},
        # single sign-on (events/sso.py): read by sign-ins from its own subject
        {"type": "org.sso_configured", "issuer": "https://idp.example", "client_id": "c"},
        {"type": "org.sso_removed"},
        # audit destinations (events/audit_stream.py): the audit streamer's own
        {
            "type": "org.audit_destination_saved",
            "destination_id": "d1",
            "destination": {
                "id": "d1",
                "org": "acme",
                "name": "siem",
                "url": "https://siem.example",
                "has_secret": True,
                "created_at": AT,
                "created_by": "a",
            },
        },
        {"type": "org.audit_destination_deleted", "destination_id": "d1"},
        # stacks (events/stacks.py): read by a stack run from their subjects
        {"type": "org.stack_created", "name": "s", "definition": {"workspaces": ["a"]}},
        {"type": "org.stack_changed", "name": "s", "definition": {"workspaces": ["a"]}},
        {"type": "org.stack_deleted", "name": "s"},
        # stack runs (events/stack_run_events.py): their process reads their subjects
        {
            "type": "org.stack_run_created",
            "stack_run_id": "sr",
            "org": "acme",
            "stack": "s",
            "run_type": "apply",
            "definition": {"workspaces": ["a"]},
            "selected": ["a"],
            "failure_policy": "pause",
        },
        {"type": "org.stack_node_started", "node": "a", "run_id": "r", "attempt": 1},
        {"type": "org.stack_node_ended", "node": "a", "run_id": "r", "outcome": "failed"},
        {"type": "org.stack_nodes_skipped", "nodes": ["b"], "because_of": "a"},
        {"type": "org.stack_run_paused", "node": "a"},
        {"type": "org.stack_run_aborting", "node": "a", "cancel": ["r"]},
        {"type": "org.stack_run_resumed", "nodes": ["a"]},
        {"type": "org.stack_run_ended", "status": "completed"},
    ]
    for raw in org_events:
        out.append((msgspec.convert({"at": AT, "actor": "a", **raw}, AnyEvent), None))
    return out


def _tags() -> set[str]:
    return {
        str(t.__struct_config__.tag)
        for t in typing.get_args(AnyEvent)
        if hasattr(t, "__struct_config__")
    }


def test_every_event_type_of_the_codec_is_handled() -> None:
    """A sample of every tag the codec decodes is reacted to without error (a type added
    to the codec without a case in `react` fails mypy's `assert_never`, and here)."""
    samples = _samples()
    seen = {tag_of(e) for e, _ in samples}
    missing = _tags() - seen
    assert not missing, f"no sample of {sorted(missing)}: add one to _samples"
    for event, state in samples:
        actions = react(event, state)
        assert all(isinstance(a, typing.get_args(rx.Action)) for a in actions)


def test_every_trigger_is_raised_by_some_recorded_run() -> None:
    raised = {n.trigger for e, s in _samples() if s is not None for n in notifications(react(e, s))}
    assert raised == set(rx.TRIGGERS)


@pytest.mark.parametrize(
    ("name", "triggers"),
    [
        ("apply-applied", [rx.CREATED, rx.PLANNING, rx.NEEDS_ATTENTION, rx.APPLYING, rx.COMPLETED]),
        ("apply-no-approval", [rx.CREATED, rx.PLANNING, rx.APPLYING, rx.COMPLETED]),
        ("apply-approval-timeout", [rx.CREATED, rx.PLANNING, rx.NEEDS_ATTENTION, rx.DISCARDED]),
        ("drift-drifted", [rx.CREATED, rx.PLANNING, rx.COMPLETED, rx.DRIFTED]),
        ("canceled-pending", [rx.CREATED, rx.CANCELED]),
        ("stamped-failed-hard-policy", [rx.CREATED, rx.PLANNING, rx.ERRORED, rx.POLICY_FAILED]),
        # recorded before stamps: its day had the plan await approval for an instant
        (
            "failed-hard-policy",
            [rx.CREATED, rx.PLANNING, rx.NEEDS_ATTENTION, rx.ERRORED, rx.POLICY_FAILED],
        ),
        ("custom-only", [rx.CREATED, rx.COMPLETED]),
    ],
)
def test_a_whole_run_notifies_each_trigger_once_in_order(name: str, triggers: list[str]) -> None:
    got: list[str] = []
    state = R.INITIAL
    for e in golden(name):
        state = R.evolve(state, e)
        got.extend(n.trigger for n in notifications(react(e, state)))
    assert got == triggers


def test_every_run_that_held_its_workspace_asks_for_one_admission_at_its_end() -> None:
    """Its release: an admission attempt gives the workspace back if its writer died
    before it did (a speculative plan never held it: none)."""
    for path in sorted(GOLDEN.glob("*.jsonl")):
        state = R.INITIAL
        admits = 0
        for e in golden(path.name.removesuffix(".jsonl")):
            state = R.evolve(state, e)
            actions = react(e, state)
            admits += sum(isinstance(a, Admit) for a in actions)
            if isinstance(e, R.RunCreated):
                continue
            assert not (state.terminal is False and admits), path.name
        assert admits == (0 if state.speculative else 1), path.name


def test_a_quiet_event_calls_for_nothing_whatever_the_state_and_no_other_is_quiet() -> None:
    """What a consumer may skip folding for (`quiet`) is exactly what calls for nothing."""
    for event, state in _samples():
        if rx.quiet(event):
            assert react(event, state) == [] and react(event, None) == []
        else:
            assert react(event, state), f"{tag_of(event)} is not quiet yet calls for nothing"
            with pytest.raises(ValueError):
                react(event, None)


def test_the_phases_a_run_end_purges_are_the_boards() -> None:
    """`react` is pure (no services import): its copy of the board's phases must agree."""
    from infra.heartbeats import PHASES

    assert rx.PHASES == PHASES
