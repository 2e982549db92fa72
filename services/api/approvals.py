"""The approval rule at the edge: who may approve or discard, and what they acknowledge.

The rule itself is pure (events/approval.py). Here it gets its inputs from the aggregates,
never the read model, so it is never stale: the organization's groups, the plan's changes
(from the run's `run.plan_finished`) and, through `App.run_command`'s guard, the very run
state the command is decided on, with the settings it recorded at admission.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from events import approval
from events.codec import run_subject
from events.run import PlanFinished, ResourceChange, RunState, Status
from services.api.auth import Principal
from services.api.context import Api
from services.api.problems import Problem


async def _plan_changes(api: Api, org: str, run_id: str) -> list[ResourceChange] | None:
    """The changes of the run's finished plan; None before it has one."""
    envs = await api.app.store.read(run_subject(org, "*", run_id))
    plans = [e.event for e in envs if isinstance(e.event, PlanFinished)]
    return list(plans[-1].changes) if plans else None


async def guard(
    api: Api,
    org: str,
    run_id: str,
    who: Principal,
    action: approval.Action,
    acknowledged: Sequence[str] = (),
) -> Callable[[RunState], None]:
    """A guard for `App.run_command`: 403 (the reason given) unless `who` may act on the
    run; for an approval under `confirm_destructive`, 409 listing what is not acknowledged.
    """
    groups = (await api.app.load_org(org)).state.groups
    changes = await _plan_changes(api, org, run_id) if action == "approve" else None
    caller = approval.Caller(user=who.user, role=who.role, superuser=who.superuser)

    def check(run: RunState) -> None:
        approval.check(action, caller, creator=run.created_by, snapshot=run.snapshot, groups=groups)
        if action != "approve" or run.status != Status.AWAITING_APPROVAL:
            return  # the core refuses a run in any other status
        if changes is None:  # the plan finished after we read the run's events
            raise Problem("unavailable", "the run's plan is being recorded; try again")
        missing = approval.missing(run.snapshot, changes, acknowledged)
        if missing:
            raise Problem(
                "conflict",
                "confirm_destructive is on: acknowledge every address the plan deletes "
                f"or replaces; missing: {', '.join(missing)}",
                current_status=str(run.status),
                missing=missing,
            )

    return check
