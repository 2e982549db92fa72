"""The run aggregate's state, and where its steps lead next (see events/run.py)."""

from __future__ import annotations

from datetime import datetime

import msgspec

from events import policies as po
from events import templates as te
from events.run_events import TERMINAL, WAITING, Status
from events.values import Cause, ConfigSource, PlanSummary, RunOptions, Snapshot, Workspace


class RunState(msgspec.Struct, frozen=True, kw_only=True):
    run_id: str = ""
    org: str = ""
    workspace: str = ""
    run_type: str = ""
    status: Status | None = None
    config: Workspace | None = None
    created_by: str = ""
    created_at: datetime | None = None
    updated_at: datetime | None = None
    phase: str = ""
    lease_id: str = ""
    executor_id: str = ""
    phase_step: str = ""  # the last step started under the current lease
    released: int = 0  # the claims given back (`run.phase_released`): dispatch's attempt
    commit: str = ""
    snapshot: Snapshot | None = None
    pinning: bool = False  # admitted, its snapshot still to come: no executor may claim it
    has_changes: bool = False
    plan_summary: PlanSummary | None = None
    apply_summary: PlanSummary | None = None
    plan_object: str = ""
    plan_digest: str = ""
    approved_by: str = ""
    acknowledged: list[str] = []
    destructive: list[str] = []  # what the plan deletes or replaces (confirm_destructive)
    reason: str = ""
    message: str = ""
    error_message: str = ""
    stop_requested_by: str = ""
    stop_reason: str = ""
    limit_exceeded: str = ""
    speculative: bool = False
    template: te.Template | None = None
    step_at: int = -1  # index of the current step in `steps`; -1 before admission
    planned: bool = False  # the plan step has run
    apply_done: bool = False  # the apply (or destroy) step has run
    custom_done: list[int] = []  # the numbers of the custom steps that ran
    needs_approval: bool = False  # require_approval, or a soft-mandatory policy failed
    policies: list[po.PolicyResult] = []
    overridden: list[str] = []
    cause: Cause | None = None  # why it exists (None: created before causes were recorded)
    requested_commit: str = ""  # the commit asked at creation; the snapshot pins it
    source: ConfigSource | None = None  # an uploaded configuration instead of the repository
    options: RunOptions | None = None  # targets, replaces, refresh, run variables
    ended_at: datetime | None = None  # when it reached a terminal status
    log_removed_at: datetime | None = None  # retention removed its stored logs then
    removed_at: datetime | None = None  # retention removed its whole record then
    version: int = 0

    @property
    def exists(self) -> bool:
        return self.status is not None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    @property
    def steps(self) -> list[te.TemplateStep]:
        """The run's steps: its recorded template's, else its run type's built-in."""
        if self.template is not None:
            return self.template.steps
        return _BUILTIN_STEPS.get(self.run_type, _BUILTIN_STEPS["apply"])

    @property
    def current_step(self) -> te.TemplateStep | None:
        steps = self.steps
        return steps[self.step_at] if 0 <= self.step_at < len(steps) else None

    @property
    def waiting_phase(self) -> str:
        """The phase the run waits for an executor to claim, or ""."""
        step = self.current_step
        if self.status not in WAITING or step is None or self.pinning:
            return ""
        return te.phase_of(step)


INITIAL = RunState()
# The steps of runs recorded before templates (no `template`): their type's built-in.
_BUILTIN_STEPS = {name: te.with_policy(t).steps for name, t in te.BUILTIN.items()}


def secret_names(run: RunState) -> list[str]:
    """The secret variables a run is pinned to: its snapshot's, else its workspace's."""
    if run.snapshot is not None:
        return sorted(v.name for v in run.snapshot.variables if v.sensitive)
    return sorted(run.config.secret_variables) if run.config else []


def final_status(state: RunState) -> Status:
    """How a run whose steps are all done ends, by its plan and run type."""
    if state.planned and not state.has_changes:
        return Status.NO_CHANGES
    if state.run_type == "plan":
        return Status.PLANNED
    if state.run_type == "drift":
        return Status.DRIFTED
    return Status.APPLIED


def advance(state: RunState, start: int) -> tuple[Status, int]:
    """Where the run goes from step index `start`: the first step with something to do.
    A plan or a custom step waits for an executor (queued), an apply or destroy too
    (apply_queued), an approval waits for a person when one is needed. Policy steps ran
    with the plan; approval and changes steps are skipped when the plan found nothing to
    change, and so are the custom steps after the changes step (it did not run) that do
    not say `always`. Past the last step the run ends (`final_status`).

    `decide` asks this and records the answer in the event; `evolve` never does, so a
    change here changes the runs decided after it, never a recorded one."""
    steps = state.steps
    nothing = state.planned and not state.has_changes
    for i in range(max(start, 0), len(steps)):
        kind = steps[i].kind
        if kind == "custom" and nothing and not steps[i].always and te.after_changes(steps, i):
            continue  # it follows an apply that did not run
        if kind in ("plan", "custom"):
            return Status.QUEUED, i
        if kind == "approval" and state.needs_approval and not nothing:
            return Status.AWAITING_APPROVAL, i
        if kind in te.CHANGES and not nothing:
            return Status.APPLY_QUEUED, i
    return final_status(state), len(steps)
