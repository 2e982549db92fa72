"""Record golden run histories: `python -m tests.golden_record` writes `tests/golden/`.

Each scenario drives the pure core (`events.run.decide`, then `fold`) through one run
type and ending, as the shells do (scheduler, executor, reaper, API), and writes

- `<name>.jsonl`: the run's events exactly as stored (`codec.encode`), one a line;
- `<name>.expected.json`: what the code of the day made of them: the run's state after
  every event (status, step, phase), its final `RunState`, and the read-model rows the
  projection folds from them (tests/test_golden.py replays both on every change).

A golden is a record of the past: an existing file is never rewritten (`--force` aside).
New behaviour gets a new scenario name, so the old events keep proving that a change to
the core re-statuses no run recorded before it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec

from events import policies as po
from events import run as R
from events import templates as te
from events.approval import Caller
from events.codec import encode, run_subject
from events.values import AttributeChange, PlanSummary, ResourceChange, Snapshot, Workspace
from projections.project import finish, project_event
from projections.working import Working, meta_of

GOLDEN = Path(__file__).parent / "golden"
T0 = datetime(2026, 11, 3, 9, 0, tzinfo=UTC)
ORG, WS = "acme", "net"
CONFIG = Workspace(repository="https://git.example.com/acme/net.git", variables={"env": "prod"})
SNAPSHOT = Snapshot(
    commit="9f1c2e7",
    settings={
        "require_approval": {"value": True, "origin": "default"},
        "heartbeat_timeout": {"value": 60, "origin": "default"},
    },
)
_TRIGGER = AttributeChange(
    name="triggers", before={"v": "1"}, after={"v": "2"}, forces_replacement=True
)
CHANGES = [
    ResourceChange(
        address="null_resource.a",
        type="null_resource",
        name="a",
        action="replace",
        attributes=[_TRIGGER],
        replace_paths=["triggers"],
    ),
    ResourceChange(address="null_resource.b", type="null_resource", name="b", action="delete"),
    ResourceChange(address="null_resource.c", type="null_resource", name="c", action="create"),
]
SUMMARY = PlanSummary(add=2, change=0, destroy=2)
EMPTY = PlanSummary()


class Recorder:
    """One run driven through the core: every command at the next second, its events
    kept; a refused command is a mistake in the scenario and stops the recording."""

    def __init__(self, run_id: str, run_type: str, **create: Any) -> None:
        self.run_id = run_id
        self.state = R.INITIAL
        self.events: list[R.RunEvent] = []
        self.tick = 0
        self.leases = 0
        self.do(
            R.CreateRun(
                actor="alice",
                run_id=run_id,
                org=ORG,
                workspace=WS,
                run_type=run_type,
                config=CONFIG,
                message=f"golden {run_id}",
                **create,
            )
        )

    def do(self, command: R.RunCommand) -> list[R.RunEvent]:
        self.tick += 1
        now = T0 + timedelta(seconds=self.tick)
        new = R.decide(self.state, command, now=now, new_id=lambda: f"id-{self.tick}")
        self.state = R.fold(new, self.state)
        self.events.extend(new)
        return new

    # ------------------------------------------------ what the shells do

    def admit(self, *, pinning: bool = False) -> None:
        if pinning:
            self.do(R.AdmitRun(actor="scheduler", pinning=True))
            self.do(R.PinRun(actor="scheduler", snapshot=SNAPSHOT))
        else:
            self.do(R.AdmitRun(actor="scheduler", snapshot=SNAPSHOT))

    def claim(self) -> str:
        self.leases += 1
        lease = f"lease-{self.leases}"
        phase = self.state.waiting_phase
        self.do(R.ClaimPhase(actor="exec-1", phase=phase, lease_id=lease, executor_id="exec-1"))
        return lease

    def step(self, lease: str, name: str, *, ok: bool = True, error: str = "") -> None:
        started = T0 + timedelta(seconds=self.tick + 1)
        self.do(R.StartStep(actor="exec-1", lease_id=lease, step=name))
        self.do(
            R.FinishStep(
                actor="exec-1",
                lease_id=lease,
                step=name,
                ok=ok,
                started_at=started,
                log_object=f"logs/{self.run_id}/{name}",
                error=error,
                metrics={"lines": 12},
            )
        )

    def plan(
        self,
        *,
        changes: bool = True,
        approval: bool = True,
        policies: list[po.PolicyResult] | None = None,
    ) -> None:
        lease = self.claim()
        for name in ("checkout", "init", "plan"):
            self.step(lease, name)
        self.do(
            R.FinishPlan(
                actor="exec-1",
                lease_id=lease,
                commit=SNAPSHOT.commit,
                has_changes=changes,
                summary=SUMMARY if changes else EMPTY,
                plan_object=f"plans/{self.run_id}",
                plan_digest="sha256:" + "ab" * 32,
                require_approval=approval,
                commit_author="Alice <alice@example.com>",
                commit_message="bump",
                changes=CHANGES if changes else [],
                policies=policies or [],
            )
        )

    def approve(self, who: str = "bob") -> None:
        acked = [c.address for c in CHANGES if c.action in ("delete", "replace")]
        self.do(R.ApproveRun(actor=who, acknowledged=acked))

    def apply(self, *, fail: str = "") -> str:
        lease = self.claim()
        for name in ("checkout", "init"):
            self.step(lease, name)
        self.do(R.StartStep(actor="exec-1", lease_id=lease, step="apply"))
        for c in CHANGES:
            self.do(
                R.ReportResource(
                    actor="exec-1",
                    lease_id=lease,
                    address=c.address,
                    action=c.action,
                    state="applying",
                )
            )
            state = "failed" if fail and c.action == "create" else "done"
            self.do(
                R.ReportResource(
                    actor="exec-1",
                    lease_id=lease,
                    address=c.address,
                    action=c.action,
                    state=state,
                    error=fail if state == "failed" else "",
                )
            )
        self.do(
            R.RecordStateVersion(
                actor="exec-1",
                lease_id=lease,
                serial=4,
                lineage="l-1",
                digest="sha256:" + "cd" * 32,
                object=f"state/{self.run_id}/4",
                size=812,
            )
        )
        if fail:
            self.do(R.FailRun(actor="exec-1", lease_id=lease, reason="apply_failed", message=fail))
            return lease
        self.do(R.FinishApply(actor="exec-1", lease_id=lease, summary=SUMMARY))
        return lease

    def custom(self, number: int, *, ok: bool = True) -> None:
        lease = self.claim()
        self.step(lease, "checkout")
        self.step(lease, "run", ok=ok, error="" if ok else "exit 3")
        if ok:
            self.do(R.FinishCustomStep(actor="exec-1", lease_id=lease, number=number))
        else:
            message = f"custom step {number} (run) exited with code 3"
            self.do(
                R.FailRun(actor="exec-1", lease_id=lease, reason="step_failed", message=message)
            )


# ---------------------------------------------------------------- scenarios


def _custom_template() -> te.Template:
    steps = [
        te.TemplateStep(number=50, kind="custom", name="lint", command="tflint"),
        te.TemplateStep(number=100, kind="plan"),
        te.TemplateStep(number=125, kind="policy"),
        te.TemplateStep(number=150, kind="approval"),
        te.TemplateStep(number=200, kind="apply"),
        te.TemplateStep(number=300, kind="custom", name="notify", command="./notify.sh"),
    ]
    return te.Template(name="linted", steps=steps)


def _policy(name: str, enforcement: str, passed: bool) -> po.PolicyResult:
    messages = [] if passed else [f"{name}: deletions need a ticket"]
    return po.PolicyResult(
        name=name, enforcement=enforcement, scope="organization", passed=passed, messages=messages
    )


def apply_applied() -> Recorder:
    r = Recorder("apply-applied", "apply")
    r.admit(pinning=True)
    r.plan()
    r.approve()
    r.apply()
    r.do(
        R.RecoverStateVersion(
            actor="exec-2",
            serial=5,
            lineage="l-1",
            digest="sha256:ee",
            object="state/apply-applied/5",
            message="left on disk",
        )
    )
    return r


def apply_no_approval() -> Recorder:
    r = Recorder("apply-no-approval", "apply")
    r.admit()
    r.plan(approval=False)
    r.apply()
    return r


def apply_no_changes() -> Recorder:
    r = Recorder("apply-no-changes", "apply")
    r.admit()
    r.plan(changes=False)
    return r


def plan_planned() -> Recorder:
    r = Recorder("plan-planned", "plan")
    r.admit()
    r.plan()
    return r


def plan_speculative_no_changes() -> Recorder:
    r = Recorder("plan-speculative", "plan", speculative=True)
    r.admit()
    r.plan(changes=False)
    return r


def drift_drifted() -> Recorder:
    r = Recorder("drift-drifted", "drift")
    r.admit()
    r.plan(approval=False)
    return r


def drift_no_changes() -> Recorder:
    r = Recorder("drift-no-changes", "drift")
    r.admit()
    r.plan(changes=False, approval=False)
    return r


def destroy_applied() -> Recorder:
    r = Recorder("destroy-applied", "destroy")
    r.admit()
    r.plan()
    r.approve("carol")
    r.apply()
    return r


def apply_discarded() -> Recorder:
    r = Recorder("apply-discarded", "apply")
    r.admit()
    r.plan()
    r.do(R.DiscardRun(actor="bob", reason="not today"))
    return r


def apply_approval_timeout() -> Recorder:
    r = Recorder("apply-approval-timeout", "apply")
    r.admit()
    r.plan()
    r.do(R.DiscardRun(actor="reaper", reason="approval_timeout"))
    return r


def failed_executor_unavailable() -> Recorder:
    r = Recorder("failed-executor-unavailable", "apply")
    r.admit()
    lease = r.claim()
    r.do(R.StartStep(actor="exec-1", lease_id=lease, step="init"))
    r.do(
        R.FailRun(
            actor="reaper",
            reason="executor_unavailable",
            message="no heartbeat from exec-1 for 60s",
        )
    )
    return r


def released_applied() -> Recorder:
    """A draining executor gave the plan back mid-plan, and the apply before its apply
    step (`run.phase_released`, attempts 1 and 2); the next claims ran them."""
    r = Recorder("released-applied", "apply")
    r.admit()
    lease = r.claim()
    r.step(lease, "checkout")
    r.do(R.StartStep(actor="exec-1", lease_id=lease, step="plan"))
    r.do(R.ReleasePhase(actor="executor:exec-1", lease_id=lease, reason="executor_draining"))
    r.plan()
    r.approve()
    lease = r.claim()
    r.step(lease, "checkout")
    r.step(lease, "init")
    r.do(R.ReleasePhase(actor="executor:exec-1", lease_id=lease, reason="executor_draining"))
    r.apply()
    return r


def failed_plan_step() -> Recorder:
    r = Recorder("failed-plan-step", "plan")
    r.admit()
    lease = r.claim()
    r.step(lease, "checkout")
    r.step(lease, "init", ok=False, error="Error: Failed to query available provider packages")
    r.do(
        R.FailRun(
            actor="exec-1", lease_id=lease, reason="step_failed", message="init exited with code 1"
        )
    )
    return r


def failed_apply() -> Recorder:
    r = Recorder("failed-apply", "apply")
    r.admit()
    r.plan()
    r.approve()
    r.apply(fail="Error: creating null_resource.c: boom")
    return r


def failed_run_timeout() -> Recorder:
    r = Recorder("failed-run-timeout", "apply")
    r.admit()
    r.plan()
    r.do(
        R.FailRun(
            actor="reaper",
            reason="run_timeout",
            message="the run was open longer than its run_timeout of 3600s",
        )
    )
    return r


def failed_hard_policy() -> Recorder:
    r = Recorder("failed-hard-policy", "apply")
    r.admit()
    r.plan(
        policies=[_policy("tickets", "hard-mandatory", False), _policy("tags", "advisory", True)]
    )
    return r


def policy_soft_overridden() -> Recorder:
    r = Recorder("policy-soft-overridden", "apply")
    r.admit()
    r.plan(approval=False, policies=[_policy("tickets", "soft-mandatory", False)])
    r.approve()
    r.apply()
    return r


def apply_limit_marked() -> Recorder:
    r = Recorder("apply-limit-marked", "apply")
    r.admit()
    r.plan(approval=False)
    lease = r.claim()
    r.do(
        R.ExceedLimit(
            actor="reaper", limit="run_timeout", message="the apply in progress is not interrupted"
        )
    )
    r.do(R.FinishApply(actor="exec-1", lease_id=lease, summary=SUMMARY))
    return r


def canceled_pending() -> Recorder:
    r = Recorder("canceled-pending", "apply")
    r.do(R.CancelRun(actor="alice", reason="wrong branch"))
    return r


def canceled_queued() -> Recorder:
    r = Recorder("canceled-queued", "destroy")
    r.admit()
    r.do(R.CancelRun(actor="bob"))
    return r


def canceled_stopped_while_planning() -> Recorder:
    r = Recorder("canceled-stopped", "apply")
    r.admit()
    lease = r.claim()
    r.do(R.StartStep(actor="exec-1", lease_id=lease, step="plan"))
    r.do(R.CancelRun(actor="bob", reason="taking too long"))
    r.do(R.CancelRun(actor="exec-1", lease_id=lease))
    return r


def canceled_apply_queued() -> Recorder:
    r = Recorder("canceled-apply-queued", "apply")
    r.admit()
    r.plan()
    r.approve()
    r.do(R.CancelRun(actor="alice"))
    return r


def custom_applied() -> Recorder:
    r = Recorder("custom-applied", "apply", template=_custom_template())
    r.admit()
    r.custom(50)
    r.plan()
    r.approve()
    r.apply()
    r.custom(300)
    return r


def custom_failed() -> Recorder:
    r = Recorder("custom-failed", "apply", template=_custom_template())
    r.admit()
    r.custom(50, ok=False)
    return r


def custom_only_applied() -> Recorder:
    only = te.Template(
        name="noop", steps=[te.TemplateStep(number=100, kind="custom", name="noop", command="true")]
    )
    r = Recorder("custom-only", "apply", template=only)
    r.admit()
    r.custom(100)
    return r


def _notify_template(*, always: bool) -> te.Template:
    """The README's `linted`: no policy step of its own (it gets one, numbered 101)."""
    steps = [s for s in _custom_template().steps if s.kind != "policy"]
    if always:
        steps[-1] = msgspec.structs.replace(steps[-1], always=True)
    return te.with_policy(te.validate("linted", steps))


def custom_no_changes() -> Recorder:
    """After a plan with no changes the apply is skipped, and the notify after it too."""
    r = Recorder("custom-no-changes", "apply", template=_notify_template(always=False))
    r.admit()
    r.custom(50)
    r.plan(changes=False)
    return r


def custom_always_no_changes() -> Recorder:
    """A notify that says `always` runs after the skipped apply."""
    r = Recorder("custom-always-no-changes", "apply", template=_notify_template(always=True))
    r.admit()
    r.custom(50)
    r.plan(changes=False)
    r.custom(300)
    return r


def stamped_apply_applied() -> Recorder:
    """Recorded after events carried their outcome (status, step_at) and via."""
    r = Recorder("stamped-apply-applied", "apply")
    r.admit()
    r.plan()
    acked = [c.address for c in CHANGES if c.action in ("delete", "replace")]
    caller = Caller(user="bob", role="approver", groups=["ops"])
    r.do(R.ApproveRun(actor="bob", acknowledged=acked, caller=caller, via="api"))
    r.apply()
    return r


def stamped_failed_hard_policy() -> Recorder:
    r = Recorder("stamped-failed-hard-policy", "destroy")
    r.admit()
    r.plan(policies=[_policy("tickets", "hard-mandatory", False)])
    return r


def stamped_custom_discarded() -> Recorder:
    r = Recorder("stamped-custom-discarded", "apply", template=_custom_template())
    r.admit()
    r.custom(50)
    r.plan()
    caller = Caller(user="bob", role="operator")
    r.do(R.DiscardRun(actor="bob", reason="not now", caller=caller, via="api"))
    return r


SCENARIOS: dict[str, Callable[[], Recorder]] = {
    "apply-applied": apply_applied,
    "apply-no-approval": apply_no_approval,
    "apply-no-changes": apply_no_changes,
    "plan-planned": plan_planned,
    "plan-speculative-no-changes": plan_speculative_no_changes,
    "drift-drifted": drift_drifted,
    "drift-no-changes": drift_no_changes,
    "destroy-applied": destroy_applied,
    "apply-discarded": apply_discarded,
    "apply-approval-timeout": apply_approval_timeout,
    "failed-executor-unavailable": failed_executor_unavailable,
    "released-applied": released_applied,
    "failed-plan-step": failed_plan_step,
    "failed-apply": failed_apply,
    "failed-run-timeout": failed_run_timeout,
    "failed-hard-policy": failed_hard_policy,
    "policy-soft-overridden": policy_soft_overridden,
    "apply-limit-marked": apply_limit_marked,
    "canceled-pending": canceled_pending,
    "canceled-queued": canceled_queued,
    "canceled-stopped": canceled_stopped_while_planning,
    "canceled-apply-queued": canceled_apply_queued,
    "custom-applied": custom_applied,
    "custom-failed": custom_failed,
    "custom-only": custom_only_applied,
    "custom-no-changes": custom_no_changes,
    "custom-always-no-changes": custom_always_no_changes,
    "stamped-apply-applied": stamped_apply_applied,
    "stamped-failed-hard-policy": stamped_failed_hard_policy,
    "stamped-custom-discarded": stamped_custom_discarded,
}


# ---------------------------------------------------------------- what a replay gives


def trail_entry(state: R.RunState) -> dict[str, Any]:
    return {
        "status": str(state.status),
        "step_at": state.step_at,
        "phase": state.phase or state.waiting_phase,
    }


def replay(lines: list[bytes], run_id: str) -> dict[str, Any]:
    """What today's code makes of stored events: the state after each, the final state
    and the read-model rows (the projection's own folds, one batch per event)."""
    from events.codec import decode

    subject = run_subject(ORG, WS, run_id)
    state, trail, w = R.INITIAL, [], Working()
    for seq, raw in enumerate(lines, 1):
        event = decode(raw)
        assert isinstance(event, R.RunEvent)  # type: ignore[arg-type,misc]  # a union
        state = R.evolve(state, event)  # type: ignore[arg-type]  # a run event (above)
        trail.append(trail_entry(state))
        project_event(w, meta_of(seq, subject, seq * 1_000_000_000), event, raw)
        finish(w)
    rows = {
        table: [None if r is None else _row(r) for _, r in sorted(w.dirty[table].items(), key=_key)]
        for table in sorted(w.dirty)
        if w.dirty[table]
    }
    audit = [list(a) for a in w.audit]
    return {"trail": trail, "state": msgspec.to_builtins(state), "rows": rows, "audit": audit}


def _key(item: tuple[Any, Any]) -> str:
    return repr(item[0])


def _row(row: Any) -> dict[str, Any]:
    """A row with its JSON columns decoded, so a later added field compares as added."""
    out = dict(row)
    for column, value in row.items():
        if column.endswith("_json") and isinstance(value, str):
            out[column] = msgspec.json.decode(value)
    return out


def record(name: str, force: bool = False) -> bool:
    events_file = GOLDEN / f"{name}.jsonl"
    expected_file = GOLDEN / f"{name}.expected.json"
    if events_file.exists() and not force:
        return False
    r = SCENARIOS[name]()
    lines = [encode(e) for e in r.events]
    events_file.write_bytes(b"".join(line + b"\n" for line in lines))
    expected = {"run_id": r.run_id, **replay(lines, r.run_id)}
    expected_file.write_bytes(msgspec.json.format(msgspec.json.encode(expected)) + b"\n")
    return True


def main(argv: list[str]) -> None:
    GOLDEN.mkdir(exist_ok=True)
    force = "--force" in argv
    names = [a for a in argv if not a.startswith("--")] or list(SCENARIOS)
    for name in names:
        print(("recorded " if record(name, force) else "kept     ") + name)


if __name__ == "__main__":
    main(sys.argv[1:])
