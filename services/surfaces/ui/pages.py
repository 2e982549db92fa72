"""The UI's pages: organization, workspace and run, each read from this replica's
projection (the same read model the API answers from) and rendered on the server."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from events import approval, inherit
from events.run import CANCELABLE, STOPPABLE, TERMINAL, Cause, Status
from events.teams import LEVELS
from services.surfaces.api import approvals
from services.surfaces.api.problems import Problem
from services.surfaces.api.removed import missing_run
from services.surfaces.api.rollback import with_ids
from services.surfaces.api.runs import PLAN_ONLY
from services.surfaces.ui.web import Visit, base, page, render

PAGE = 50  # runs per page
STATUSES = sorted(str(s) for s in Status)


def _choice(query: Any, key: str, allowed: list[str]) -> str:
    value = str(query.get(key, "") or "")
    if value and value not in allowed:
        raise Problem("invalid-query", f"{key} must be one of {', '.join(allowed)}")
    return value


def _page_number(query: Any) -> int:
    raw = str(query.get("wpage", "0"))
    if not (raw.isascii() and raw.isdigit() and len(raw) < 7):
        raise Problem("invalid-query", "wpage must be a page number, from 0")
    return int(raw)


def _cursor(query: Any) -> str | None:
    before = query.get("before") or None
    if before is not None and not (before.isascii() and before.isalnum() and len(before) <= 64):
        raise Problem("invalid-query", "before must be a run id")
    return str(before) if before else None


async def _runs_page(visit: Visit, **filters: Any) -> tuple[list[dict[str, Any]], str | None]:
    rows = await visit.api.read.runs.find(visit.org, limit=PAGE, **filters)
    return rows, rows[-1]["id"] if len(rows) == PAGE else None


RUN_TYPES = ("plan", "apply", "destroy", "drift")


async def _grants(visit: Visit, key: str) -> list[dict[str, str]]:
    """The teams' levels granted on exactly `key` ("workspace:x", "folder:y")."""
    teams = (await visit.api.app.load_org(visit.org)).state.teams
    ranked = sorted(teams.values(), key=lambda t: t.name)
    return [{"team": t.name, "level": t.access[key]} for t in ranked if key in t.access]


@page("org.read")
async def org_page(visit: Visit) -> web.StreamResponse:
    """Workspaces (latest run, lock, queue, folder), filtered by status and name; runs."""
    query = visit.request.query
    status = _choice(query, "status", STATUSES)
    name = str(query.get("name", ""))[:100]
    before = _cursor(query)
    if await visit.api.read.orgs.get(visit.org) is None:
        raise Problem("not-found", f"organization {visit.org} not found")
    at = _page_number(query)
    workspaces = await visit.api.read.workspaces.summaries(visit.org)
    workspaces = [w for w in workspaces if visit.may_read(w["name"], w.get("folder") or "")]
    latest = await visit.api.read.runs.latest(visit.org)
    matching = [
        {**w, "latest": latest.get(w["name"])}
        for w in workspaces
        if name.lower() in w["name"].lower()
        and (not status or (latest.get(w["name"]) or {}).get("status") == status)
    ]
    shown = matching[at * PAGE : (at + 1) * PAGE]
    runs, next_before = await _runs_page(visit, status=[status] if status else None, before=before)
    names = {w["name"] for w in workspaces}
    runs = [r for r in runs if r["workspace"] in names]
    context = await base(
        visit,
        workspaces=shown,
        workspace_count=len(matching),
        wpage=at,
        wnext=at + 1 if (at + 1) * PAGE < len(matching) else None,
        runs=runs,
        next_before=next_before,
        status=status,
        name=name,
        statuses=STATUSES,
    )
    return render(visit.request, "org.html", context)


@page("workspace.read")
async def workspace_page(visit: Visit) -> web.StreamResponse:
    """The queue in FIFO order, runs (paged), variables, lock, state versions, settings."""
    ws = visit.path_id("ws")
    row = await visit.api.read.workspaces.get(visit.org, ws)
    if row is None:
        raise Problem("not-found", f"workspace {ws} not found")
    queue = [await visit.api.read.runs.get(visit.org, run_id) for run_id in row["queue"]]
    runs, next_before = await _runs_page(visit, workspace=ws, before=_cursor(visit.request.query))
    context = await base(
        visit,
        ws=row,
        queue=[q for q in queue if q is not None],
        runs=runs,
        next_before=next_before,
        states=with_ids(
            visit.org, ws, await visit.api.read.workspaces.state_versions(visit.org, ws)
        )[:20],
        settings=await _settings(visit, ws),
        secrets=await _secret_names(visit, ws),
        run_types=[t for t in RUN_TYPES if t in PLAN_ONLY or visit.can("run.apply")],
        grants=await _grants(visit, f"workspace:{ws}"),
        templates=await _templates(visit),
        level=LEVELS[visit.who.access.level_on(visit.where())],
    )
    return render(visit.request, "workspace.html", context)


async def _settings(visit: Visit, ws: str) -> list[dict[str, Any]]:
    """The workspace's effective settings, each with its origin (as the API answers)."""
    org = (await visit.api.app.load_org(visit.org)).state
    state = (await visit.api.app.load_ws(visit.org, ws)).state
    return [{"name": k, **v} for k, v in sorted(inherit.for_workspace(org, state).items())]


async def _secret_names(visit: Visit, ws: str) -> list[str]:
    """The names of the workspace's secret variables: their values never reach the API."""
    config = (await visit.api.app.load_ws(visit.org, ws)).state.config
    return sorted(config.secret_variables) if config is not None else []


async def _templates(visit: Visit) -> list[str]:
    state = (await visit.api.app.load_org(visit.org)).state
    return sorted(getattr(state, "templates", {}) or {})


@page("workspace.read")
async def run_page(visit: Visit) -> web.StreamResponse:
    """Everything about one run, and the buttons its caller may use on it."""
    run_id = visit.path_id("run")
    run = await visit.api.read.runs.get(visit.org, run_id)
    if run is None:
        raise await missing_run(visit.api, visit.org, run_id)
    context = await base(visit, **await run_context(visit, run))
    return render(visit.request, "run.html", context)


async def run_context(visit: Visit, run: dict[str, Any]) -> dict[str, Any]:
    read, org, run_id = visit.api.read, visit.org, run["id"]
    changes = await read.runs.changes(org, run_id) or {"groups": [], "summary_text": ""}
    ws = await read.workspaces.get(org, run["workspace"])
    return {
        "commit_link": commit_link(ws["repository"] if ws else "", run.get("commit") or ""),
        "run": run,
        "cause": _cause(run.get("cause")),
        "steps": await read.runs.steps(org, run_id),
        "events": await read.runs.events(org, run_id),
        "changes": changes,
        "resources": await read.runs.resources(org, run_id),
        "actions": await run_actions(visit, run),
        "terminal": run["status"] in {str(s) for s in TERMINAL},
        "message": visit.request.query.get("error", "")[:500],
    }


def _cause(shown: dict[str, Any] | None) -> str:
    """The run's cause in words ("" for a run created before causes were recorded)."""
    if not shown:
        return ""
    try:
        return msgspec.convert(shown, Cause).describe()
    except msgspec.ValidationError:
        return str(shown.get("kind", ""))


def commit_link(repository: str, sha: str) -> str:
    """A web link to the commit for a repository given by an http(s) URL, else "" (a
    local path or an ssh address has no page; no other scheme is ever made a link)."""
    if not sha or not repository.startswith(("https://", "http://")):
        return ""
    return f"{repository.removesuffix('/').removesuffix('.git')}/commit/{sha}"


async def run_actions(visit: Visit, run: dict[str, Any]) -> dict[str, Any]:
    """Which buttons the caller gets, and why one is absent (the core's own words)."""
    status = run["status"]
    out: dict[str, Any] = {"approve": None, "discard": None, "cancel": None, "why": []}
    cancel = "run.cancel_plan" if run["type"] in PLAN_ONLY else "run.cancel"
    if not visit.can(cancel):
        out["why"].append(f"{visit.who.user} may only read this workspace's runs")
        return out
    if status in {str(s) for s in CANCELABLE}:
        out["cancel"] = "Cancel"
    elif status in {str(s) for s in STOPPABLE}:
        out["cancel"] = "Stop"
    elif status == Status.APPLYING:  # the core refuses it (409): say why before
        out["why"].append(
            "an applying run cannot be stopped: interrupting an apply can corrupt state"
        )
    if status != "awaiting_approval":
        return out
    if not visit.can("run.approve"):
        out["why"].append(f"{visit.who.user} may plan here but not approve (it needs write)")
        return out
    state = (await visit.api.app.load_run(visit.org, run["workspace"], run["id"])).state
    caller = await approvals.caller(visit.api, visit.org, visit.who, run["id"])
    for action in ("approve", "discard"):
        try:
            approval.check_caller(
                action,
                caller,
                actor=visit.who.user,
                creator=state.created_by,
                snapshot=state.snapshot,
            )
        except Exception as e:  # noqa: BLE001 - Forbidden: the reason is shown instead
            out["why"].append(str(e))
        else:
            out[action] = True
    confirm = approval.setting(state.snapshot, "confirm_destructive")
    out["confirm"] = list(state.destructive) if confirm else []
    return out
