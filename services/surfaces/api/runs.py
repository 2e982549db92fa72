"""Handlers for runs: create, read, list, approve, discard, cancel, audit history, steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from events import access
from events.run import TERMINAL, CancelRun, Cause, RunCommand, RunState, Status
from projections.working import iso
from services.app.execute import Result
from services.surfaces.api import approvals, asof, render
from services.surfaces.api.auth import Principal
from services.surfaces.api.bodies import (
    ApproveBody,
    Body,
    CancelBody,
    CreateRunBody,
    DiscardBody,
    check_name,
    read_body,
)
from services.surfaces.api.common import (
    Row,
    items,
    json_response,
    may_read,
    path_id,
    require_on,
    scope,
    written,
)
from services.surfaces.api.context import Api
from services.surfaces.api.paths import ORG, RUN, WS
from services.surfaces.api.problems import Problem, run_removed
from services.surfaces.api.removed import missing_run

PREFIX = "/api/v1"
DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
_STATUSES = frozenset(s.value for s in Status)
_OWNED = frozenset({"planning", "applying", "running"})  # a phase runs: it has an owner
_LIST_PARAMS = frozenset({"status", "workspace", "limit", "before", "fields", asof.AS_OF})
FIELDS = ("full", "summary")  # a list's `fields=`: as GET shows each run, or the summary
CLIENT_HEADER = "X-Runplane-Client"  # `cli` from runplane's own command line


async def _existing_run(api: Api, org: str, run_id: str) -> Row:
    row = await api.read.runs.get(org, run_id)
    if row is None:
        raise await missing_run(api, org, run_id)
    return row


async def _answer(api: Api, org: str, result: Result[RunState], *, status: int) -> web.Response:
    """Answer a command on a run with the run as projected once it holds the write."""
    run_id = result.state.run_id
    return await written(
        api,
        result.seq,
        lambda: _live_run(api, org, run_id, answer=True),
        lambda: render.run(result.state, result.seq),
        status=status,
        location=f"{PREFIX}/orgs/{org}/runs/{run_id}" if status == 201 else "",
    )


PLAN_ONLY, run_action = access.PLAN_ONLY, access.run_action


async def create_run(request: web.Request) -> web.Response:
    await scope(request, "workspace.read")  # another organization's, or hidden: 404 first
    body = await read_body(request, CreateRunBody)
    api, org, who = await scope(request, run_action(body.type))
    ws = path_id(request, "ws")
    # A client's claim, between api and cli only: never a way to claim a webhook's cause.
    kind = "cli" if request.headers.get(CLIENT_HEADER, "").strip().lower() == "cli" else "api"
    result = await api.app.create_run(
        org,
        ws,
        body.type,
        who.user,
        body.message,
        template=body.template,
        cause=Cause(kind=kind, user=who.user),
    )
    return await _answer(api, org, result, status=201)


async def get_run(request: web.Request) -> web.Response:
    """The run, with its live `owner` or its `deadline` (projections/liveness.py)."""
    api, org, _ = await scope(request, "workspace.read")
    run_id = path_id(request, "run")
    if asof.asked(request):  # the run as answered then (services/surfaces/api/asof.py)
        return await asof.run(request, org, run_id)
    row = await _live_run(api, org, run_id)
    if row is None:
        raise await missing_run(api, org, run_id)
    return json_response(row)


async def _live_run(api: Api, org: str, run_id: str, *, answer: bool = False) -> Row | None:
    """The projected run with its `owner` and `deadline`, read with its row from this
    replica's read model (the heartbeat board folded, projections/board.py): one read,
    no question to NATS. What already reached this process is in it (`Projector.settle`,
    bounded): the board writes and purges it made and, unless this is a command's
    `answer` (read at or past its write, as before), the events its projector received."""
    await api.projector.settle(api.settle_wait, events=not answer)
    row = await api.read.runs.get(org, run_id, live=True)
    if row is None or _ended(row):
        return row  # (an ended run has neither owner nor deadline)
    return await liveness(api, row)


async def liveness(api: Api, row: Row) -> Row:
    """An open run as answered, with the `owner` and `deadline` read with it.

    The board's fold may be ahead of the events' (a phase that just ended is purged from
    the board at once, and this replica's projection of the run's events may be behind):
    a row that shows a phase running with neither owner nor deadline (an orphan, it seems)
    is read again once what this projector has already received is committed."""
    orphan = row["owner"] is None and row["deadline"] is None and row["status"] in _OWNED
    if orphan and api.projector.received_seq > api.projector.seq:
        if await api.projector.caught_up(api.read_wait):
            row = await api.read.runs.get(row["org"], row["id"], live=True) or row
    return row


def _ended(row: Row) -> bool:
    return row["status"] in {str(s) for s in TERMINAL}


# ------------------------------------------------------------ listing


def _statuses(raw: str) -> list[str]:
    wanted = [s.strip() for s in raw.split(",") if s.strip()]
    unknown = sorted(set(wanted) - _STATUSES)
    if unknown:
        raise Problem("invalid-query", f"unknown status {', '.join(unknown)}")
    return wanted


def _limit(raw: str) -> int:
    # isascii: "²".isdigit() is true, but int("²") raises.
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= MAX_LIMIT:
        raise Problem("invalid-query", f"limit must be an integer from 1 to {MAX_LIMIT}")
    return int(raw)


def _filters(request: web.Request) -> dict[str, Any]:
    """The list filters of the query string; unknown parameters are refused."""
    query = request.query
    unknown = sorted(set(query) - _LIST_PARAMS)
    if unknown:
        raise Problem("invalid-query", f"unknown query parameter {', '.join(unknown)}")
    filters: dict[str, Any] = {"limit": _limit(query.get("limit", str(DEFAULT_LIMIT)))}
    if "status" in query:
        filters["status"] = _statuses(query["status"])
    if "workspace" in query:
        filters["workspace"] = check_name("workspace", query["workspace"])
    if "before" in query:
        filters["before"] = check_name("before", query["before"])
    fields = query.get("fields", "full")
    if fields not in FIELDS:
        raise Problem("invalid-query", f"fields must be one of {', '.join(FIELDS)}")
    filters["full"] = fields == "full"
    return filters


async def _list(
    api: Api, org: str, filters: dict[str, Any], *, readable: set[str] | None = None
) -> web.Response:
    """Newest first; a full page carries `next`, the `before` of the following page."""
    await api.projector.settle(api.settle_wait)
    # each run as GET shows it (`full`), with its owner and deadline read with it
    rows = await api.read.runs.find(org, **filters, live=True)
    page_full = len(rows) == filters["limit"]
    after = rows[-1]["id"] if page_full and rows else None
    if readable is not None:
        rows = [r for r in rows if r["workspace"] in readable]
    return items(rows, next=after)


async def readable(api: Api, who: Principal, org: str) -> set[str]:
    """The names of the organization's workspaces the caller may read."""
    folders = await api.read.workspaces.folders(org)
    return {ws for ws, folder in folders.items() if may_read(who, org, ws, folder)}


async def list_runs(request: web.Request) -> web.Response:
    """The organization's runs: those of the workspaces the caller may read (a page of a
    caller who reads only some may hold fewer than `limit`; `next` still leads on)."""
    api, org, who = await scope(request, "org.read")
    filters = _filters(request)
    if await api.read.orgs.get(org) is None:
        raise Problem("not-found", f"organization {org} not found")
    if "workspace" in filters:
        await require_on(api, who, org, "workspace.read", filters["workspace"])
    if asof.asked(request):  # whom the caller may read: today's rule, as below
        mine = None if who.access.uniform(access.READ) else await readable(api, who, org)
        return await asof.runs(request, org, filters, mine)
    if who.access.uniform(access.READ):
        return await _list(api, org, filters)
    return await _list(api, org, filters, readable=await readable(api, who, org))


async def list_workspace_runs(request: web.Request) -> web.Response:
    api, org, _ = await scope(request, "workspace.read")
    ws = path_id(request, "ws")
    filters = _filters(request)
    if "workspace" in filters:
        raise Problem("invalid-query", "the workspace is given by the path")
    if asof.asked(request):
        return await asof.runs(request, org, {**filters, "workspace": ws}, None)
    if await api.read.workspaces.get(org, ws) is None:
        raise Problem("not-found", f"workspace {ws} not found")
    return await _list(api, org, {**filters, "workspace": ws})


# ------------------------------------------------------------ commands on a run


async def _command(
    request: web.Request,
    action: str,
    kind: type[Body],
    make: Callable[[Principal, Any], RunCommand],
) -> web.Response:
    api, org, who = await scope(request, action)
    run_id = path_id(request, "run")
    body = await read_body(request, kind, optional=True)
    result = await api.app.run_command(org, None, run_id, make(who, body))
    return await _answer(api, org, result, status=200)


async def approve_run(request: web.Request) -> web.Response:
    """Approve: the approval rule (events/approval.py) decides who, on the run's own
    recorded settings; operators pass the role check so that approvers may name them."""
    api, org, who = await scope(request, "run.approve")
    run_id = path_id(request, "run")
    body = await read_body(request, ApproveBody, optional=True)
    result = await approvals.approve(api, org, run_id, who, body.acknowledged)
    return await _answer(api, org, result, status=200)


async def discard_run(request: web.Request) -> web.Response:
    """Discard: the same approvers rule as approve (four-eyes aside)."""
    api, org, who = await scope(request, "run.approve")
    run_id = path_id(request, "run")
    body = await read_body(request, DiscardBody, optional=True)
    result = await approvals.discard(api, org, run_id, who, body.reason)
    return await _answer(api, org, result, status=200)


async def cancel_run(request: web.Request) -> web.Response:
    """Cancel: a plan-only run needs plan on its workspace, any other write."""
    api, org, _ = await scope(request, "run.cancel_plan")
    run: RunState = (await api.app.load_run(org, None, path_id(request, "run"))).state
    action = "run.cancel_plan" if run.exists and run.run_type in PLAN_ONLY else "run.cancel"
    return await _command(
        request,
        action,
        CancelBody,
        lambda who, body: CancelRun(actor=who.user, reason=body.reason),
    )


class RerunBody(Body, frozen=True, kw_only=True):
    """No fields: a rerun repeats the run's type and template (its body may be empty)."""


async def rerun(request: web.Request) -> web.Response:
    """POST .../runs/{run}/rerun: a new run of the ended run's type and template, on its
    workspace's current commit and settings, caused by it (`rerun_of`); the old run is
    not touched. 409 while the run is not over; 409 if its workspace was deleted."""
    api, org, who = await scope(request, "workspace.read")
    run_id = path_id(request, "run")
    await read_body(request, RerunBody, optional=True)
    old: RunState = (await api.app.load_run(org, None, run_id)).state
    if not old.exists:
        raise await missing_run(api, org, run_id)
    if old.removed_at is not None:
        raise run_removed(run_id, iso(old.removed_at))
    await require_on(api, who, org, run_action(old.run_type), old.workspace)
    if not old.terminal:
        raise Problem(
            "conflict",
            f"run {run_id} is {old.status}: only a run that has ended can be rerun",
            current_status=str(old.status),
        )
    if not (await api.app.load_ws(org, old.workspace)).state.exists:
        raise Problem("not-found", f"workspace {old.workspace} of run {run_id} no longer exists")
    result = await api.app.create_run(
        org,
        old.workspace,
        old.run_type,
        who.user,
        f"rerun of {run_id}",
        template=old.template.name if old.template is not None else "",
        cause=Cause(kind="rerun", rerun_of=run_id, user=who.user),
        speculative=True if old.speculative else None,
    )
    return await _answer(api, org, result, status=201)


# ------------------------------------------------------------ history


async def run_events(request: web.Request) -> web.Response:
    api, org, _ = await scope(request, "workspace.read")
    run_id = path_id(request, "run")
    await _existing_run(api, org, run_id)
    return items(await api.read.runs.events(org, run_id))


async def run_steps(request: web.Request) -> web.Response:
    api, org, _ = await scope(request, "workspace.read")
    run_id = path_id(request, "run")
    await _existing_run(api, org, run_id)
    return items(await api.read.runs.steps(org, run_id))


ROUTES = [
    web.get(WS + "/runs", list_workspace_runs, allow_head=False),
    web.post(WS + "/runs", create_run),
    web.get(ORG + "/runs", list_runs, allow_head=False),
    web.get(RUN, get_run, allow_head=False),
    web.post(RUN + "/approve", approve_run),
    web.post(RUN + "/discard", discard_run),
    web.post(RUN + "/cancel", cancel_run),
    web.post(RUN + "/rerun", rerun),
    web.get(RUN + "/events", run_events, allow_head=False),
    web.get(RUN + "/steps", run_steps, allow_head=False),
]
