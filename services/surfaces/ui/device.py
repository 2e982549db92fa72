"""`/device`: where a person approves `runplane login --device` (RFC 8628's verification
URI) in any browser, on any machine; the grants are services/app/device.py's, the
client's endpoints services/surfaces/api/device.py.

`GET /device[?user_code=XXXX-XXXX&org=ORG]` needs a signed-in session. Without one it
offers the sign-in: single sign-on ("Sign in with ..." when `org` has it, which comes
back here: services/surfaces/ui/sso.py `safe_next` lets `/device` through and nothing
else new), or a token at `/`. Signed in, it shows the code form, and for a live code the
confirmation page: the organization, the client, the signed-in user, when and from which
address it was asked, with Approve / Deny (a POST carrying the session's CSRF token,
Origin checked). Only a person (a personal token or single sign-on: no organization,
team or admin token) of the grant's own organization, not suspended, approves; the
token the device gets is theirs (services/surfaces/tfe/login.py `token_kind`).

A wrong, expired or used code is a message on the page, and counts: past
`MAX_WRONG` wrong codes a person (whatever their sessions, tokens or replicas) may try
none for a while (the count lives in the grants' bucket).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

import structlog
from aiohttp import web

from events.codec import valid_id
from services.app.device import MAX_WRONG, Approver, DeviceError, Found, shown
from services.surfaces.api.audit import client_address
from services.surfaces.api.device import DEVICE, client_label
from services.surfaces.tfe.login import token_expiry, token_kind
from services.surfaces.ui.sessions import SessionError
from services.surfaces.ui.sso import START, sso_label
from services.surfaces.ui.web import (
    Visit,
    base,
    guarded,
    render,
    signed_form,
    visit_of,
)

PAGE, DECIDE = "/device", "/device/decide"

log = structlog.get_logger("runplane.ui.device")


def _when(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


async def _signin_first(request: web.Request) -> web.Response:
    """Not signed in: the ways to, each coming back here."""
    org = request.query.get("org", "")
    org = org if valid_id(org) else ""
    code = request.query.get("user_code", "")[:16]
    here = PAGE + ("?" + urlencode({"user_code": code}) if code else "")
    label = await sso_label(request, org) if org else None
    sso = {"href": f"{START}?{urlencode({'org': org, 'next': here})}", "label": label}
    context = {"sso": sso if label else None, "next": here, "org_hint": org}
    return render(request, "device_signin.html", context, status=401)


async def _page(visit: Visit, *, status: int = 200, **context: Any) -> web.Response:
    return render(visit.request, "device.html", await base(visit, **context), status=status)


async def _look_up(visit: Visit, typed: str) -> Found | web.Response:
    """The live grant a code names, or the code form saying why not (counted wrong)."""
    grants = visit.request.app[DEVICE]
    if await grants.wrong_count(visit.org, visit.who.user) >= MAX_WRONG:
        detail = "Too many wrong codes: wait a quarter of an hour, then try again."
        return await _page(visit, status=429, error=detail, code=typed)
    found = await grants.by_user_code(typed)
    if found is None:
        count = await grants.note_wrong(visit.org, visit.who.user)
        log.info("device_code_wrong", org=visit.org, user=visit.who.user, count=count)
        detail = "This code is wrong, expired or used already: check it, or start again."
        return await _page(visit, status=400, error=detail, code=typed)
    return found


def _approver_problem(visit: Visit, found: Found) -> str:
    """Why this signed-in caller may not approve the grant ("" if they may)."""
    if found.grant.org != visit.org:
        return (
            f"This code is for organization {found.grant.org}; you are signed in to "
            f"{visit.org}. Sign out, then sign in to {found.grant.org} to approve it."
        )
    if not visit.who.access.user_id:
        return "Only a person approves a device: sign in with single sign-on or your own token."
    return ""


async def device_page(request: web.Request) -> web.StreamResponse:
    """GET /device: the code form, or the confirmation of the code given."""

    async def call() -> web.StreamResponse:
        try:
            visit = await visit_of(request)
        except SessionError:
            return await _signin_first(request)
        typed = request.query.get("user_code", "")[:32]
        if not typed:
            return await _page(visit, code="")
        found = await _look_up(visit, typed)
        if isinstance(found, web.Response):
            return found
        problem = _approver_problem(visit, found)
        if problem:
            return await _page(visit, status=403, error=problem, code=typed)
        grant = found.grant
        confirm = {
            "user_code": shown(grant.user_code),
            "org": grant.org,
            "client": client_label(grant.client_id),
            "client_id": grant.client_id,
            "asked_at": _when(grant.created),
            "asked_from": grant.address,
            "expires_at": _when(grant.expires),
        }
        return await _page(visit, confirm=confirm, code=typed)

    return await guarded(request, call)


async def decide(request: web.Request) -> web.StreamResponse:
    """POST /device/decide: Approve or Deny, once."""

    async def call() -> web.StreamResponse:
        signed = await signed_form(request)
        if isinstance(signed, web.Response):
            return signed
        visit, fields = signed
        typed = fields.get("user_code", "")[:32]
        found = await _look_up(visit, typed)
        if isinstance(found, web.Response):
            return found
        problem = _approver_problem(visit, found)
        if problem:
            return await _page(visit, status=403, error=problem, code=typed)
        kind, owner, level = token_kind(visit.who)
        approver = Approver(
            org=visit.org, user=visit.who.user, role=visit.who.role,
            token_expires=await token_expiry(visit.api, visit.session.token),
            kind=kind, owner=owner, level=level, address=client_address(request),
        )  # fmt: skip
        approve = fields.get("decision") == "approve"
        try:
            grant = await request.app[DEVICE].decide(typed, approver, approve=approve)
        except DeviceError as e:
            return await _page(visit, status=409, error=f"{e}.", code=typed)
        log.info(
            "device_grant_decided", org=grant.org, user=visit.who.user, client=grant.client_id,
            approved=approve, device_address=grant.address, address=approver.address,
        )  # fmt: skip
        return await _page(visit, done="approved" if approve else "denied", code="")

    return await guarded(request, call)


ROUTES = [
    web.get(PAGE, device_page, allow_head=False),
    web.post(DECIDE, decide),
]
