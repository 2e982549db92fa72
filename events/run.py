"""The run aggregate: one execution of a run type against a workspace.

`decide(state, command, *, now, new_id)` returns the events a command produces (or raises a
DomainError); `evolve(state, event)` folds one event into the state. Both are pure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from enum import StrEnum
from typing import assert_never

import msgspec

from events.base import Command, Event
from events.errors import AlreadyExists, IllegalTransition, Invalid, NotFound, StaleLease


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
RUN_TYPES = ("plan", "apply", "destroy", "drift")

# Which phase a status waits for or runs; the executor claims a phase.
WAITING_PHASE = {Status.QUEUED: "plan", Status.APPLY_QUEUED: "apply"}
RUNNING_STATUS = {"plan": Status.PLANNING, "apply": Status.APPLYING}


class Workspace(msgspec.Struct, frozen=True, kw_only=True):
    """What the run needs to know of its workspace, snapshotted at creation."""

    repository: str
    branch: str = "main"
    directory: str = "."
    variables: dict[str, str] = {}


class PlanSummary(msgspec.Struct, frozen=True, kw_only=True):
    add: int = 0
    change: int = 0
    destroy: int = 0


# ---------------------------------------------------------------- events


class RunCreated(Event, frozen=True, kw_only=True, tag="run.created"):
    run_id: str
    org: str
    workspace: str
    run_type: str
    config: Workspace
    message: str = ""


class RunQueued(Event, frozen=True, kw_only=True, tag="run.queued"):
    """Admitted: the plan phase now waits for an executor."""

    phase: str = "plan"


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


class PlanFinished(Event, frozen=True, kw_only=True, tag="run.plan_finished"):
    lease_id: str
    commit: str
    has_changes: bool
    summary: PlanSummary
    plan_object: str = ""
    plan_digest: str = ""
    require_approval: bool = True


class RunApproved(Event, frozen=True, kw_only=True, tag="run.approved"):
    acknowledged: list[str] = []


class ApplyFinished(Event, frozen=True, kw_only=True, tag="run.apply_finished"):
    lease_id: str
    summary: PlanSummary


class RunDiscarded(Event, frozen=True, kw_only=True, tag="run.discarded"):
    reason: str = ""


class RunCanceled(Event, frozen=True, kw_only=True, tag="run.canceled"):
    reason: str = ""


class RunFailed(Event, frozen=True, kw_only=True, tag="run.failed"):
    reason: str
    message: str = ""
    lease_id: str = ""


RunEvent = (
    RunCreated
    | RunQueued
    | PhaseStarted
    | StepStarted
    | StepFinished
    | PlanFinished
    | RunApproved
    | ApplyFinished
    | RunDiscarded
    | RunCanceled
    | RunFailed
)


# ---------------------------------------------------------------- commands


class CreateRun(Command, frozen=True, kw_only=True):
    run_id: str
    org: str
    workspace: str
    run_type: str
    config: Workspace
    message: str = ""


class AdmitRun(Command, frozen=True, kw_only=True):
    pass


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


class FinishPlan(Command, frozen=True, kw_only=True):
    lease_id: str
    commit: str
    has_changes: bool
    summary: PlanSummary
    plan_object: str = ""
    plan_digest: str = ""
    require_approval: bool = True


class FinishApply(Command, frozen=True, kw_only=True):
    lease_id: str
    summary: PlanSummary


class ApproveRun(Command, frozen=True, kw_only=True):
    acknowledged: list[str] = []


class DiscardRun(Command, frozen=True, kw_only=True):
    reason: str = ""


class CancelRun(Command, frozen=True, kw_only=True):
    reason: str = ""


class FailRun(Command, frozen=True, kw_only=True):
    """Fail the run. With a lease_id it is an executor's report and is fenced."""

    reason: str
    message: str = ""
    lease_id: str = ""


RunCommand = (
    CreateRun
    | AdmitRun
    | ClaimPhase
    | StartStep
    | FinishStep
    | FinishPlan
    | FinishApply
    | ApproveRun
    | DiscardRun
    | CancelRun
    | FailRun
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
    version: int = 0

    @property
    def exists(self) -> bool:
        return self.status is not None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL


INITIAL = RunState()


def status_after_plan(state: RunState, event: PlanFinished) -> Status:
    """Where a finished plan leads, by run type and approval rule."""
    if not event.has_changes:
        return Status.NO_CHANGES
    if state.run_type == "plan":
        return Status.PLANNED
    if state.run_type == "drift":
        return Status.DRIFTED
    return Status.AWAITING_APPROVAL if event.require_approval else Status.APPLY_QUEUED


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
            )
        case RunQueued():
            return msgspec.structs.replace(s, status=Status.QUEUED, phase="")
        case PhaseStarted():
            return msgspec.structs.replace(
                s,
                status=RUNNING_STATUS[event.phase],
                phase=event.phase,
                lease_id=event.lease_id,
                executor_id=event.executor_id,
            )
        case StepStarted() | StepFinished():
            return s
        case PlanFinished():
            nxt = status_after_plan(state, event)
            return msgspec.structs.replace(
                s,
                status=nxt,
                phase="",
                lease_id="",
                commit=event.commit,
                has_changes=event.has_changes,
                plan_summary=event.summary,
                plan_object=event.plan_object,
                plan_digest=event.plan_digest,
            )
        case RunApproved():
            return msgspec.structs.replace(
                s,
                status=Status.APPLY_QUEUED,
                approved_by=event.actor,
                acknowledged=list(event.acknowledged),
            )
        case ApplyFinished():
            return msgspec.structs.replace(
                s, status=Status.APPLIED, phase="", lease_id="", apply_summary=event.summary
            )
        case RunDiscarded():
            return msgspec.structs.replace(s, status=Status.DISCARDED, reason=event.reason)
        case RunCanceled():
            return msgspec.structs.replace(s, status=Status.CANCELED, reason=event.reason)
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


def decide(
    state: RunState, command: RunCommand, *, now: datetime, new_id: Callable[[], str]
) -> list[RunEvent]:
    """Decide which events a command produces against the current run state."""
    who = command.actor
    match command:
        case CreateRun():
            if state.exists:
                raise AlreadyExists(f"run {command.run_id} already exists")
            if command.run_type not in RUN_TYPES:
                raise Invalid(f"unknown run type {command.run_type!r}")
            return [
                RunCreated(
                    at=now,
                    actor=who,
                    run_id=command.run_id,
                    org=command.org,
                    workspace=command.workspace,
                    run_type=command.run_type,
                    config=command.config,
                    message=command.message,
                )
            ]
        case AdmitRun():
            _require(state, {Status.PENDING}, "admit")
            return [RunQueued(at=now, actor=who, phase="plan")]
        case ClaimPhase():
            _require(state, set(WAITING_PHASE), "claim")
            if WAITING_PHASE[state.status] != command.phase:  # type: ignore[index]  # narrowed by _require
                raise IllegalTransition(
                    f"the run waits for its {WAITING_PHASE[state.status]} phase, "  # type: ignore[index]  # narrowed
                    f"not {command.phase}",
                    status=str(state.status),
                )
            if not command.lease_id:
                raise Invalid("a claim needs a lease id")
            return [
                PhaseStarted(
                    at=now,
                    actor=who,
                    phase=command.phase,
                    lease_id=command.lease_id,
                    executor_id=command.executor_id,
                )
            ]
        case StartStep():
            _fence(state, command.lease_id)
            return [StepStarted(at=now, actor=who, lease_id=command.lease_id, step=command.step)]
        case FinishStep():
            _fence(state, command.lease_id)
            return [
                StepFinished(
                    at=now,
                    actor=who,
                    lease_id=command.lease_id,
                    step=command.step,
                    ok=command.ok,
                    started_at=command.started_at,
                    log_object=command.log_object,
                    error=command.error,
                )
            ]
        case FinishPlan():
            _fence(state, command.lease_id)
            if state.status != Status.PLANNING:
                raise IllegalTransition(
                    f"cannot finish a plan of a run that is {state.status}",
                    status=str(state.status),
                )
            return [
                PlanFinished(
                    at=now,
                    actor=who,
                    lease_id=command.lease_id,
                    commit=command.commit,
                    has_changes=command.has_changes,
                    summary=command.summary,
                    plan_object=command.plan_object,
                    plan_digest=command.plan_digest,
                    require_approval=command.require_approval,
                )
            ]
        case FinishApply():
            _fence(state, command.lease_id)
            if state.status != Status.APPLYING:
                raise IllegalTransition(
                    f"cannot finish an apply of a run that is {state.status}",
                    status=str(state.status),
                )
            return [
                ApplyFinished(
                    at=now, actor=who, lease_id=command.lease_id, summary=command.summary
                )
            ]
        case ApproveRun():
            _require(state, {Status.AWAITING_APPROVAL}, "approve")
            return [RunApproved(at=now, actor=who, acknowledged=list(command.acknowledged))]
        case DiscardRun():
            _require(state, {Status.AWAITING_APPROVAL}, "discard")
            return [RunDiscarded(at=now, actor=who, reason=command.reason or "discarded")]
        case CancelRun():
            if state.status == Status.AWAITING_APPROVAL:
                raise IllegalTransition(
                    "a run awaiting approval is discarded, not canceled",
                    status=str(state.status),
                )
            if state.status == Status.APPLYING:
                raise IllegalTransition(
                    "an applying run cannot be canceled: interrupting an apply can corrupt state",
                    status=str(state.status),
                )
            _require(state, CANCELABLE, "cancel")
            return [RunCanceled(at=now, actor=who, reason=command.reason or "canceled")]
        case FailRun():
            if command.lease_id:
                _fence(state, command.lease_id)
            else:
                _require(state, set(Status) - TERMINAL, "fail")
            return [
                RunFailed(
                    at=now,
                    actor=who,
                    reason=command.reason or "failed",
                    message=command.message,
                    lease_id=command.lease_id,
                )
            ]
        case _:
            assert_never(command)
