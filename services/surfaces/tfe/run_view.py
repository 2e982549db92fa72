"""How a run reads in the TFE API: the run an id in a request names (folded from its
events), its JSON:API document, and a run of the read model in a list's few attributes.
The handlers are services/surfaces/tfe/runs.py and plans.py."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from events import access, approval
from events.errors import Forbidden
from events.run import RunOptions, RunState, Status
from events.teams import LEVELS
from infra.eventstore import LATEST
from services.app.commands import App
from services.surfaces.api.auth import Principal
from services.surfaces.api.common import workspace_target
from services.surfaces.api.removed import removed_detail
from services.surfaces.tfe import ids
from services.surfaces.tfe.context import api_of, principal, require
from services.surfaces.tfe.jsonapi import Doc, TfeError, not_found, resource
from services.surfaces.tfe.statuses import cancelable, force_cancelable, run_status


def iso(when: datetime | None) -> str | None:
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ") if when else None


def _destroying(s: RunState) -> bool:
    return s.run_type == "destroy" or bool(s.options and s.options.destroy)


async def _may_approve(app: App, s: RunState, who: Principal, level: int) -> bool:
    """Whether the caller's "yes" would be taken: the approval rule on the run's own
    settings (four-eyes, approvers), and nothing destructive left to acknowledge (the
    CLI cannot acknowledge: confirm_destructive's runs wait for approval elsewhere)."""
    if s.status != Status.AWAITING_APPROVAL:
        return False
    groups = (await app.load_org(s.org)).state.groups
    me = approval.Caller(
        user=who.user,
        role=who.role,
        superuser=who.superuser,
        teams=list(who.access.teams),
        level=LEVELS[level],
    )
    try:
        approval.check("approve", me, creator=s.created_by, snapshot=s.snapshot, groups=groups)
    except Forbidden:
        return False
    return not approval.unacknowledged(s.snapshot, s.destructive, s.acknowledged)


async def render_run(
    app: App, s: RunState, who: Principal, position: int = 0, *, level: int = access.NONE
) -> Doc:
    """The run as go-tfe's `Run`; `level`: the caller's on its workspace (what it may do)."""
    org, ws, run = s.org, s.workspace, s.run_id
    confirmable = await _may_approve(app, s, who, level)
    operate = level >= access.WRITE
    discardable = s.status == Status.AWAITING_APPROVAL
    options = s.options or RunOptions()
    attrs: Doc = {
        "actions": {
            "is-cancelable": cancelable(s),
            "is-confirmable": confirmable,
            "is-discardable": discardable,
            "is-force-cancelable": force_cancelable(s),
        },
        "created-at": iso(s.created_at),
        "auto-apply": bool(s.options is not None and not s.options.confirm and not s.speculative),
        "has-changes": s.has_changes,
        "is-destroy": _destroying(s),
        "message": s.message,
        "permissions": {
            "can-apply": confirmable,
            "can-cancel": operate,
            "can-discard": operate,
            "can-force-cancel": operate,
            "can-force-execute": False,
        },
        "position-in-queue": position,
        "refresh": options.refresh,
        "refresh-only": options.refresh_only or s.run_type == "drift",
        "replace-addrs": options.replaces,
        "target-addrs": options.targets,
        "source": "tfe-api" if s.source is not None else "runplane",
        "status": run_status(s),
        "status-timestamps": {"plan-queueable-at": iso(s.created_at)},
        "speculative": s.speculative,
        "variables": [{"key": k, "value": v} for k, v in sorted(options.variables.items())],
    }
    checks = [("policy-checks", ids.run_object_id("polchk", org, ws, run))] if s.policies else []
    relationships: dict[str, Any] = {
        "workspace": ("workspaces", ids.workspace_id(org, ws)),
        "plan": ("plans", ids.run_object_id("plan", org, ws, run)),
        "apply": ("applies", ids.run_object_id("apply", org, ws, run)),
        "configuration-version": ("configuration-versions", s.source.id) if s.source else None,
        "cost-estimate": None,
        "created-by": ("users", f"user-{s.created_by}"),
        "policy-checks": {"data": [{"type": t, "id": i} for t, i in checks]},
    }
    links = {"self": f"/api/v2/runs/{ids.run_object_id('run', org, ws, run)}"}
    return resource("runs", ids.run_object_id("run", org, ws, run), attrs, relationships, links)


async def level_on(request: web.Request, org: str, ws: str) -> int:
    """The caller's level on workspace `ws`."""
    who = principal(request)
    if who.access.uniform(access.ADMIN):
        return access.ADMIN
    return who.access.level_on(await workspace_target(api_of(request), org, ws))


async def load(
    request: web.Request, kind: str, action: str = "workspace.read"
) -> tuple[RunState, Principal]:
    """The run an id of `kind` names, once the caller may `action` on its workspace."""
    raw = request.match_info["object_id"]
    org, ws, run = ids.parse_run_object_id(kind, raw)
    who = await require(request, org, action, ws)
    loaded = await api_of(request).app.load_run(org, ws, run, min_seq=LATEST)
    if not loaded.state.exists or loaded.state.workspace != ws:
        raise not_found(f"{kind} {raw!r} not found")
    if loaded.state.removed_at is not None:  # retention removed its record; events stay
        raise TfeError(410, "run removed", f"{kind} {raw!r}: {removed_detail(loaded.state)}")
    return loaded.state, who


_ROW_STATUS = {
    "pending": "pending",
    "queued": "plan_queued",
    "planning": "planning",
    "running": "planning",
    "awaiting_approval": "planned",
    "apply_queued": "apply_queued",
    "applying": "applying",
    "applied": "applied",
    "planned": "planned_and_finished",
    "no_changes": "planned_and_finished",
    "drifted": "planned_and_finished",
    "discarded": "discarded",
    "failed": "errored",
    "canceled": "canceled",
}


def row_doc(org: str, ws: str, row: dict[str, Any]) -> Doc:
    """A run of the read model, in the few attributes a list is read for."""
    attrs = {
        "status": _ROW_STATUS.get(str(row.get("status")), "pending"),
        "message": row.get("message") or "",
        "created-at": (row.get("created_at") or "").split(".", 1)[0].removesuffix("Z") + "Z",
        "has-changes": bool(row.get("has_changes")),
        "is-destroy": row.get("type") == "destroy",
    }
    run_id = ids.run_object_id("run", org, ws, row["id"])
    return resource("runs", run_id, attrs, {"workspace": ("workspaces", ids.workspace_id(org, ws))})
