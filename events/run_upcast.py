"""The upcaster of run events recorded before they carried their outcome. Pure.

Since the events that move a run carry the status they lead to (`status`, `step_at`),
`evolve` copies it. Older events have `None` there: `upcast` gives them the outcome the
code of their day derived (the `advance` of that code, frozen below as `_v1`), so an old
stream replays to exactly what it did when it was written, whatever `decide` comes to
decide for new runs. Never change the `_v1` functions: they are a record, not a rule.

The derivation needs the run as it stands when the event comes (its steps, what its
plan found), which no single message has; so the upcaster runs where events are folded
(`events.run.evolve`), once per old event, on the state with the event's own facts
applied. Events with their outcome pass through untouched.
"""

from __future__ import annotations

import msgspec

from events.run_events import (
    ApplyFinished,
    CustomStepFinished,
    PhaseStarted,
    PlanFinished,
    RunApproved,
    RunEvent,
    RunQueued,
    Status,
)
from events.run_state import RunState

Advancing = RunQueued | PlanFinished | RunApproved | ApplyFinished | CustomStepFinished


def upcast(state: RunState, event: RunEvent) -> RunEvent:
    """`event` with its outcome; `state` is the run with the event's facts applied."""
    match event:
        case PhaseStarted(status=None):
            return msgspec.structs.replace(event, status=_running_v1(event.phase))
        case RunQueued(status=None):
            return _with(event, *_advance_v1(state, 0))
        case (
            PlanFinished(status=None)
            | RunApproved(status=None)
            | ApplyFinished(status=None)
            | CustomStepFinished(status=None)
        ):
            return _with(event, *_advance_v1(state, state.step_at + 1))
        case _:
            return event


def _with(event: Advancing, status: Status, step_at: int) -> Advancing:
    return msgspec.structs.replace(event, status=status, step_at=step_at)


# ---------------------------------------------------------------- frozen: the code of 2026-12


_RUNNING_V1 = {"plan": Status.PLANNING, "apply": Status.APPLYING}
_CHANGES_V1 = ("apply", "destroy")


def _running_v1(phase: str) -> Status:
    return _RUNNING_V1.get(phase, Status.RUNNING)


def _final_v1(state: RunState) -> Status:
    if state.planned and not state.has_changes:
        return Status.NO_CHANGES
    if state.run_type == "plan":
        return Status.PLANNED
    if state.run_type == "drift":
        return Status.DRIFTED
    return Status.APPLIED


def _advance_v1(state: RunState, start: int) -> tuple[Status, int]:
    steps = state.steps
    nothing = state.planned and not state.has_changes
    for i in range(max(start, 0), len(steps)):
        kind = steps[i].kind
        if kind in ("plan", "custom"):
            return Status.QUEUED, i
        if kind == "approval" and state.needs_approval and not nothing:
            return Status.AWAITING_APPROVAL, i
        if kind in _CHANGES_V1 and not nothing:
            return Status.APPLY_QUEUED, i
    return _final_v1(state), len(steps)
