"""The UI's forms: approve, discard, cancel a run; start a run, lock and unlock a
workspace, roll its state back. Each goes through the very calls the API's handlers
make (approve and discard through services/surfaces/api/approvals.py, with the caller
resolved and the core's rule applied by `decide`), so the UI can do nothing the API
would refuse. A refusal is shown on the page it came from, with the server's status
(409 for confirm_destructive's missing addresses, 403 for the approvers rule)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from events.errors import DomainError
from events.run import CancelRun, Cause, RunState
from services.app.execute import Result
from services.surfaces.api import approvals, audit
from services.surfaces.api.problems import Problem, from_domain
from services.surfaces.api.rollback import roll_back
from services.surfaces.api.runs import PLAN_ONLY, run_action
from services.surfaces.ui import pages
from services.surfaces.ui.pages import RUN_TYPES
from services.surfaces.ui.web import FORM, Visit, base, form, render, see_other

MAX_REASON = 1024


def _text(visit: Visit, name: str, *, required: bool = False, limit: int = MAX_REASON) -> str:
    value = visit.request[FORM].get(name, "").strip()
    if required and not value:
        raise Problem("invalid-body", f"{name} is required")
    if len(value) > limit:
        raise Problem("invalid-body", f"{name} is at most {limit} characters")
    return value


async def _run_or_404(visit: Visit) -> dict[str, object]:
    run_id = visit.path_id("run")
    run = await visit.api.read.runs.get(visit.org, run_id)
    if run is None:
        raise Problem("not-found", f"run {run_id} not found")
    return run


async def _refused(visit: Visit, run_id: str, p: Problem) -> web.Response:
    """The run page again, with the server's refusal and its status (on the audit
    record when it matters, as the API's are)."""
    await audit.record_refusal(visit.request, p)
    run = await visit.api.read.runs.get(visit.org, run_id)
    if run is None:
        raise p
    context = await base(visit, **await pages.run_context(visit, run))
    context["message"] = p.detail
    context["message_status"] = p.status
    return render(visit.request, "run.html", context, status=p.status)


async def _on_run(
    visit: Visit, act: Callable[[str], Awaitable[Result[RunState]]]
) -> web.StreamResponse:
    """`act` on the organization's run of the path; a refusal is shown on its page."""
    run = await _run_or_404(visit)
    run_id = str(run["id"])
    try:
        result = await act(run_id)
    except Problem as p:
        return await _refused(visit, run_id, p)
    except DomainError as e:
        return await _refused(visit, run_id, from_domain(e))
    await visit.api.after_write(result.seq)
    return see_other(f"/orgs/{visit.org}/runs/{run_id}")


@form("run.approve")
async def approve(visit: Visit) -> web.StreamResponse:
    """Approve with the ticked addresses as `acknowledged`."""
    acked = [a for a in visit.request[FORM].getall("ack", []) if isinstance(a, str)]
    api, org, who = visit.api, visit.org, visit.who
    return await _on_run(visit, lambda run_id: approvals.approve(api, org, run_id, who, acked))


@form("run.approve")
async def discard(visit: Visit) -> web.StreamResponse:
    reason = _text(visit, "reason")
    api, org, who = visit.api, visit.org, visit.who
    return await _on_run(visit, lambda run_id: approvals.discard(api, org, run_id, who, reason))


@form("run.cancel_plan")
async def cancel(visit: Visit) -> web.StreamResponse:
    """Cancel: a plan-only run by whoever may plan, any other by write."""
    run = await _run_or_404(visit)
    if run["type"] not in PLAN_ONLY:
        visit.require("run.cancel")
    reason = _text(visit, "reason")
    command = CancelRun(actor=visit.who.user, reason=reason)
    app, org = visit.api.app, visit.org
    return await _on_run(visit, lambda run_id: app.run_command(org, None, run_id, command))


async def _workspace_or_404(visit: Visit) -> str:
    ws = visit.path_id("ws")
    if await visit.api.read.workspaces.get(visit.org, ws) is None:
        raise Problem("not-found", f"workspace {ws} not found")
    return ws


@form("run.plan")
async def start_run(visit: Visit) -> web.StreamResponse:
    """Start a run: a plan or drift run at plan, an apply or destroy at write."""
    ws = await _workspace_or_404(visit)
    run_type = _text(visit, "type", required=True)
    if run_type not in RUN_TYPES:
        raise Problem("invalid-body", f"type must be one of {', '.join(RUN_TYPES)}")
    visit.require(run_action(run_type))
    message = _text(visit, "message", limit=4096)
    template = _text(visit, "template", limit=63)
    result = await visit.api.app.create_run(
        visit.org,
        ws,
        run_type,
        visit.who.user,
        message,
        template=template,
        cause=Cause(kind="ui", user=visit.who.user),
    )
    await visit.api.after_write(result.seq)
    return see_other(f"/orgs/{visit.org}/runs/{result.state.run_id}")


@form("workspace.lock")
async def lock(visit: Visit) -> web.StreamResponse:
    ws = await _workspace_or_404(visit)
    reason = _text(visit, "reason", required=True)
    result = await visit.api.app.lock_workspace(visit.org, ws, reason, visit.who.user)
    await visit.api.after_write(result.seq)
    return see_other(f"/orgs/{visit.org}/workspaces/{ws}")


@form("workspace.lock")
async def unlock(visit: Visit) -> web.StreamResponse:
    ws = await _workspace_or_404(visit)
    admin = visit.can("workspace.force_unlock")
    result = await visit.api.app.unlock_workspace(visit.org, ws, visit.who.user, admin=admin)
    await visit.api.after_write(result.seq)
    return see_other(f"/orgs/{visit.org}/workspaces/{ws}")


@form("state.rollback")
async def rollback(visit: Visit) -> web.StreamResponse:
    """Roll the state back to a listed version (services/surfaces/api/rollback.py): the
    form's `confirm` box ticked, with a reason; the caller holds the workspace's lock."""
    ws = await _workspace_or_404(visit)
    if visit.request[FORM].get("confirm") != "yes":
        raise Problem("invalid-body", "tick the box to confirm the rollback")
    version = _text(visit, "version", required=True, limit=200)
    reason = _text(visit, "reason", required=True)
    await roll_back(visit.request, visit.api, visit.org, ws, visit.who, version, reason)
    return see_other(f"/orgs/{visit.org}/workspaces/{ws}")
