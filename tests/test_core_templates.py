"""Templates, pure: the rules a template must follow (`events/templates.py`), which
template a run gets, and the run aggregate's step machine over custom, approval and apply
steps, with the statuses a run's `GET` shows (`events/runsteps.py`). No I/O."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from events import run, runsteps
from events import templates as te
from events.errors import IllegalTransition, Invalid, StaleLease
from events.run import (
    AdmitRun,
    ApproveRun,
    CancelRun,
    ClaimPhase,
    CreateRun,
    FailRun,
    FinishApply,
    FinishCustomStep,
    FinishPlan,
    PlanSummary,
    RunState,
    Status,
)

NOW = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
CONFIG = run.Workspace(repository="/repo")
SUMMARY = PlanSummary(add=1, change=0, destroy=0)


def steps(*spec: Any) -> list[te.TemplateStep]:
    """(number, kind) or (number, kind, name, command) tuples."""
    out = []
    for s in spec:
        number, kind, *rest = s
        name, command = [*rest, "", ""][:2]
        out.append(te.TemplateStep(number=number, kind=kind, name=name, command=command))
    return out


def refused(name: str, *spec: Any) -> str:
    with pytest.raises(Invalid) as e:
        te.validate(name, steps(*spec))
    return str(e.value)


# ---------------------------------------------------------------- rules


def test_a_valid_template_is_ordered_by_number() -> None:
    t = te.validate(
        "lint",
        steps((200, "apply"), (50, "custom", "lint", "tflint"), (100, "plan"), (150, "approval")),
    )
    assert [s.number for s in t.steps] == [50, 100, 150, 200]
    assert not t.builtin


@pytest.mark.parametrize(
    ("name", "spec", "why"),
    [
        ("Bad Name", [(100, "plan")], "lowercase"),
        ("apply", [(100, "plan")], "built-in"),
        ("dup", [(100, "plan"), (100, "custom", "x", "true")], "100 is used twice"),
        ("two-plans", [(100, "plan"), (110, "plan")], "at most one plan"),
        (
            "both",
            [(100, "plan"), (150, "approval"), (200, "apply"), (300, "destroy")],
            "at most one apply or destroy",
        ),
        ("early", [(50, "approval"), (100, "plan")], "must come after a plan"),
        ("noplan", [(200, "apply")], "must come after a plan"),
        ("noappr", [(100, "plan"), (200, "apply")], "needs an approval step"),
        (
            "policy",
            [(100, "plan"), (110, "custom", "x", "true"), (125, "policy")],
            "directly follow",
        ),
        ("nocmd", [(100, "custom", "lint", "  ")], "needs a command"),
        ("cmd", [(100, "plan", "", "echo")], "only custom steps"),
    ],
)
def test_a_broken_rule_is_refused_with_its_reason(name: str, spec: list[Any], why: str) -> None:
    assert why in refused(name, *spec)


def test_parse_steps_refuses_what_is_not_a_step() -> None:
    for raw, why in [
        ([], "non-empty"),
        ([{"number": 0, "kind": "plan"}], "number"),
        ([{"number": "1", "kind": "plan"}], "number"),
        ([{"number": 1, "kind": "lint"}], "kind"),
        ([{"number": 1, "kind": "plan", "when": "always"}], "unknown field"),
    ]:
        with pytest.raises(Invalid, match=why):
            te.parse_steps(raw)
    parsed = te.parse_steps([{"number": 7, "kind": "custom", "name": "x", "command": "true"}])
    assert parsed == steps((7, "custom", "x", "true"))


def test_which_templates_suit_which_run_type() -> None:
    applying = te.validate("a", steps((100, "plan"), (150, "approval"), (200, "apply")))
    destroying = te.validate("d", steps((100, "plan"), (150, "approval"), (200, "destroy")))
    custom = te.validate("c", steps((100, "custom", "noop", "true")))
    assert te.compatible(applying, "apply") == ""
    assert "changes nothing" in te.compatible(applying, "plan")
    assert "destroys" in te.compatible(destroying, "apply")
    assert "applies" in te.compatible(applying, "destroy")
    assert "needs a plan step" in te.compatible(custom, "drift")
    assert te.compatible(custom, "apply") == te.compatible(custom, "plan") == ""


def test_resolve_takes_the_named_then_the_default_then_the_builtin() -> None:
    mine = te.validate("mine", steps((50, "custom", "x", "true"), (100, "plan")))
    saved = {"mine": mine}
    assert te.resolve("plan", "", saved, {}).name == "plan"
    assert te.resolve("plan", "", saved, {"plan": "mine"}).name == "mine"
    assert te.resolve("plan", "plan", saved, {"plan": "mine"}).name == "plan"
    # The run's template gets the policy step right after its plan.
    assert te.resolve("plan", "mine", saved, {}).kinds() == ["custom", "plan", "policy"]
    with pytest.raises(Invalid, match="named by the run"):
        te.resolve("plan", "gone", saved, {})
    with pytest.raises(Invalid, match="default for apply runs"):
        te.resolve("apply", "", saved, {"apply": "gone"})
    with pytest.raises(Invalid, match="changes nothing"):
        te.resolve("plan", "apply", saved, {})


# ---------------------------------------------------------------- the step machine


def fold(state: RunState, command: Any) -> RunState:
    return run.fold(run.decide(state, command, now=NOW, new_id=lambda: "x"), state)


def created(spec: list[te.TemplateStep], run_type: str = "apply") -> RunState:
    template = te.with_policy(te.validate("t", spec)) if spec else None
    cmd = CreateRun(
        actor="alice",
        run_id="r1",
        org="acme",
        workspace="net",
        run_type=run_type,
        config=CONFIG,
        template=template,
    )
    return fold(fold(run.INITIAL, cmd), AdmitRun(actor="scheduler"))


def claim(state: RunState, phase: str, lease: str) -> RunState:
    return fold(state, ClaimPhase(actor="e", phase=phase, lease_id=lease, executor_id="e"))


def plan(state: RunState, *, changes: bool = True, approval: bool = True) -> RunState:
    state = claim(state, "plan", "lp")
    finish = FinishPlan(
        actor="e",
        lease_id="lp",
        commit="c0ffee",
        has_changes=changes,
        summary=SUMMARY,
        plan_object="o",
        plan_digest="d",
        require_approval=approval,
    )
    return fold(state, finish)


def shown(state: RunState) -> list[tuple[str, str]]:
    return [(s["name"], s["status"]) for s in runsteps.view(state)["steps"]]


LINTED = steps(
    (50, "custom", "lint", "tflint"),
    (100, "plan"),
    (150, "approval"),
    (200, "apply"),
    (300, "custom", "notify", "echo done"),
)


def test_custom_steps_before_the_plan_and_after_the_apply_run_in_order() -> None:
    s = created(LINTED)
    assert (s.status, s.waiting_phase) == (Status.QUEUED, "custom-50")
    assert runsteps.view(s)["current_step"]["name"] == "lint"
    s = claim(s, "custom-50", "l1")
    assert s.status == Status.RUNNING
    with pytest.raises(IllegalTransition):  # not the step it runs
        fold(s, FinishCustomStep(actor="e", lease_id="l1", number=300))
    with pytest.raises(StaleLease):
        fold(s, FinishCustomStep(actor="e", lease_id="other", number=50))
    s = fold(s, FinishCustomStep(actor="e", lease_id="l1", number=50))
    assert (s.status, s.waiting_phase) == (Status.QUEUED, "plan")
    s = plan(s)
    assert s.status == Status.AWAITING_APPROVAL
    s = fold(s, ApproveRun(actor="bob"))
    assert (s.status, s.waiting_phase) == (Status.APPLY_QUEUED, "apply")
    s = claim(s, "apply", "la")
    s = fold(s, FinishApply(actor="e", lease_id="la", summary=SUMMARY))
    assert (s.status, s.waiting_phase) == (Status.QUEUED, "custom-300")
    with pytest.raises(IllegalTransition, match="the apply has run"):
        fold(s, CancelRun(actor="alice"))
    s = claim(s, "custom-300", "ln")
    with pytest.raises(IllegalTransition, match="the apply has run"):  # nor stopped
        fold(s, CancelRun(actor="alice"))
    s = fold(s, FinishCustomStep(actor="e", lease_id="ln", number=300))
    assert s.status == Status.APPLIED
    assert shown(s) == [
        ("lint", "done"),
        ("plan", "done"),
        ("policy (implied)", "done"),
        ("approval", "done"),
        ("apply", "done"),
        ("notify", "done"),
    ]
    assert runsteps.view(s)["current_step"] is None


def test_a_plan_with_no_changes_skips_the_custom_steps_after_its_apply() -> None:
    """The apply did not run, so a step after it (a `notify` that says "applied") does
    not either: the run ends `no_changes` at once, that step shown `skipped`; a custom
    step between the plan and the apply still runs."""
    spec = steps(
        (100, "plan"),
        (120, "custom", "check", "true"),
        (150, "approval"),
        (200, "apply"),
        (300, "custom", "notify", "echo applied"),
    )
    s = plan(created(spec), changes=False)
    assert (s.status, s.waiting_phase) == (Status.QUEUED, "custom-120")
    s = fold(claim(s, "custom-120", "l"), FinishCustomStep(actor="e", lease_id="l", number=120))
    assert s.status == Status.NO_CHANGES
    assert shown(s) == [
        ("plan", "done"),
        ("policy (implied)", "done"),
        ("check", "done"),
        ("approval", "skipped"),
        ("apply", "skipped"),
        ("notify", "skipped"),
    ]


def test_a_custom_step_that_says_always_runs_after_an_apply_that_did_not() -> None:
    spec = [
        *steps((100, "plan"), (150, "approval"), (200, "apply")),
        te.TemplateStep(number=300, kind="custom", name="n", command="true", always=True),
    ]
    s = plan(created(spec), changes=False)
    assert (s.status, s.waiting_phase) == (Status.QUEUED, "custom-300")
    assert shown(s)[-1] == ("n", "current")
    s = fold(claim(s, "custom-300", "l"), FinishCustomStep(actor="e", lease_id="l", number=300))
    assert (s.status, s.custom_done, shown(s)[-1]) == (Status.NO_CHANGES, [300], ("n", "done"))


def test_always_is_for_custom_steps_and_a_boolean() -> None:
    with pytest.raises(Invalid, match="only custom steps say always"):
        te.validate("t", [te.TemplateStep(number=100, kind="plan", always=True)])
    with pytest.raises(Invalid, match="always must be true or false"):
        te.parse_steps([{"number": 1, "kind": "custom", "command": "x", "always": "yes"}])
    parsed = te.parse_steps([{"number": 1, "kind": "custom", "command": "x", "always": True}])
    assert parsed[0].always


def test_every_step_a_run_shows_has_a_number_of_its_own() -> None:
    """The implied policy step takes the number after the plan's (it shared the plan's:
    two steps 100); a template leaving no room for it is refused, saying so."""
    for spec in (LINTED, steps((100, "plan"), (150, "approval"), (200, "apply"))):
        numbers = [s["number"] for s in runsteps.view(created(spec))["steps"]]
        assert len(numbers) == len(set(numbers)), numbers
    implied = te.with_policy(te.validate("t", LINTED)).steps[2]
    assert (implied.kind, implied.number) == ("policy", 101)
    why = refused("tight", (100, "plan"), (101, "custom", "x", "true"))
    assert "leave 101 free" in why
    assert te.validate("ok", steps((100, "plan"), (101, "policy"))).kinds() == ["plan", "policy"]
    assert "no number for its policy step" in refused("last", (99999, "plan"))
    numbers = [s.number for s in te.with_policy(te.validate("end", steps((99998, "plan")))).steps]
    assert numbers == [99998, 99999]


def test_without_require_approval_the_approval_step_is_skipped() -> None:
    s = plan(created([]), approval=False)
    assert s.status == Status.APPLY_QUEUED
    assert [st for _, st in shown(s)] == ["done", "done", "skipped", "current"]


def test_a_template_of_one_custom_step_ends_applied_for_an_apply_run() -> None:
    s = created(steps((100, "custom", "noop", "true")))
    assert s.waiting_phase == "custom-100"
    s = fold(claim(s, "custom-100", "l"), FinishCustomStep(actor="e", lease_id="l", number=100))
    assert s.status == Status.APPLIED
    assert shown(s) == [("noop", "done")]


def test_a_failed_or_canceled_step_shows_where_the_run_ended() -> None:
    s = claim(created(LINTED), "custom-50", "l1")
    failed = fold(s, FailRun(actor="e", lease_id="l1", reason="step_failed", message="exit 3"))
    assert [st for _, st in shown(failed)] == ["failed"] + ["skipped"] * 5
    stopping = fold(s, CancelRun(actor="alice"))
    assert stopping.status == Status.RUNNING and stopping.stop_requested_by == "alice"
    stopped = fold(stopping, CancelRun(actor="e", lease_id="l1"))
    assert stopped.status == Status.CANCELED
    assert shown(stopped)[0] == ("lint", "canceled")
    queued = fold(created(LINTED), CancelRun(actor="alice"))  # a queued custom step
    assert queued.status == Status.CANCELED and shown(queued)[0] == ("lint", "canceled")


def test_a_pending_run_shows_every_step_pending() -> None:
    cmd = CreateRun(actor="a", run_id="r", org="o", workspace="w", run_type="plan", config=CONFIG)
    s = fold(run.INITIAL, cmd)
    view = runsteps.view(s)
    assert view["template"] == "plan" and view["current_step"] is None
    assert [st["status"] for st in view["steps"]] == ["pending", "pending"]


def test_an_unsuitable_template_is_refused_at_creation() -> None:
    applying = te.validate("a", steps((100, "plan"), (150, "approval"), (200, "apply")))
    cmd = CreateRun(
        actor="a",
        run_id="r",
        org="o",
        workspace="w",
        run_type="plan",
        config=CONFIG,
        template=applying,
    )
    with pytest.raises(Invalid, match="changes nothing"):
        run.decide(run.INITIAL, cmd, now=NOW, new_id=lambda: "x")
