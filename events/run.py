"""The run aggregate: one execution of a run type against a workspace.

`decide(state, command, *, now, new_id)` returns the events a command produces (or raises a
DomainError); `evolve(state, event)` folds one event into the state. Both are pure.

The aggregate lives in a few modules, all imported from here: its vocabulary and events
(`run_events`), commands (`run_commands`), state and where its steps lead
(`run_state`), `decide` (`run_decide`) and the upcaster of events recorded before they
carried their outcome (`run_upcast`). This module folds: an event that moves the run
carries the status it leads to, and `evolve` copies it, deciding nothing, so a change to
`decide` never re-statuses a recorded run (tests/test_golden.py replays recorded ones).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import assert_never

import msgspec

from events import policies as po
from events.approval import destructive
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
from events.run_decide import decide
from events.run_events import (
    CANCELABLE,
    RUN_TYPES,
    RUNNING_STATUS,
    STOPPABLE,
    SUCCEEDED,
    TERMINAL,
    WAITING,
    ApplyFinished,
    CustomStepFinished,
    LogPruned,
    PhaseReleased,
    PhaseStarted,
    PlanFinished,
    PrunedObject,
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
from events.run_state import INITIAL, RunState, advance, final_status, secret_names
from events.run_upcast import upcast
from events.values import (
    CAUSE_KINDS,
    AttributeChange,
    Cause,
    ConfigSource,
    PlanSummary,
    ResourceChange,
    RunOptions,
    Snapshot,
    VariableRef,
    Workspace,
    pinned_config,
)

_replace = msgspec.structs.replace


def evolve(state: RunState, event: RunEvent) -> RunState:
    """Fold one event into the run state: its facts, then the status it carries (for an
    event recorded before it carried one, the status its day derived: `upcast`)."""
    if isinstance(event, LogPruned):  # a record about the run, not a move of it
        return _replace(state, version=state.version + 1, log_removed_at=event.at)
    if isinstance(event, RunRemoved):  # as is this one
        return _replace(state, version=state.version + 1, removed_at=event.at)
    return _ended(state, _moved(state, event), event)


def _moved(state: RunState, event: RunEvent) -> RunState:
    s = _facts(_replace(state, version=state.version + 1, updated_at=event.at), event)
    moved = upcast(s, event)
    match moved:
        case PhaseStarted(status=status) if status is not None:
            return _replace(s, status=status)
        case (
            RunQueued(status=status, step_at=at)
            | PhaseReleased(status=status, step_at=at)
            | PlanFinished(status=status, step_at=at)
            | RunApproved(status=status, step_at=at)
            | ApplyFinished(status=status, step_at=at)
            | CustomStepFinished(status=status, step_at=at)
        ) if status is not None and at is not None:
            return _replace(s, status=status, step_at=at)
        case _:
            return s


def _ended(before: RunState, after: RunState, event: RunEvent) -> RunState:
    """The moment a run reaches a terminal status is kept (retention counts from it)."""
    if after.terminal and not before.terminal:
        return _replace(after, ended_at=event.at)
    return after


def _facts(s: RunState, event: RunEvent) -> RunState:
    """What the event records, its outcome aside (an ending's tag is its status)."""
    match event:
        case RunCreated():
            return _created(s, event)
        case RunQueued():
            return _snapshot(_replace(s, phase="", pinning=event.pinning), event.snapshot)
        case RunPinned():
            return _replace(_snapshot(s, event.snapshot), pinning=False)
        case PhaseStarted():
            return _replace(
                s,
                phase=event.phase,
                lease_id=event.lease_id,
                executor_id=event.executor_id,
                phase_step="",
            )
        case PhaseReleased():
            return _replace(
                s, phase="", lease_id="", executor_id="", phase_step="", released=event.attempt
            )
        case StepStarted():
            return _replace(s, phase_step=event.step)
        case StepFinished() | ResourceStateChanged() | StateVersionCreated():
            return s
        case PlanFinished():
            return _planned(s, event)
        case RunApproved():
            acknowledged, overridden = list(event.acknowledged), list(event.overridden)
            return _replace(
                s, approved_by=event.actor, acknowledged=acknowledged, overridden=overridden
            )
        case ApplyFinished():
            return _replace(s, phase="", lease_id="", apply_summary=event.summary, apply_done=True)
        case CustomStepFinished():
            done = [*s.custom_done, event.number]
            return _replace(s, phase="", lease_id="", custom_done=done)
        case RunDiscarded():
            return _replace(s, status=Status.DISCARDED, reason=event.reason)
        case RunCanceled():
            return _replace(s, status=Status.CANCELED, reason=event.reason, lease_id="")
        case RunStopRequested():
            return _replace(s, stop_requested_by=event.actor, stop_reason=event.reason)
        case RunLimitExceeded():
            return _replace(s, limit_exceeded=event.limit)
        case LogPruned():
            return _replace(s, log_removed_at=event.at)  # (evolve folds it before)
        case RunRemoved():
            return _replace(s, removed_at=event.at)  # (evolve folds it before)
        case RunFailed():
            return _replace(
                s,
                status=Status.FAILED,
                reason=event.reason,
                error_message=event.message,
                lease_id="",
            )
        case _:
            assert_never(event)


def _created(s: RunState, event: RunCreated) -> RunState:
    return _replace(
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
        cause=event.cause,
        requested_commit=event.commit,
        source=event.source,
        options=event.options,
    )


def _snapshot(s: RunState, snap: Snapshot | None) -> RunState:
    """The run pinned to its snapshot: what it plans and applies, whatever moves later."""
    commit = snap.commit if snap and snap.commit else s.commit
    return _replace(s, snapshot=snap, config=pinned_config(s.config, snap), commit=commit)


def _planned(s: RunState, event: PlanFinished) -> RunState:
    return _replace(
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
        destructive=destructive(event.changes),
    )


def fold(events: Sequence[RunEvent], state: RunState = INITIAL) -> RunState:
    for e in events:
        state = evolve(state, e)
    return state


__all__ = [
    "CANCELABLE",
    "CAUSE_KINDS",
    "INITIAL",
    "RUNNING_STATUS",
    "RUN_TYPES",
    "STOPPABLE",
    "SUCCEEDED",
    "TERMINAL",
    "WAITING",
    "AdmitRun",
    "ApplyFinished",
    "ApproveRun",
    "AttributeChange",
    "CancelRun",
    "Cause",
    "ClaimPhase",
    "ConfigSource",
    "CreateRun",
    "CustomStepFinished",
    "DiscardRun",
    "ExceedLimit",
    "FailRun",
    "FinishApply",
    "FinishCustomStep",
    "FinishPlan",
    "FinishStep",
    "LogPruned",
    "PhaseReleased",
    "PhaseStarted",
    "PinRun",
    "PlanFinished",
    "PlanSummary",
    "PruneLog",
    "PrunedObject",
    "RecordStateVersion",
    "RecoverStateVersion",
    "ReleasePhase",
    "RemoveRun",
    "ReportResource",
    "ResourceChange",
    "ResourceStateChanged",
    "RunApproved",
    "RunCanceled",
    "RunCommand",
    "RunCreated",
    "RunDiscarded",
    "RunEvent",
    "RunFailed",
    "RunLimitExceeded",
    "RunOptions",
    "RunPinned",
    "RunQueued",
    "RunRemoved",
    "RunState",
    "RunStopRequested",
    "Snapshot",
    "StartStep",
    "StateVersionCreated",
    "Status",
    "StepFinished",
    "StepStarted",
    "VariableRef",
    "Workspace",
    "advance",
    "decide",
    "evolve",
    "final_status",
    "fold",
    "running_status",
    "secret_names",
]
