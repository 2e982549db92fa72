"""The run aggregate's `decide`: which events a command produces (see events/run.py).

The events that move the run carry where it goes (`status`, `step_at`): worked out here
(`advance`), once, so that folding them later decides nothing.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import datetime
from typing import TypeVar, assert_never

import msgspec

from events import approval
from events import policies as po
from events import templates as te
from events.base import Command, Event
from events.errors import AlreadyExists, IllegalTransition, Invalid, NotFound, StaleLease
from events.run_commands import (
    AdmitRun,
    ApproveRun,
    CancelRun,
    ClaimPhase,
    CreateRun,
    DiscardRun,
    ExceedLimit,
    FailRun,
    FinishApply,
    FinishCustomStep,
    FinishPlan,
    FinishStep,
    PinRun,
    PruneLog,
    RecordStateVersion,
    RecoverStateVersion,
    ReleasePhase,
    RemoveRun,
    ReportResource,
    RunCommand,
    StartStep,
)
from events.run_events import (
    CANCELABLE,
    REMOVED_ROWS,
    RUN_TYPES,
    STOPPABLE,
    TERMINAL,
    WAITING,
    ApplyFinished,
    CustomStepFinished,
    LogPruned,
    PhaseReleased,
    PhaseStarted,
    PlanFinished,
    ResourceStateChanged,
    RunApproved,
    RunCanceled,
    RunCreated,
    RunDiscarded,
    RunEvent,
    RunFailed,
    RunLimitExceeded,
    RunPinned,
    RunQueued,
    RunRemoved,
    RunStopRequested,
    StateVersionCreated,
    Status,
    StepFinished,
    StepStarted,
    running_status,
)
from events.run_state import RunState, advance
from events.values import CAUSE_KINDS, RESOURCE_STATES, options_problem


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
_SHA = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


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


# The steps of a phase that may run again: a plan changes nothing (its state lock is given
# back when Terraform is interrupted); an apply until its `apply` step began; a custom
# step until its command began.
RELEASABLE: dict[Status, frozenset[str] | None] = {
    Status.PLANNING: None,
    Status.APPLYING: frozenset({"", "checkout", "init", "warm"}),
    Status.RUNNING: frozenset({"", "checkout"}),
}


def _release_phase(state: RunState, command: ReleasePhase, now: datetime) -> PhaseReleased:
    """Give a claimed phase back to its pool: it waits again, under no lease."""
    _fence(state, command.lease_id)
    if state.status not in RELEASABLE:
        raise IllegalTransition("no phase runs to give back", status=str(state.status))
    steps = RELEASABLE[state.status]
    if steps is not None and state.phase_step not in steps:
        raise IllegalTransition(
            f"the {state.phase} phase began its {state.phase_step} step: it runs once",
            status=str(state.status),
        )
    waiting = Status.APPLY_QUEUED if state.status == Status.APPLYING else Status.QUEUED
    return _record(
        PhaseReleased,
        command,
        now,
        phase=state.phase,
        executor_id=state.executor_id,
        reason=command.reason or "executor_draining",
        attempt=state.released + 1,
        status=waiting,
        step_at=state.step_at,
    )


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
    if state.removed_at is not None:  # retention removed its record: nothing more
        raise IllegalTransition("the run's record is removed by retention", status="removed")
    return _decide(state, command, now=now, new_id=new_id)


def _decide(
    state: RunState, command: RunCommand, *, now: datetime, new_id: Callable[[], str]
) -> list[RunEvent]:
    match command:
        case CreateRun():
            _check_create(state, command)
            return [_record(RunCreated, command, now)]
        case AdmitRun():
            return [_admit(state, command, now)]
        case PinRun():
            return _pin(state, command, now)
        case ClaimPhase():
            _check_claim(state, command)
            return [_record(PhaseStarted, command, now, status=running_status(command.phase))]
        case ReleasePhase():
            return [_release_phase(state, command, now)]
        case StartStep():
            _fence(state, command.lease_id)
            return [_record(StepStarted, command, now)]
        case FinishStep():
            _fence(state, command.lease_id)
            return [_record(StepFinished, command, now)]
        case FinishPlan():
            return _finish_plan(state, command, now)
        case FinishCustomStep():
            _check_custom(state, command)
            return [_record(CustomStepFinished, command, now, **_next(state))]
        case FinishApply():
            _check_finish(state, command.lease_id, Status.APPLYING, "an apply")
            done = msgspec.structs.replace(state, apply_done=True)
            return [_record(ApplyFinished, command, now, **_next(done))]
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
            return [_approve(state, command, now)]
        case DiscardRun():
            _check_approval(state, "discard", command.actor, command.caller)
            return [_record(RunDiscarded, command, now, reason=command.reason or "discarded")]
        case CancelRun():
            return _cancel(state, command, now)
        case ExceedLimit():
            _require(state, {Status.APPLYING}, "mark a limit on")
            return [] if state.limit_exceeded else [_record(RunLimitExceeded, command, now)]
        case FailRun():
            _check_fail(state, command)
            return [_record(RunFailed, command, now, reason=command.reason or "failed")]
        case PruneLog() | RemoveRun():
            return _retention(state, command, now)
        case _:
            assert_never(command)


def _retention(state: RunState, command: PruneLog | RemoveRun, now: datetime) -> list[RunEvent]:
    """Retention's records: a log prune, or the whole record's removal
    (services/processes/retention.py, removal.py)."""
    if isinstance(command, PruneLog):
        return _prune_log(state, command, now)
    _check_retention(state, command.ended_before)
    return [_record(RunRemoved, command, now, rows=list(REMOVED_ROWS))]


def _prune_log(state: RunState, command: PruneLog, now: datetime) -> list[RunEvent]:
    """Retention: only a run that has ended, before the cutoff, and only once."""
    _check_retention(state, command.ended_before)
    if state.log_removed_at is not None:
        raise IllegalTransition("the run's log is removed already", status="removed")
    return [_record(LogPruned, command, now)]


def _check_retention(state: RunState, ended_before: datetime) -> None:
    """Retention touches only a run that has ended, at or before the cutoff."""
    if not state.terminal or state.ended_at is None:
        raise IllegalTransition(
            f"retention cannot touch a run that is {state.status}", status=str(state.status)
        )
    if state.ended_at > ended_before:
        raise IllegalTransition("the run ended after the retention cutoff", status="recent")


def _next(state: RunState, start: int | None = None) -> dict[str, object]:
    """The outcome fields of an event that moves the run on from its current step."""
    status, step_at = advance(state, state.step_at + 1 if start is None else start)
    return {"status": status, "step_at": step_at}


def _check_create(state: RunState, command: CreateRun) -> None:
    if state.exists:
        raise AlreadyExists(f"run {command.run_id} already exists")
    if command.run_type not in RUN_TYPES:
        raise Invalid(f"unknown run type {command.run_type!r}")
    if command.speculative and command.run_type != "plan":
        raise Invalid("only plan runs can be speculative")
    if command.cause is not None and command.cause.kind not in CAUSE_KINDS:
        raise Invalid(f"unknown run cause {command.cause.kind!r}")
    if command.commit and not _SHA.fullmatch(command.commit):
        raise Invalid("a run's commit is a full hexadecimal sha (40 or 64 digits)")
    if command.options is not None:
        problem = options_problem(command.options)
        if problem:
            raise Invalid(problem)
    if command.template is not None:
        problem = te.compatible(command.template, command.run_type)
        if problem:
            raise Invalid(problem)


def _admit(state: RunState, command: AdmitRun, now: datetime) -> RunQueued:
    _require(state, {Status.PENDING}, "admit")
    if command.pinning and command.snapshot is not None:
        raise Invalid("a run is admitted with its snapshot or pinning, not both")
    return _record(RunQueued, command, now, phase="plan", **_next(state, 0))


def _pin(state: RunState, command: PinRun, now: datetime) -> list[RunEvent]:
    if state.terminal or state.status == Status.PENDING or not state.exists:
        _require(state, set(Status) - TERMINAL - {Status.PENDING}, "pin")
    if not state.pinning:
        return []  # pinned already (another scheduler), or admitted with its snapshot
    return [_record(RunPinned, command, now)]


def _finish_plan(state: RunState, command: FinishPlan, now: datetime) -> list[RunEvent]:
    """The plan's end, and where it leads; a hard-mandatory policy that failed fails the
    run in the same batch (no reader sees the plan go on), and the plan's own event then
    leaves the status as it was, so that the run's end is the one event `run.failed`."""
    _check_finish(state, command.lease_id, Status.PLANNING, "a plan")
    skipped = AUTO_APPLY if _auto_applies(state, command) else ""
    required = command.require_approval and not skipped
    needs = required or bool(po.soft_failures(command.policies))
    planned = msgspec.structs.replace(
        state, planned=True, has_changes=command.has_changes, needs_approval=needs
    )
    outcome = {**_next(planned), "require_approval": required, "approval_skipped": skipped}
    hard = po.hard_failures(command.policies)
    if not hard:
        return [_record(PlanFinished, command, now, **outcome)]
    finished = _record(PlanFinished, command, now, **{**outcome, "status": state.status})
    message = po.failure_message(hard)
    return [finished, _record(RunFailed, command, now, reason="policy_failed", message=message)]


AUTO_APPLY = "auto_apply_run_triggers"


def _auto_applies(state: RunState, command: FinishPlan) -> bool:
    """Whether the approval the run's settings ask for is skipped: the run was started
    by a run trigger and its workspace sets `auto_apply_run_triggers`. Never past
    `confirm_destructive` with something to delete or replace (a run trigger
    acknowledges no destroy), and a failed soft-mandatory policy still waits."""
    cause = state.cause
    if not command.require_approval or cause is None or cause.kind != "run_trigger":
        return False
    if not approval.setting(state.snapshot, AUTO_APPLY):
        return False
    return not approval.missing(state.snapshot, command.changes, ())


def _check_custom(state: RunState, command: FinishCustomStep) -> None:
    step = state.current_step
    _check_finish(state, command.lease_id, Status.RUNNING, "a custom step")
    if step is None or step.kind != "custom" or step.number != command.number:
        raise IllegalTransition(
            f"the run's current step is not custom step {command.number}",
            status=str(state.status),
        )


def _check_approval(
    state: RunState, action: approval.Action, actor: str, caller: approval.Caller | None
) -> None:
    """Who may approve or discard (events/approval.py), then the run's status: a caller
    the rule refuses hears why (Forbidden) whatever the run's status."""
    if not state.exists:
        raise NotFound("run does not exist")
    if caller is not None and caller.user != actor:
        raise Invalid(f"the caller {caller.user} is not the command's actor {actor}")
    approval.check_caller(action, caller, actor=actor, creator=state.created_by,
                          snapshot=state.snapshot)  # fmt: skip
    _require(state, {Status.AWAITING_APPROVAL}, action)


def _approve(state: RunState, command: ApproveRun, now: datetime) -> RunApproved:
    _check_approval(state, "approve", command.actor, command.caller)
    missing = approval.unacknowledged(state.snapshot, state.destructive, command.acknowledged)
    if missing:
        raise approval.Unacknowledged(missing, status=str(state.status))
    overridden = [r.name for r in po.soft_failures(state.policies)]
    acknowledged = list(command.acknowledged)
    return _record(RunApproved, command, now, acknowledged=acknowledged,
                   overridden=overridden, **_next(state))  # fmt: skip


def _check_fail(state: RunState, command: FailRun) -> None:
    if command.lease_id:
        _fence(state, command.lease_id)
    else:
        _require(state, set(Status) - TERMINAL, "fail")
