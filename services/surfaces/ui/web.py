"""What every page and form of the UI shares: the visit (session, caller, organization),
the role rules, rendering, and errors as HTML pages (never a traceback, never JSON).

A page is `@page(action)`: no session sends the browser to the sign-in form; a session of
another organization, or an object that is not the organization's, is a 404 page (as
the API answers 404, never 403, so that nothing probes what exists elsewhere). A form
is `@form(action)`: the same, plus the CSRF token and the Origin check. The action is
checked by the one access check (events/access.py) on the page's target: the path's
workspace, the run's workspace, the folder, else the organization (a workspace the
caller may not read is a 404 page). As the templates ask `visit.can(...)` about the same
target, nothing leads to what would be refused.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp_jinja2
import nats.errors
import structlog
from aiohttp import web
from aiohttp.typedefs import Handler as AioHandler
from multidict import MultiDictProxy

from events import access
from events.errors import DomainError
from infra.eventstore import StoreError
from infra.heartbeats import BoardError
from infra.kv import KvError
from services.surfaces.api.auth import PRINCIPAL, Principal, authenticate
from services.surfaces.api.bodies import check_name
from services.surfaces.api.common import run_workspace, workspace_target
from services.surfaces.api.context import API, Api
from services.surfaces.api.problems import Problem, from_domain, from_http
from services.surfaces.ui.sessions import (
    COOKIE,
    Session,
    SessionError,
    Sessions,
    check_csrf,
    check_origin,
)

log = structlog.get_logger("runplane.ui")

JINJA: web.AppKey[Any] = web.AppKey("runplane.ui.jinja", object)
SESSIONS: web.AppKey[Sessions] = web.AppKey("runplane.ui.sessions", Sessions)
MAX_FORM = 64 * 1024  # bytes of a form post
BAR_LIMIT = 50  # active runs the bar lists, awaiting approval first (it counts all)


@dataclass
class Visit:
    """One request of a signed-in browser, bound to its organization."""

    request: web.Request
    api: Api
    session: Session
    who: Principal
    org: str
    target: access.Target | None = None  # the page's workspace or folder, once known

    def where(self) -> access.Target:
        return self.target or access.Target(org=self.org)

    def can(self, action: str) -> bool:
        """Whether the caller may `action` here (what the templates show or hide)."""
        return self.who.may(action, self.where())

    def require(self, action: str, *, hidden: str = "") -> None:
        access.require(self.who.access, action, self.where(), hidden=hidden)

    async def on_workspace(self, ws: str, *, hidden: str = "") -> None:
        """The page is about workspace `ws`: 404 unless the caller may read it."""
        self.target = await workspace_target(self.api, self.org, ws)
        self.require("workspace.read", hidden=hidden)

    async def aim(self) -> str:
        """Set the target from the path ({ws}, {run}, {folder}); the name a refusal
        hides it under."""
        match = self.request.match_info
        if "ws" in match:
            await self.on_workspace(self.path_id("ws"))
        elif "run" in match:
            run_id = self.path_id("run")
            hidden = f"run {run_id}"
            await self.on_workspace(await run_workspace(self.api, self.org, run_id), hidden=hidden)
            return hidden
        elif "folder" in match:
            self.target = access.Target(org=self.org, folders=(self.path_id("folder"),))
        return ""

    def may_read(self, ws: str, folder: str = "") -> bool:
        """Whether the caller may see workspace `ws` (a list's filter)."""
        target = access.Target(org=self.org, workspace=ws, folders=(folder,) if folder else ())
        return self.who.may("workspace.read", target)

    def path_id(self, key: str) -> str:
        return check_name(key, self.request.match_info[key])


Handler = Callable[[Visit], Awaitable[web.StreamResponse]]
VISIT: web.RequestKey[Visit] = web.RequestKey("runplane.ui.visit", Visit)


async def base(visit: Visit, **context: Any) -> dict[str, Any]:
    """What every signed-in page shows: who, the organization, its active runs (the bar:
    the oldest BAR_LIMIT listed, all counted)."""
    bar, count, awaiting = await visit.api.read.runs.active(visit.org, BAR_LIMIT)
    if not visit.who.access.uniform(access.READ):  # only what the caller may read
        readable = await readable_workspaces(visit)
        bar = [r for r in bar if r["workspace"] in readable]
        count = len(bar)
        awaiting = sum(1 for r in bar if r["status"] == "awaiting_approval")
    return {
        "visit": visit,
        "org": visit.org,
        "csrf": visit.session.csrf,
        "bar": bar,
        "active_count": count,
        "awaiting": awaiting,
        **context,
    }


def render(
    request: web.Request, name: str, context: Mapping[str, Any], *, status: int = 200
) -> web.Response:
    """The template `name` with `context` (autoescaped: every value is text, not HTML)."""
    response = aiohttp_jinja2.render_template(
        name, request, dict(context), status=status, app_key=JINJA
    )
    response.headers.update(SECURITY_HEADERS)
    return response


# No script but ours, no framing, no sniffing: an injected tag runs nothing even if some
# escape were missed. htmx's inline indicator styles are its only inline style.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def error_page(request: web.Request, status: int, title: str, detail: str) -> web.Response:
    """The error page without the signed-in frame (sign-in, CSRF refusals)."""
    return render(
        request, "error.html", {"title": title, "detail": detail, "status": status}, status=status
    )


async def _error_page(request: web.Request, status: int, title: str, detail: str) -> web.Response:
    """The error page, in the nav and the bar of the page's visit if it got that far."""
    context: dict[str, Any] = {"title": title, "detail": detail, "status": status}
    visit = request.get(VISIT)
    if visit is not None and status != 503:  # unavailable: the bar's read would fail too
        try:
            context = await base(visit, **context)
        except Exception:  # the frame is a convenience: the error is what is shown
            log.warning("ui_error_frame_unavailable", exc_info=True)
    return render(request, "error.html", context, status=status)


async def visit_of(request: web.Request) -> Visit:
    """The signed-in visit of the request, or SessionError (sign in again)."""
    sessions = request.app[SESSIONS]
    session_id = request.cookies.get(COOKIE)
    session = await sessions.get(session_id)
    if session is None:
        raise SessionError("not signed in")
    api = request.app[API]
    try:
        who = await authenticate(api, f"Bearer {session.token}")
    except Problem as p:
        if p.status == 401:  # revoked or expired: every session of that token ends
            await sessions.end_token(session.token)
            raise SessionError(p.detail) from p
        raise
    request[PRINCIPAL] = who
    org = check_name("org", request.match_info.get("org", session.org))
    if org != session.org:
        raise Problem("not-found", f"organization {org} not found")
    access.require(who.access, "org.read", access.Target(org=org))
    visit = Visit(request=request, api=api, session=session, who=who, org=org)
    request[VISIT] = visit
    return visit


async def _problem_page(request: web.Request, p: Problem) -> web.Response:
    response = await _error_page(request, p.status, p.title, p.detail)
    response.headers.update(p.headers)
    return response


async def guarded(
    request: web.Request, call: Callable[[], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Run `call`, answering every error as an HTML page."""
    try:
        return await call()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return await _error_page(request, e.status, e.reason, e.text or e.reason)
    except Problem as p:
        return await _problem_page(request, p)
    except DomainError as e:
        return await _problem_page(request, from_domain(e))
    except (StoreError, BoardError, KvError, nats.errors.Error) as e:
        log.warning("event_store_unavailable", error=str(e))
        return await _error_page(
            request, 503, "Temporarily unavailable", "the event store is unavailable; try again"
        )
    except Exception:
        log.exception("ui_unhandled_error")
        return await _error_page(request, 500, "Internal error", "an unexpected error occurred")


async def still_signed_in(visit: Visit) -> bool:
    """Whether the visit's session token still stands (a live stream asks each time it
    moves: a suspension, a revocation or an expiry ends it)."""
    try:
        visit.who = await authenticate(visit.api, f"Bearer {visit.session.token}")
    except Problem as p:
        if p.status == 401:
            return False
        raise
    return True


async def readable_workspaces(visit: Visit) -> set[str]:
    """The names of the organization's workspaces the caller may read."""
    folders = await visit.api.read.workspaces.folders(visit.org)
    return {ws for ws, folder in folders.items() if visit.may_read(ws, folder)}


def page(
    action: str,
) -> Callable[[Handler], Callable[[web.Request], Awaitable[web.StreamResponse]]]:
    """A page of the signed-in UI for callers who may `action` on its target."""

    def wrap(handler: Handler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        @functools.wraps(handler)
        async def run(request: web.Request) -> web.StreamResponse:
            async def call() -> web.StreamResponse:
                try:
                    visit = await visit_of(request)
                except SessionError:
                    raise web.HTTPSeeOther("/") from None
                hidden = await visit.aim()
                visit.require(action, hidden=hidden)
                return await handler(visit)

            return await guarded(request, call)

        return run

    return wrap


FORM: web.RequestKey[MultiDictProxy[str]] = web.RequestKey("runplane.ui.form", MultiDictProxy)


def form(
    action: str,
) -> Callable[[Handler], Callable[[web.Request], Awaitable[web.StreamResponse]]]:
    """A form post of the signed-in UI: the session, its CSRF token, then `action` on its
    target (a handler may ask more, e.g. an apply's write once it read the run type)."""

    def wrap(handler: Handler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        @functools.wraps(handler)
        async def run(request: web.Request) -> web.StreamResponse:
            async def call() -> web.StreamResponse:
                signed = await signed_form(request)
                if isinstance(signed, web.Response):
                    return signed
                visit, request[FORM] = signed
                hidden = await visit.aim()
                visit.require(action, hidden=hidden)
                return await handler(visit)

            return await guarded(request, call)

        return run

    return wrap


async def signed_form(request: web.Request) -> tuple[Visit, MultiDictProxy[str]] | web.Response:
    """A form post's signed-in visit and fields, once its Origin is this site's and it
    carries the session's CSRF token; else the 403 page to answer (every form of the
    signed-in UI, `@form` and the device page's, begins so)."""
    try:
        check_origin(request)
        visit = await visit_of(request)
        fields = await read_form(request)
        check_csrf(fields.get("csrf", ""), visit.session.csrf)
    except SessionError as e:
        return error_page(request, 403, "Refused", str(e))
    return visit, fields


async def read_form(request: web.Request) -> MultiDictProxy[str]:
    """The posted form's fields (text only; a file or an oversized body is refused)."""
    if request.content_length is not None and request.content_length > MAX_FORM:
        raise Problem("body-too-large", f"a form is at most {MAX_FORM} bytes")
    raw = await request.post()
    if not all(isinstance(v, str) for v in raw.values()):
        raise Problem("invalid-body", "a form takes no files")
    return raw  # type: ignore[return-value]  # checked above: every value is a str


def _from_a_browser(request: web.Request) -> bool:
    """A browser's request for a page (not the API's: its clients send a bearer token,
    ask for JSON, or use /api/)."""
    return (
        "text/html" in request.headers.get("Accept", "")
        and "Authorization" not in request.headers
        and not request.path.startswith("/api/")
    )


@web.middleware
async def html_errors(request: web.Request, handler: AioHandler) -> web.StreamResponse:
    """A browser's request for no page (an unknown path, a wrong method) is answered by
    an HTML page, in the nav and the bar when it is signed in; the API's clients still
    get the problem details of services/surfaces/api/middleware.py."""
    failed = request.match_info.http_exception
    if failed is None or not _from_a_browser(request):
        return await handler(request)

    async def call() -> web.StreamResponse:
        try:
            await visit_of(request)  # for the frame only: signed out, the page is bare
        except (SessionError, Problem):
            pass
        raise from_http(failed, request.method, request.path)

    return await guarded(request, call)


def see_other(location: str) -> web.Response:
    """Post/redirect/get: after a form, the page it acted on."""
    return web.Response(status=303, headers={"Location": location})
