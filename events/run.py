"""The run aggregate: one execution of a run type against a workspace.

`decide(state, command, *, now, new_id)` returns the events a command produces (or raises a
DomainError); `evolve(state, event)` folds one event into the state. Both are pure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from enum import StrEnum
from typing import TypeVar, assert_never

import msgspec

from events import policies as po
from events import templates as te
from events.base import Command, Event
from events.errors import AlreadyExists, IllegalTransition, Invalid, NotFound, StaleLease
from events.values import (
    RESOURCE_STATES,
    AttributeChange,
    PlanSummary,
    ResourceChange,
    Snapshot,
    VariableRef,
    Workspace,
    pinned_config,
)


class Status(StrEnum):
    PENDING = "pending"
    QUEUED = "queued"
    PLANNING = "planning"
    RUNNING = "running"
    AWAITING_APPROVAL = "awaiting_approval"
    APPLY_QUEUED = "apply_queued"
    APPLYING = "applying"
    APPLIED = "applied"
    PLANNED = "planned"
    NO_CHANGES = "no_changes"
    DRIFTED = "drifted"
    DISCARDED = "discarded"
    FAILED = "failed"
    CANCELED = "canceled"


TERMINAL = frozenset(
    {
        Status.APPLIED,
        Status.PLANNED,
        Status.NO_CHANGES,
        Status.DRIFTED,
        Status.DISCARDED,
        Status.FAILED,
        Status.CANCELED,
    }
)
CANCELABLE = frozenset({Status.PENDING, Status.QUEUED, Status.APPLY_QUEUED})
# A run in one of these is stopped: its executor interrupts Terraform, then cancels it.
STOPPABLE = frozenset({Status.PLANNING, Status.RUNNING})
RUN_TYPES = ("plan", "apply", "destroy", "drift")

# The statuses in which the run's current step waits for an executor to claim its phase
# (plan, apply or custom-<number>: events/templates.py `phase_of`).
WAITING = frozenset({Status.QUEUED, Status.APPLY_QUEUED})
RUNNING_STATUS = {"plan": Status.PLANNING, "apply": Status.APPLYING}


def running_status(phase: str) -> Status:
    """The status of a run while an executor runs `phase`."""
    return RUNNING_STATUS.get(phase, Status.RUNNING)


# ---------------------------------------------------------------- events


class RunCreated(Event, frozen=True, kw_only=True, tag="run.created"):
    run_id: str
    org: str
    workspace: str
    run_type: str
    config: Workspace
    message: str = ""
    speculative: bool = False  # a plan-only run outside the workspace queue
    template: te.Template | None = None  # None: the built-in of the run type (older runs)


class RunQueued(Event, frozen=True, kw_only=True, tag="run.queued"):
    """Admitted: the first step now waits for an executor, pinned to its snapshot; with
    `pinning` the snapshot is still to come (`run.pinned`) and no executor may claim the
    run before it has come."""

    phase: str = "plan"
    snapshot: Snapshot | None = None
    pinning: bool = False


class RunPinned(Event, frozen=True, kw_only=True, tag="run.pinned"):
    """The admitted run's snapshot: what it will plan and apply, whatever moves later."""

    snapshot: Snapshot


class PhaseStarted(Event, frozen=True, kw_only=True, tag="run.phase_started"):
    """An executor claimed the waiting phase under a fresh lease."""

    phase: str
    lease_id: str
    executor_id: str


class StepStarted(Event, frozen=True, kw_only=True, tag="run.step_started"):
    lease_id: str
    step: str


class StepFinished(Event, frozen=True, kw_only=True, tag="run.step_finished"):
    lease_id: str
    step: str
    ok: bool
    started_at: datetime
    log_object: str = ""
    error: str = ""
    metrics: dict[str, int] = {}


class PlanFinished(Event, frozen=True, kw_only=True, tag="run.plan_finished"):
    lease_id: str
    commit: str
    has_changes: bool
    summary: PlanSummary
    plan_object: str = ""
    plan_digest: str = ""
    require_approval: bool = True
    commit_author: str = ""
    commit_message: str = ""
    changes: list[ResourceChange] = []
    policies: list[po.PolicyResult] = []


class RunApproved(Event, frozen=True, kw_only=True, tag="run.approved"):
    acknowledged: list[str] = []
    overridden: list[str] = []  # soft-mandatory policies that failed and were overridden


class CustomStepFinished(Event, frozen=True, kw_only=True, tag="run.custom_finished"):
    """A custom step's command exited 0 (a failing one fails the run)."""

    lease_id: str
    number: int


class ApplyFinished(Event, frozen=True, kw_only=True, tag="run.apply_finished"):
    lease_id: str
    summary: PlanSummary


class ResourceStateChanged(Event, frozen=True, kw_only=True, tag="run.resource_state"):
    """One resource moved during the apply: pending, applying, done, failed, not_applied.

    A replacement reports each of its stages (`action` delete / create) in the order run.
    """

    lease_id: str
    address: str
    action: str
    state: str
    error: str = ""


class StateVersionCreated(Event, frozen=True, kw_only=True, tag="run.state_version"):
    """Terraform wrote a new state version (stored encrypted in the object store)."""

    lease_id: str
    serial: int
    lineage: str = ""
    digest: str
    object: str
    size: int = 0
    # Left on disk by an executor that died before recording it, and recorded by the next
    # start on its work directory (`lease_id` empty); `message` says what happened.
    recovered: bool = False
    message: str = ""


class RunDiscarded(Event, frozen=True, kw_only=True, tag="run.discarded"):
    reason: str = ""


class RunCanceled(Event, frozen=True, kw_only=True, tag="run.canceled"):
    reason: str = ""


class RunStopRequested(Event, frozen=True, kw_only=True, tag="run.stop_requested"):
    """Someone asked to stop a running phase; its executor interrupts it and cancels."""

    reason: str = ""


class RunLimitExceeded(Event, frozen=True, kw_only=True, tag="run.limit_exceeded"):
    """A limit passed while the run could not be stopped (an apply): recorded, not acted on."""

    limit: str
    message: str = ""


class RunFailed(Event, frozen=True, kw_only=True, tag="run.failed"):
    reason: str
    message: str = ""
    lease_id: str = ""


RunEvent = (
    RunCreated
    | RunQueued
    | RunPinned
    | PhaseStarted
    | StepStarted
    | StepFinished
    | PlanFinished
    | RunApproved
    | ApplyFinished
    | ResourceStateChanged
    | StateVersionCreated
    | RunDiscarded
    | RunCanceled
    | RunFailed
    | RunStopRequested
    | RunLimitExceeded
    | CustomStepFinished
)


# ---------------------------------------------------------------- commands


class CreateRun(Command, frozen=True, kw_only=True):
    run_id: str
    org: str
    workspace: str
    run_type: str
    config: Workspace
    message: str = ""
    speculative: bool = False
    template: te.Template | None = None


class AdmitRun(Command, frozen=True, kw_only=True):
    snapshot: Snapshot | None = None
    pinning: bool = False  # the snapshot follows (PinRun)


class PinRun(Command, frozen=True, kw_only=True):
    snapshot: Snapshot


class ClaimPhase(Command, frozen=True, kw_only=True):
    phase: str
    lease_id: str
    executor_id: str


class StartStep(Command, frozen=True, kw_only=True):
    lease_id: str
    step: str


class FinishStep(Command, frozen=True, kw_only=True):
    lease_id: str
    step: str
    ok: bool
    started_at: datetime
    log_object: str = ""
    error: str = ""
    metrics: dict[str, int] = {}


class FinishPlan(Command, frozen=True, kw_only=True):
    lease_id: str
    commit: str
    has_changes: bool
    summary: PlanSummary
    plan_object: str = ""
    plan_digest: str = ""
    require_approval: bool = True
    commit_author: str = ""
    commit_message: str = ""
    changes: list[ResourceChange] = []
    policies: list[po.PolicyResult] = []


class FinishApply(Command, frozen=True, kw_only=True):
    lease_id: str
    summary: PlanSummary


class ReportResource(Command, frozen=True, kw_only=True):
    lease_id: str
    address: str
    action: str
    state: str
    error: str = ""


class RecordStateVersion(Command, frozen=True, kw_only=True):
    lease_id: str
    serial: int
    lineage: str = ""
    digest: str
    object: str
    size: int = 0


class RecoverStateVersion(Command, frozen=True, kw_only=True):
    """Record a state version a dead executor left on disk: on any run, even ended."""

    serial: int
    lineage: str = ""
    digest: str
    object: str
    size: int = 0
    message: str = ""


class ApproveRun(Command, frozen=True, kw_only=True):
    acknowledged: list[str] = []


class FinishCustomStep(Command, frozen=True, kw_only=True):
    lease_id: str
    number: int


class DiscardRun(Command, frozen=True, kw_only=True):
    reason: str = ""


class CancelRun(Command, frozen=True, kw_only=True):
    """Cancel a waiting run, or ask a planning one to stop. With a lease_id it is the
    executor's report that it stopped the phase, and is fenced."""

    reason: str = ""
    lease_id: str = ""


class ExceedLimit(Command, frozen=True, kw_only=True):
    """Record that a limit passed during an apply, which no limit interrupts (once)."""

    limit: str
    message: str = ""


class FailRun(Command, frozen=True, kw_only=True):
    """Fail the run. With a lease_id it is an executor's report and is fenced."""

    reason: str
    message: str = ""
    lease_id: str = ""


RunCommand = (
    CreateRun
    | AdmitRun
    | PinRun
    | ClaimPhase
    | StartStep
    | FinishStep
    | FinishPlan
    | FinishApply
    | ReportResource
    | RecordStateVersion
    | RecoverStateVersion
    | ApproveRun
    | DiscardRun
    | CancelRun
    | FailRun
    | ExceedLimit
    | FinishCustomStep
)


# ---------------------------------------------------------------- state


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
    needs_approval: bool = False  # require_approval, or a soft-mandatory policy failed
    policies: list[po.PolicyResult] = []
    overridden: list[str] = []
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


def final_status(state: RunState) -> Status:
    """How a run whose steps are all done ended, by its plan and run type."""
    if state.planned and not state.has_changes:
        return Status.NO_CHANGES
    if state.run_type == "plan":
        return Status.PLANNED
    if state.run_type == "drift":
        return Status.DRIFTED
    return Status.APPLIED


def advance(state: RunState, start: int) -> RunState:
    """Move to the first step from index `start` that has something to do: a plan or a
    custom step waits for an executor (queued), an apply or destroy too (apply_queued),
    an approval waits for a person when one is needed. Policy steps ran with the plan;
    approval and changes steps are skipped when the plan found nothing to change. Past
    the last step the run ends (`final_status`)."""
    steps = state.steps
    nothing = state.planned and not state.has_changes
    for i in range(max(start, 0), len(steps)):
        kind = steps[i].kind
        if kind in ("plan", "custom"):
            return msgspec.structs.replace(state, status=Status.QUEUED, step_at=i)
        if kind == "approval" and state.needs_approval and not nothing:
            return msgspec.structs.replace(state, status=Status.AWAITING_APPROVAL, step_at=i)
        if kind in te.CHANGES and not nothing:
            return msgspec.structs.replace(state, status=Status.APPLY_QUEUED, step_at=i)
    return msgspec.structs.replace(state, status=final_status(state), step_at=len(steps))


def evolve(state: RunState, event: RunEvent) -> RunState:
    """Fold one event into the run state."""
    s = msgspec.structs.replace(state, version=state.version + 1, updated_at=event.at)
    match event:
        case RunCreated():
            return msgspec.structs.replace(
                s,
                run_id=event.run_id,
                org=event.org,
                workspace=event.workspace,
                run_type=event.run_type,
                config=event.config,
                status=Status.PENDING,
                created_by=event.actor,
                created_at=event.at,
                message=event.message,
                speculative=event.speculative,
                template=event.template,
            )
        case RunQueued():
            snap = event.snapshot
            queued = msgspec.structs.replace(
                s,
                phase="",
                snapshot=snap,
                config=pinned_config(s.config, snap),
                commit=snap.commit if snap and snap.commit else s.commit,
                pinning=event.pinning,
            )
            return advance(queued, 0)
        case RunPinned():
            snap = event.snapshot
            return msgspec.structs.replace(
                s,
                snapshot=snap,
                config=pinned_config(s.config, snap),
                commit=snap.commit or s.commit,
                pinning=False,
            )
        case PhaseStarted():
            return msgspec.structs.replace(
                s,
                status=running_status(event.phase),
                phase=event.phase,
                lease_id=event.lease_id,
                executor_id=event.executor_id,
            )
        case StepStarted() | StepFinished() | ResourceStateChanged() | StateVersionCreated():
            return s
        case PlanFinished():
            planned = msgspec.structs.replace(
                s,
                phase="",
                lease_id="",
                planned=True,
                commit=event.commit,
                has_changes=event.has_changes,
                plan_summary=event.summary,
                plan_object=event.plan_object,
                plan_digest=event.plan_digest,
                policies=list(event.policies),
                needs_approval=event.require_approval or bool(po.soft_failures(event.policies)),
            )
            return advance(planned, s.step_at + 1)
        case RunApproved():
            approved = msgspec.structs.replace(
                s,
                approved_by=event.actor,
                acknowledged=list(event.acknowledged),
                overridden=list(event.overridden),
            )
            return advance(approved, s.step_at + 1)
        case ApplyFinished():
            done = msgspec.structs.replace(
                s, phase="", lease_id="", apply_summary=event.summary, apply_done=True
            )
            return advance(done, s.step_at + 1)
        case CustomStepFinished():
            return advance(msgspec.structs.replace(s, phase="", lease_id=""), s.step_at + 1)
        case RunDiscarded():
            return msgspec.structs.replace(s, status=Status.DISCARDED, reason=event.reason)
        case RunCanceled():
            return msgspec.structs.replace(
                s, status=Status.CANCELED, reason=event.reason, lease_id=""
            )
        case RunStopRequested():
            return msgspec.structs.replace(
                s, stop_requested_by=event.actor, stop_reason=event.reason
            )
        case RunLimitExceeded():
            return msgspec.structs.replace(s, limit_exceeded=event.limit)
        case RunFailed():
            return msgspec.structs.replace(
                s,
                status=Status.FAILED,
                reason=event.reason,
                error_message=event.message,
                lease_id="",
            )
        case _:
            assert_never(event)


def fold(events: Sequence[RunEvent], state: RunState = INITIAL) -> RunState:
    for e in events:
        state = evolve(state, e)
    return state


def _require(state: RunState, allowed: frozenset[Status] | set[Status], what: str) -> None:
    if not state.exists:
        raise NotFound("run does not exist")
    if state.status not in allowed:
        raise IllegalTransition(
            f"cannot {what} a run that is {state.status}", status=str(state.status)
        )


def _fence(state: RunState, lease_id: str) -> None:
    if not state.exists:
        raise NotFound("run does not exist")
    if state.terminal or lease_id != state.lease_id or not state.lease_id:
        raise StaleLease(f"lease {lease_id} is not the run's current lease")


E = TypeVar("E", bound=Event)


def _record(event_type: type[E], command: Command, now: datetime, **overrides: object) -> E:
    """The event of a command: the command's fields that the event has, at `now`."""
    fields = {
        name: getattr(command, name)
        for name in event_type.__struct_fields__
        if name != "at" and hasattr(command, name)
    }
    return event_type(at=now, **{**fields, **overrides})


def _check_claim(state: RunState, command: ClaimPhase) -> None:
    _require(state, WAITING, "claim")
    if state.pinning:
        raise IllegalTransition("the run waits for its snapshot", status=str(state.status))
    waiting = state.waiting_phase
    if waiting != command.phase:
        raise IllegalTransition(
            f"the run waits for its {waiting} phase, not {command.phase}",
            status=str(state.status),
        )
    if not command.lease_id:
        raise Invalid("a claim needs a lease id")


def _check_cancel(state: RunState) -> None:
    if state.status == Status.AWAITING_APPROVAL:
        raise IllegalTransition(
            "a run awaiting approval is discarded, not canceled", status=str(state.status)
        )
    if state.status == Status.APPLYING:
        raise IllegalTransition(
            "an applying run cannot be canceled: interrupting an apply can corrupt state",
            status=str(state.status),
        )
    if state.apply_done and not state.terminal:
        raise IllegalTransition(
            "the apply has run: the steps after it cannot be canceled", status=str(state.status)
        )
    _require(state, CANCELABLE, "cancel")


def _cancel(state: RunState, command: CancelRun, now: datetime) -> list[RunEvent]:
    """Cancel a waiting run; ask a planning one to stop (once); fenced: the executor's
    report that it stopped the phase it was asked to stop."""
    if command.lease_id:
        _fence(state, command.lease_id)
        if not state.stop_requested_by or state.status not in STOPPABLE:
            raise IllegalTransition("no stop was requested", status=str(state.status))
        reason = command.reason or state.stop_reason or "stopped"
        return [_record(RunCanceled, command, now, reason=reason)]
    if state.exists and state.status in STOPPABLE and not state.apply_done:
        if state.stop_requested_by:
            return []
        return [_record(RunStopRequested, command, now)]
    _check_cancel(state)
    return [_record(RunCanceled, command, now, reason=command.reason or "canceled")]


def _check_finish(state: RunState, lease_id: str, status: Status, what: str) -> None:
    _fence(state, lease_id)
    if state.status != status:
        raise IllegalTransition(
            f"cannot finish {what} of a run that is {state.status}", status=str(state.status)
        )


def decide(
    state: RunState, command: RunCommand, *, now: datetime, new_id: Callable[[], str]
) -> list[RunEvent]:
    """Decide which events a command produces against the current run state."""
    match command:
        case CreateRun():
            if state.exists:
                raise AlreadyExists(f"run {command.run_id} already exists")
            if command.run_type not in RUN_TYPES:
                raise Invalid(f"unknown run type {command.run_type!r}")
            if command.speculative and command.run_type != "plan":
                raise Invalid("only plan runs can be speculative")
            if command.template is not None:
                problem = te.compatible(command.template, command.run_type)
                if problem:
                    raise Invalid(problem)
            return [_record(RunCreated, command, now)]
        case AdmitRun():
            _require(state, {Status.PENDING}, "admit")
            if command.pinning and command.snapshot is not None:
                raise Invalid("a run is admitted with its snapshot or pinning, not both")
            return [_record(RunQueued, command, now, phase="plan")]
        case PinRun():
            if state.terminal or state.status == Status.PENDING or not state.exists:
                _require(state, set(Status) - TERMINAL - {Status.PENDING}, "pin")
            if not state.pinning:
                return []  # pinned already (another scheduler), or admitted with its snapshot
            return [_record(RunPinned, command, now)]
        case ClaimPhase():
            _check_claim(state, command)
            return [_record(PhaseStarted, command, now)]
        case StartStep():
            _fence(state, command.lease_id)
            return [_record(StepStarted, command, now)]
        case FinishStep():
            _fence(state, command.lease_id)
            return [_record(StepFinished, command, now)]
        case FinishPlan():
            _check_finish(state, command.lease_id, Status.PLANNING, "a plan")
            finished: list[RunEvent] = [_record(PlanFinished, command, now)]
            hard = po.hard_failures(command.policies)
            if hard:  # in the same batch: no reader sees the plan go on
                message = po.failure_message(hard)
                failed = _record(RunFailed, command, now, reason="policy_failed", message=message)
                finished.append(failed)
            return finished
        case FinishCustomStep():
            step = state.current_step
            _check_finish(state, command.lease_id, Status.RUNNING, "a custom step")
            if step is None or step.kind != "custom" or step.number != command.number:
                raise IllegalTransition(
                    f"the run's current step is not custom step {command.number}",
                    status=str(state.status),
                )
            return [_record(CustomStepFinished, command, now)]
        case FinishApply():
            _check_finish(state, command.lease_id, Status.APPLYING, "an apply")
            return [_record(ApplyFinished, command, now)]
        case ReportResource():
            _check_finish(state, command.lease_id, Status.APPLYING, "a resource")
            if command.state not in RESOURCE_STATES:
                raise Invalid(f"unknown resource state {command.state!r}")
            return [_record(ResourceStateChanged, command, now)]
        case RecordStateVersion():
            _fence(state, command.lease_id)
            return [_record(StateVersionCreated, command, now)]
        case RecoverStateVersion():
            if not state.exists:
                raise NotFound("run does not exist")
            return [_record(StateVersionCreated, command, now, lease_id="", recovered=True)]
        case ApproveRun():
            _require(state, {Status.AWAITING_APPROVAL}, "approve")
            overridden = [r.name for r in po.soft_failures(state.policies)]
            return [
                _record(
                    RunApproved,
                    command,
                    now,
                    acknowledged=list(command.acknowledged),
                    overridden=overridden,
                )
            ]
        case DiscardRun():
            _require(state, {Status.AWAITING_APPROVAL}, "discard")
            return [_record(RunDiscarded, command, now, reason=command.reason or "discarded")]
        case CancelRun():
            return _cancel(state, command, now)
        case ExceedLimit():
            _require(state, {Status.APPLYING}, "mark a limit on")
            if state.limit_exceeded:
                return []
            return [_record(RunLimitExceeded, command, now)]
        case FailRun():
            if command.lease_id:
                _fence(state, command.lease_id)
            else:
                _require(state, set(Status) - TERMINAL, "fail")
            return [_record(RunFailed, command, now, reason=command.reason or "failed")]
        case _:
            assert_never(command)


__all__ = [
    "AttributeChange",
    "PlanSummary",
    "ResourceChange",
    "Snapshot",
    "VariableRef",
    "Workspace",
]
