"""A run's template steps as shown in its `GET`: each with its status. Pure.

Derived from the run's state alone (`step_at`, status, what has run), so the read model
and a command's own result render the same thing. A step's status:

- `done`: it ran (a policy step runs with the plan; an approval step was approved);
- `skipped`: passed over: an approval nobody had to give (`require_approval` off and no
  soft-mandatory policy failed), an approval or apply after a plan with no changes, a
  custom step after that apply (unless it says `always`), or any step the run never
  reached because it ended first;
- `current`: the run is at it (waiting for an executor or a person, or running);
- `pending`: still to come;
- `failed`, `canceled`, `discarded`: the step the run ended at, and how (a policy step
  is the one that failed when a hard-mandatory policy failed the run).
"""

from __future__ import annotations

from typing import Any

from events import templates as te
from events.run import RunState, Status

_ENDED_AT = {
    Status.FAILED: "failed",
    Status.CANCELED: "canceled",
    Status.DISCARDED: "discarded",
}


def template_name(state: RunState) -> str:
    return state.template.name if state.template is not None else state.run_type


def statuses(state: RunState) -> list[str]:
    """The status of each of the run's steps, in order."""
    steps = state.steps
    at = state.step_at
    ended = _ENDED_AT.get(state.status, "") if state.status is not None else ""
    if ended and state.reason in ("policy_failed", "policy_limit_exceeded"):
        kinds = [s.kind for s in steps]
        at = kinds.index("policy") if "policy" in kinds else at
    out = []
    for i, s in enumerate(steps):
        if i < at:
            out.append(_passed(state, s))
        elif i == at and ended:
            out.append(ended)
        elif i == at and not state.terminal:
            out.append("current")
        else:
            out.append("skipped" if state.terminal else "pending")
    return out


def _passed(state: RunState, step: te.TemplateStep) -> str:
    """A step before the current one: it ran, or the run went past it."""
    if step.kind == "approval":
        return "done" if state.approved_by else "skipped"
    if step.kind in te.CHANGES:
        return "done" if state.apply_done else "skipped"
    if step.kind == "custom":
        return "done" if step.number in state.custom_done else "skipped"
    return "done"


def _step(step: te.TemplateStep, status: str) -> dict[str, Any]:
    return {
        "number": step.number,
        "kind": step.kind,
        "name": step.label,
        "command": step.command or None,
        "phase": te.phase_of(step) or None,
        "status": status,
    }


def view(state: RunState) -> dict[str, Any]:
    """`template` (its name), `steps` (each with its status) and `current_step`."""
    steps = state.steps
    shown = [_step(s, st) for s, st in zip(steps, statuses(state), strict=True)]
    current = next((s for s in shown if s["status"] == "current"), None)
    return {"template": template_name(state), "steps": shown, "current_step": current}
