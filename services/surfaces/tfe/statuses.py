"""A runplane run's statuses as the TFE API names them, and when a run is cancelable.

Statuses map as:

| runplane | TFE run | plan | apply |
|---|---|---|---|
| pending | pending | pending | pending |
| queued (plan) | plan_queued | queued | pending |
| planning | planning | running | pending |
| awaiting_approval | planned / policy_checked | finished | pending |
| apply_queued | apply_queued | finished | queued |
| applying | applying | finished | running |
| applied | applied | finished | finished |
| planned, no_changes, drifted | planned_and_finished | finished | unreachable |
| discarded | discarded | finished | unreachable |
| failed | errored | errored (finished if planned) | errored / unreachable |
| canceled | canceled | canceled | canceled / unreachable |

Ctrl-C (Terraform 1.0.3's remote backend, and the `cloud` block's): the CLI stops
following its run, reads it and, when `actions.is-cancelable`, asks "Do you want to
cancel the remote operation?" (not with -auto-approve) and POSTs the cancel action.
`is-cancelable` is exactly when that cancel is taken (`cancelable`, the core's own
rule): a waiting run (pending, queued, apply_queued) is canceled at once, a planning
one (or a custom step before the apply) is asked to stop and its executor interrupts
Terraform; an applying run is not cancelable, as runplane never interrupts an apply
(the CLI says as much in its header: "If the apply started it will stop streaming the
logs, but will not stop the apply running remotely"). `is-force-cancelable` once a stop
was asked and the executor has not stopped yet.
"""

from __future__ import annotations

from typing import assert_never

from events.run import CANCELABLE, STOPPABLE, SUCCEEDED, TERMINAL, RunState, Status

ENDED = SUCCEEDED
STOPPED = TERMINAL - SUCCEEDED


# ---------------------------------------------------------------- statuses


def run_status(s: RunState) -> str:
    match s.status:
        case Status.PENDING | None:  # None: not created (a read model row always is)
            return "pending"
        case Status.QUEUED:
            return "apply_queued" if s.planned else "plan_queued"
        case Status.PLANNING:
            return "planning"
        case Status.RUNNING:
            return "applying" if s.planned else "planning"
        case Status.AWAITING_APPROVAL:
            return "policy_checked" if s.policies else "planned"
        case Status.APPLY_QUEUED:
            return "apply_queued"
        case Status.APPLYING:
            return "applying"
        case Status.APPLIED:
            return "applied"
        case Status.PLANNED | Status.NO_CHANGES | Status.DRIFTED:
            return "planned_and_finished"
        case Status.DISCARDED:
            return "discarded"
        case Status.FAILED:
            return "errored"
        case Status.CANCELED:
            return "canceled"
        case _:  # a status added to the core is named here first (mypy --strict says so)
            assert_never(s.status)


def plan_status(s: RunState) -> str:
    if s.planned:
        return "finished"
    match s.status:
        case Status.PENDING:
            return "pending"
        case Status.QUEUED:
            return "queued"
        case Status.PLANNING | Status.RUNNING:
            return "running"
        case Status.FAILED:
            return "errored"
        case Status.CANCELED | Status.DISCARDED:
            return "canceled"
    return "unreachable" if s.status in ENDED else "pending"


def apply_status(s: RunState) -> str:
    match s.status:
        case Status.APPLY_QUEUED:
            return "queued"
        case Status.APPLYING:
            return "running"
        case Status.APPLIED:
            return "finished"
        case Status.FAILED if s.phase == "apply" or s.apply_done or _applying_failed(s):
            return "errored"
        case Status.CANCELED if s.approved_by:
            return "canceled"
    return "unreachable" if s.terminal else "pending"


def cancelable(s: RunState) -> bool:
    """Whether a cancel is taken now (events/run_decide.py `_cancel`): a waiting run is
    canceled, a planning one (or a custom step before the apply) asked to stop, again
    (nothing more recorded) while it stops; never an apply, nor what runs after it."""
    if s.status in CANCELABLE:
        return True
    return s.status in STOPPABLE and not s.apply_done


def force_cancelable(s: RunState) -> bool:
    """A stop was asked and the executor is still stopping the phase."""
    return cancelable(s) and s.status in STOPPABLE and bool(s.stop_requested_by)


def not_cancelable(s: RunState) -> str:
    """Why a cancel is refused, as the CLI prints it (`errors[].detail`)."""
    if s.status == Status.APPLYING or (s.apply_done and not s.terminal):
        return (
            "the run is applying: runplane never interrupts an apply (it could leave the "
            "state half written); it runs to its end"
        )
    if s.status == Status.AWAITING_APPROVAL:
        return "the run waits for an approval: discard it instead"
    return f"the run is {s.status}: nothing to cancel"


def _applying_failed(s: RunState) -> bool:
    return bool(s.approved_by) and s.planned and s.has_changes


def is_final_plan(s: RunState) -> bool:
    return plan_status(s) in ("finished", "errored", "canceled", "unreachable")


def is_final_apply(s: RunState) -> bool:
    return apply_status(s) in ("finished", "errored", "canceled", "unreachable")
