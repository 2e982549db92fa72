"""Sign in at `/` with a token, sign out at `/signout`.

Signing out ends the browser's session on every replica; a single sign-on session's
token (made by the sign-in for that session alone) is revoked with it, so a copy of the
cookie or of the token works nowhere after. A token pasted at sign-in is the person's
own (they may use it elsewhere): signing out leaves it, as revoking it is theirs to do
(`/app/settings/tokens`). Tokens `terraform login` or `runplane login --sso` made from
the session are the CLI's and stay until they expire (never later than the session's).
"""

from __future__ import annotations

import secrets

from aiohttp import web

from events.org import RevokeToken
from infra.ids import hash_token
from services.surfaces.api.auth import authenticate
from services.surfaces.api.bodies import check_name
from services.surfaces.api.context import API
from services.surfaces.api.problems import Problem
from services.surfaces.ui.sessions import (
    COOKIE,
    PRESIGN,
    SessionError,
    check_csrf,
    check_origin,
    set_cookie,
)
from services.surfaces.ui.sso import sso_button
from services.surfaces.ui.web import SESSIONS, error_page, guarded, read_form, render, see_other


def _form(
    request: web.Request, *, error: str = "", status: int = 200, sso: dict[str, str] | None = None
) -> web.Response:
    """The sign-in form with its double-submit CSRF value (a new one if none yet), and
    single sign-on's button when the page names an organization that has it."""
    presign = request.cookies.get(PRESIGN) or secrets.token_urlsafe(32)
    context = {"csrf": presign, "error": error, "sso": sso}
    response = render(request, "signin.html", context, status=status)
    set_cookie(response, request, PRESIGN, presign)
    return response


async def signin_page(request: web.Request) -> web.StreamResponse:
    """`/`: the organization's page if signed in, else the form."""

    async def call() -> web.StreamResponse:
        session = await request.app[SESSIONS].get(request.cookies.get(COOKIE))
        if session is not None:
            raise web.HTTPSeeOther(f"/orgs/{session.org}")
        return _form(request, sso=await sso_button(request))

    return await guarded(request, call)


async def signin(request: web.Request) -> web.StreamResponse:
    async def call() -> web.StreamResponse:
        try:
            check_origin(request)
            fields = await read_form(request)
            check_csrf(fields.get("csrf", ""), request.cookies.get(PRESIGN, ""))
        except SessionError as e:
            return error_page(request, 403, "Refused", str(e))
        return await _signin(
            request, fields.get("token", "").strip(), fields.get("org", "").strip()
        )

    return await guarded(request, call)


async def _signin(request: web.Request, token: str, org_field: str) -> web.StreamResponse:
    if not token:
        return _form(request, error="Enter a token.", status=400)
    api = request.app[API]
    try:
        who = await authenticate(api, f"Bearer {token}")
    except Problem as p:
        if p.status != 401:
            raise
        return _form(request, error=f"Not signed in: {p.detail}.", status=401)
    if who.org is None:  # the admin token: it names the organization to open
        if not org_field:
            return _form(request, error="The admin token needs an organization.", status=400)
        org = check_name("org", org_field)
        if await api.read.orgs.get(org) is None:
            return _form(request, error=f"Organization {org} not found.", status=404)
    else:
        org = who.org
    sessions = request.app[SESSIONS]
    await sessions.end(request.cookies.get(COOKIE))  # whatever id the browser held is dropped
    session_id, _ = await sessions.start(token, org)
    response = see_other(f"/orgs/{org}")
    set_cookie(response, request, COOKIE, session_id)
    response.del_cookie(PRESIGN, path="/")
    return response


async def signout(request: web.Request) -> web.StreamResponse:
    """End the session on the server (CSRF checked: no other site signs anyone out), and
    revoke the token single sign-on made for it."""

    async def call() -> web.StreamResponse:
        sessions = request.app[SESSIONS]
        session_id = request.cookies.get(COOKIE)
        session = await sessions.get(session_id)
        try:
            check_origin(request)
            fields = await read_form(request)
            check_csrf(fields.get("csrf", ""), session.csrf if session else "")
        except SessionError as e:
            return error_page(request, 403, "Refused", str(e))
        if session is not None and session.minted:
            await _revoke(request, session.token)
            await sessions.end_token(session.token)
        await sessions.end(session_id)
        response = see_other("/")
        response.del_cookie(COOKIE, path="/")
        return response

    return await guarded(request, call)


async def _revoke(request: web.Request, token: str) -> None:
    """Revoke a session's own token (`org.token_revoked`), read back before the answer:
    a stolen copy of the token or cookie is refused on every replica from then on."""
    api = request.app[API]
    row = await api.token(hash_token(token))
    if row is None or row["revoked_at"] is not None:
        return
    command = RevokeToken(actor=row["user"], token_id=row["token_id"])
    result = await api.app.org_command(row["org"], command)
    await api.after_write(result.seq)
