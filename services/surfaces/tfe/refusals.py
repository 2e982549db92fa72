"""The TFE API's refusals on the organization's audit record, as runplane's own API's
are (services/surfaces/api/audit.py): every 403, and a 409 on what changes a run, a
lock or a state (apply, discard, cancel, force-cancel, lock, unlock, force-unlock, a
state version's upload), recorded via `tfe` with the caller, the thing, the outcome,
the request id and the client's address, under the same flood limits (one limiter per
api process for every surface: a caller gets its 60 a minute once, not once a surface).

The TFE routes answer their errors themselves (context.py `route`), so the api's
middleware never sees them raised: the wrapper calls `record` with each refusal.

Whose chain: a TFE id carries its organization (`ws-<org>.<ws>`, `run-<org>.<ws>.<run>`,
services/surfaces/tfe/ids.py), so the thing's organization is known from the path alone
(POST /runs names its workspace in the body: what `require` was asked about stands for
it). A caller of that organization (or the deployment's admin) is recorded there. A caller of
another organization was answered 404, as for an id that names nothing, and is recorded
in its own organization's chain, never in the other's: that chain stays closed to it
(not even the flood limit's worth gets in), and its own admin learns that one of its
tokens reached for another organization's things, which is what a stolen or misused
token looks like. The record holds only what the caller sent (the id it named, the
404), the same whether that thing exists or not, so it tells nobody anything of the
other organization.
"""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web

from events.codec import valid_id
from services.surfaces.api.audit import append_refusal
from services.surfaces.api.auth import PRINCIPAL
from services.surfaces.tfe import ids
from services.surfaces.tfe.jsonapi import TfeError

# the paths (POST) whose 409 is a refusal that matters
_CONFLICTS = (
    "/actions/apply",
    "/actions/discard",
    "/actions/cancel",
    "/actions/force-cancel",
    "/actions/lock",
    "/actions/unlock",
    "/actions/force-unlock",
    "/state-versions",
)


def slug_of(error: TfeError) -> str:
    """A stable slug for a TFE error of the surface's own (`transition not allowed`:
    `transition-not-allowed`)."""
    return error.title.strip().lower().replace(" ", "-")


# (org, workspace or "") an access check was asked about (context.py `require`): the
# target of a request whose path names none (POST /runs names its workspace in the body)
CHECKED: web.RequestKey[tuple[str, str]] = web.RequestKey("runplane.tfe.checked", tuple)


def target(request: web.Request) -> tuple[str, str] | None:
    """(organization, thing) of the request: its path's ids, else what its access was
    checked on; None when neither names one."""
    found = _named(request.match_info)
    checked = request.get(CHECKED)
    if found is None and checked is not None:
        org, ws = checked
        found = (org, f"workspace {ws}" if ws else f"organization {org}")
    return found


def _named(match: Mapping[str, str]) -> tuple[str, str] | None:
    """(organization, thing) of the path's ids, None when it names none that parses."""
    try:
        if "workspace_id" in match:
            org, ws = ids.parse_workspace_id(match["workspace_id"])
            return org, f"workspace {ws}"
        if "object_id" in match:
            raw = match["object_id"]
            kind = raw.split("-", 1)[0]
            if kind in ids.RUN_KINDS:
                org, _, run = ids.parse_run_object_id(kind, raw)
                return org, f"run {run}"
            return None
        if "sv_id" in match:
            org, ws, _, _ = ids.parse_state_version_id(match["sv_id"])
            return org, f"workspace {ws}"
        if "cv_id" in match:
            org, ws, _ = ids.parse_config_id(match["cv_id"])
            return org, f"workspace {ws}"
    except TfeError:
        return None
    org = match.get("org", "")
    return (org, f"organization {org}") if valid_id(org) else None


def _matters(request: web.Request, status: int) -> bool:
    if status == 403:
        return True
    return status == 409 and request.method == "POST" and request.path.endswith(_CONFLICTS)


async def record(request: web.Request, error: TfeError, slug: str) -> None:
    """Record the refusal `error` (`slug` its stable name) of an authenticated TFE
    request where it belongs (module docstring); anything else is left alone."""
    who = request.get(PRINCIPAL)
    found = target(request)
    if who is None or found is None or not 400 <= error.status < 500:
        return
    org, thing = found
    if who.superuser or who.org == org:
        if _matters(request, error.status):
            await append_refusal(request, org, status=error.status, detail=slug, thing=thing)
        return
    if who.org:  # another organization's id: the caller's own chain, what it named
        named = f"{thing} of organization {org}"
        await append_refusal(request, who.org, status=error.status, detail=slug, thing=named)
