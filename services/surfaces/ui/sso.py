"""Sign in with the organization's identity provider: `/app/sso/start` and the callback.

`GET /app/sso/start?org=<org>&next=<path>` begins a flow (services/app/sso_flows.py) and
sends the browser to the provider. The flow is bound to this browser by the `rp_sso`
cookie (`HttpOnly`, `SameSite=Lax`: the provider's redirect back is a top-level
navigation from its site, which a Strict cookie would miss; its path is `/app/sso`
only). `GET /app/sso/callback` finishes it on whichever replica the browser reaches:
the identity hook (services/app/identity.py `sign_in_user`) makes the person a user of
the organization with the teams their groups give and a personal token (the user's
access, nothing more), and the UI session starts on that token, as the token sign-in
does (a new session id: nothing planted before is promoted).

Every failure is an HTML page naming its reason (`sso-replay`, `sso-wrong-audience`,
...), status 400 (503 when NATS or the provider is out of reach), with nothing written.

A start another site's page sent the browser to (`Sec-Fetch-Site` cross-site or
same-site) is refused (`sso-cross-site`): with a provider that answers at once, it would
sign the victim in as someone else.

`next` is where the browser goes after: a path on this site only (never a URL, `//host`
or a backslash: no open redirect), either the organization's own pages or the consent
page of `terraform login` / `runplane login` (services/surfaces/tfe/login.py), or the
device page of `runplane login --device` (services/surfaces/ui/device.py); anything else
lands on the organization's page.
"""

from __future__ import annotations

import os
import re
from urllib.parse import urlencode, urlsplit

import structlog
from aiohttp import web

from events.codec import valid_id
from events.errors import DomainError
from infra.directget import InfraError
from infra.oidc import OidcError
from services.app.sso_flows import new_binding
from services.surfaces.api.bodies import check_name
from services.surfaces.api.context import API
from services.surfaces.api.problems import Problem
from services.surfaces.api.sso import KIT, kit_of
from services.surfaces.ui.sessions import COOKIE, scheme, secure, set_cookie
from services.surfaces.ui.web import SESSIONS, error_page

START, CALLBACK = "/app/sso/start", "/app/sso/callback"
FLOW_COOKIE = "rp_sso"
PUBLIC_URL_ENV = "RUNPLANE_PUBLIC_URL"
MAX_NEXT = 2048
_BINDING = re.compile(r"^[A-Za-z0-9_-]{43}$")
CONSENT = "/app/oauth/authorize"
DEVICE = "/device"  # `runplane login --device`'s page (services/surfaces/ui/device.py)

log = structlog.get_logger("runplane.ui.sso")


def safe_next(org: str, wanted: str) -> str:
    """Where to go after signing in to `org`: `wanted` if it is one of this site's paths a
    sign-in may lead to, else the organization's page."""
    home = f"/orgs/{org}"
    if not wanted or len(wanted) > MAX_NEXT or not wanted.isprintable() or " " in wanted:
        return home
    if not wanted.startswith("/") or wanted.startswith("//") or "\\" in wanted:
        return home
    parts = urlsplit(wanted)
    if parts.scheme or parts.netloc or parts.fragment:
        return home
    if parts.path == home or parts.path.startswith(home + "/"):
        return wanted
    if parts.path in (CONSENT, DEVICE):
        return wanted
    return home


def public_base(request: web.Request) -> str:
    """The deployment's public URL if set (`RUNPLANE_PUBLIC_URL`), else this request's
    own origin."""
    return os.environ.get(PUBLIC_URL_ENV, "").rstrip("/") or f"{scheme(request)}://{request.host}"


def callback_url(request: web.Request) -> str:
    """Where the provider sends the browser back."""
    return public_base(request) + CALLBACK


def _failed(request: web.Request, e: Exception) -> web.Response:
    if isinstance(e, DomainError):
        return error_page(request, 400, "Single sign-on failed", f"{e} ({e.code}).")
    if isinstance(e, OidcError | Problem):
        reason = e.reason if isinstance(e, OidcError) else e.slug
        status = 503 if getattr(e, "retryable", False) or isinstance(e, InfraError) else 400
        status = e.status if isinstance(e, Problem) else status
        log.info("sso_refused", reason=reason)
        return error_page(request, status, "Single sign-on failed", f"{e} ({reason}).")
    log.warning("sso_unavailable", error=repr(e))
    return error_page(request, 503, "Single sign-on failed", "try again in a moment.")


# Where a start may come from (Fetch Metadata): runplane's own pages, or the browser itself
# (a typed URL, a bookmark). A browser that sends no Sec-Fetch-Site is let through.
STARTED_FROM = frozenset({"same-origin", "none", ""})


async def start(request: web.Request) -> web.StreamResponse:
    """GET /app/sso/start: off to the organization's identity provider. Not from another
    site's page: an organization's admin runs its own provider, which may answer at once,
    so a link of theirs would sign the victim's browser in as the attacker's account
    (ending the victim's own session): login CSRF by the front door."""
    site = request.headers.get("Sec-Fetch-Site", "").strip().lower()
    if site not in STARTED_FROM:
        log.info("sso_refused", reason="sso-cross-site", site=site[:32])
        return error_page(
            request,
            403,
            "Single sign-on refused",
            "a sign-in starts from runplane's own sign-in page, not from another site's "
            "(sso-cross-site).",
        )
    binding = request.cookies.get(FLOW_COOKIE, "")
    if not _BINDING.fullmatch(binding):
        binding = new_binding()
    try:
        org = check_name("org", request.query.get("org", "").strip())
        if await request.app[API].read.orgs.get(org) is None:
            raise Problem("not-found", f"organization {org} not found")
        url = await kit_of(request).flows.begin(
            org,
            redirect_uri=callback_url(request),
            return_to=safe_next(org, request.query.get("next", "")),
            binding=binding,
        )
    except (OidcError, Problem, InfraError) as e:
        return _failed(request, e)
    response = web.Response(status=303, headers={"Location": url, "Cache-Control": "no-store"})
    response.set_cookie(
        FLOW_COOKIE,
        binding,
        httponly=True,
        samesite="Lax",
        secure=secure(request),
        path="/app/sso",
        max_age=900,
    )
    return response


async def callback(request: web.Request) -> web.StreamResponse:
    """GET /app/sso/callback: the provider's answer; a session, or a page saying why not."""
    q = request.query
    try:
        if "error" in q:
            raise OidcError(
                f"the identity provider answered {q['error'][:64]}", reason="sso-denied"
            )
        kit = kit_of(request)
        done = await kit.flows.finish(
            state=q.get("state", ""),
            code=q.get("code", ""),
            binding=request.cookies.get(FLOW_COOKIE, ""),
            iss=q.get("iss"),
        )
        signed = done.signed_in
        await request.app[API].after_write(signed.seq)
    except (OidcError, Problem, InfraError, DomainError) as e:
        return _failed(request, e)
    sessions = request.app[SESSIONS]
    await sessions.end(request.cookies.get(COOKIE))
    session_id, _ = await sessions.start(signed.token, done.flow.org, minted=True)
    log.info("sso_signed_in", org=done.flow.org, user=signed.user_id, issuer=done.flow.issuer)
    response = web.Response(status=303, headers={"Location": done.flow.return_to})
    set_cookie(response, request, COOKIE, session_id)
    return response


async def sso_button(request: web.Request) -> dict[str, str] | None:
    """The sign-in page's "Sign in with <provider>" of `?org=`, if that organization has
    single sign-on (`next` passed on as given: the start judges it)."""
    org = request.query.get("org", "")
    label = await sso_label(request, org)
    if label is None:
        return None
    query = urlencode({"org": org, "next": request.query.get("next", "")})
    return {"label": label, "href": f"{START}?{query}", "org": org}


async def sso_label(request: web.Request, org: str) -> str | None:
    """The name of `org`'s identity provider, if it has single sign-on."""
    kit = request.app.get(KIT)
    if kit is None or not org or not valid_id(org):
        return None
    try:
        config = await kit.configs.load(org)
    except InfraError:
        return None
    return config.label if config.configured else None


ROUTES = [
    web.get(START, start, allow_head=False),
    web.get(CALLBACK, callback, allow_head=False),
]
