"""Plans, applies and policy checks: the parts of a run the CLI reads while it waits
(services/surfaces/tfe/run_view.py loads the run; statuses.py maps their statuses)."""

from __future__ import annotations

from aiohttp import web

from events import policies as po
from events.run import RunState, Status
from services.surfaces.tfe import logs
from services.surfaces.tfe.jsonapi import document, resource, response
from services.surfaces.tfe.run_view import iso, load
from services.surfaces.tfe.statuses import apply_status, plan_status


async def read_plan(request: web.Request) -> web.Response:
    s, _ = await load(request, "plan")
    summary = s.plan_summary
    attrs = {
        "has-changes": s.has_changes,
        "resource-additions": summary.add if summary else 0,
        "resource-changes": summary.change if summary else 0,
        "resource-destructions": summary.destroy if summary else 0,
        "status": plan_status(s),
        "status-timestamps": {"queued-at": iso(s.created_at)},
        "log-read-url": logs.read_url(request, "plan", s),
    }
    return response(document(resource("plans", request.match_info["object_id"], attrs)))


async def read_apply(request: web.Request) -> web.Response:
    s, _ = await load(request, "apply")
    summary = s.apply_summary
    attrs = {
        "resource-additions": summary.add if summary else 0,
        "resource-changes": summary.change if summary else 0,
        "resource-destructions": summary.destroy if summary else 0,
        "status": apply_status(s),
        "status-timestamps": {},
        "log-read-url": logs.read_url(request, "apply", s),
    }
    return response(document(resource("applies", request.match_info["object_id"], attrs)))


def _policy_status(s: RunState) -> str:
    if po.hard_failures(s.policies):
        return "hard_failed"
    if po.soft_failures(s.policies):
        return "soft_failed"
    return "passed"


async def read_policy_check(request: web.Request) -> web.Response:
    s, _ = await load(request, "polchk")
    failed = [p for p in s.policies if not p.passed]
    attrs = {
        "actions": {"is-overridable": False},
        "permissions": {"can-override": False},
        "result": {
            "advisory-failed": 0,
            "duration": 0,
            "hard-failed": len(po.hard_failures(s.policies)),
            "passed": len(s.policies) - len(failed),
            "soft-failed": len(po.soft_failures(s.policies)),
            "total-failed": len(failed),
            "result": not failed,
        },
        "scope": "organization",
        "status": _policy_status(s),
        "status-timestamps": {},
    }
    return response(document(resource("policy-checks", request.match_info["object_id"], attrs)))


async def policy_check_output(request: web.Request) -> web.Response:
    """GET /policy-checks/:id/output: each policy set's verdict and its messages."""
    s, _ = await load(request, "polchk")
    lines: list[str] = []
    for p in s.policies:
        verdict = "passed" if p.passed else "failed"
        lines.append(f"{p.name} ({p.enforcement}, {p.scope}): {verdict}")
        lines += [f"  {m}" for m in p.messages]
    if s.status == Status.AWAITING_APPROVAL and po.soft_failures(s.policies):
        lines.append("a soft-mandatory policy failed: the run waits for an approval in runplane")
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")
