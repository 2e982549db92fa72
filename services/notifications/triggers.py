"""Which notification triggers an event of a run fires, from the event and the run's
state folded through it. Pure.

This is the notification column of the reaction table (`events/react.py`, branch
`react`: its `Notify` actions); kept here until that table is merged, so that both give
the same answers (tests/test_notifications_triggers.py).
"""

from __future__ import annotations

from events.run import RunState
from events.run_events import (
    ApplyFinished,
    CustomStepFinished,
    PhaseStarted,
    PlanFinished,
    RunApproved,
    RunCanceled,
    RunCreated,
    RunDiscarded,
    RunEvent,
    RunFailed,
    RunQueued,
    Status,
)

_ENDINGS = {
    Status.APPLIED: "run:completed",
    Status.PLANNED: "run:completed",
    Status.NO_CHANGES: "run:completed",
    Status.DRIFTED: "run:drifted",
}
_POLICY_REASONS = ("policy_failed", "policy_limit_exceeded")


def fired(event: RunEvent, state: RunState) -> list[str]:
    """The triggers the event fires (most fire none)."""
    match event:
        case RunCreated():
            return ["run:created"]
        case PhaseStarted():
            if state.status == Status.PLANNING:
                return ["run:planning"]
            return ["run:applying"] if state.status == Status.APPLYING else []
        case RunDiscarded():
            return ["run:discarded"]
        case RunCanceled():
            return ["run:canceled"]
        case RunFailed():
            return ["run:policy_failed" if event.reason in _POLICY_REASONS else "run:errored"]
        case RunQueued() | PlanFinished() | RunApproved() | CustomStepFinished() | ApplyFinished():
            if state.status == Status.AWAITING_APPROVAL:
                return ["run:needs_attention"]
            ending = _ENDINGS.get(state.status) if state.status else None
            return [ending] if ending else []
        case _:
            return []
