"""Approve and discard through the API: the caller resolved, the core's rule applied.

The rule is the core's (events/approval.py, applied by the run aggregate's `decide`), so
the API, a chat bot and every other writer get the same answers. Here the shell only
says who asks: the token's user and role, and the groups of the organization the user
is a member of (read from the organization aggregate, never the read model, so never
stale), and where the command came from (`via`). A refusal is the core's error, which
the problems middleware answers (403 forbidden, 409 conflict); confirm_destructive's
refusal also lists the addresses still to acknowledge (`missing`).
"""

from __future__ import annotations

from collections.abc import Sequence

from events import approval
from events.run import ApproveRun, DiscardRun, RunState
from events.teams import LEVELS
from services.app.execute import Result
from services.surfaces.api.auth import Principal
from services.surfaces.api.common import run_workspace, workspace_target
from services.surfaces.api.context import Api
from services.surfaces.api.problems import Problem

VIA = "api"


async def caller(api: Api, org: str, who: Principal, run_id: str) -> approval.Caller:
    """Who asks: the organization's groups they are a member of, their teams, and their
    level on the run's workspace (events/access.py)."""
    groups = (await api.app.load_org(org)).state.groups
    member_of = approval.groups_of(who.user, groups)
    target = await workspace_target(api, org, await run_workspace(api, org, run_id))
    return approval.Caller(
        user=who.user,
        role=who.role,
        superuser=who.superuser,
        groups=member_of,
        teams=list(who.access.teams),
        level=LEVELS[who.access.level_on(target)],
    )


async def approve(
    api: Api, org: str, run_id: str, who: Principal, acknowledged: Sequence[str]
) -> Result[RunState]:
    """Approve the run as `who`, acknowledging `acknowledged`."""
    command = ApproveRun(
        actor=who.user,
        acknowledged=list(acknowledged),
        caller=await caller(api, org, who, run_id),
        via=VIA,
    )
    try:
        return await api.app.run_command(org, None, run_id, command)
    except approval.Unacknowledged as e:
        raise Problem("conflict", str(e), current_status=e.status, missing=e.missing) from e


async def discard(api: Api, org: str, run_id: str, who: Principal, reason: str) -> Result[RunState]:
    """Discard the run as `who`."""
    command = DiscardRun(
        actor=who.user, reason=reason, caller=await caller(api, org, who, run_id), via=VIA
    )
    return await api.app.run_command(org, None, run_id, command)
