"""`terraform login` by the `login.v1` protocol: OAuth's authorization code with PKCE.

The CLI opens `/app/oauth/authorize` in the user's browser with an S256 code challenge
and a redirect to its own listener (`http://localhost:<port>/login`, a port of the
advertised range); the browser, signed in to runplane's web UI (services/surfaces/ui), shows
whom the token will act as and asks; allowed, it is sent back to the CLI with a code;
the CLI posts the code and its verifier to `/app/oauth/token` and gets a new runplane
token: an organization token for the signed-in user, with the session token's role
(never more), recorded like any other (`org.token_issued`).

The code is a capability (services/surfaces/tfe/capability.py) naming the organization, user,
role, challenge and redirect, alive `CODE_TTL_S`: it is worth nothing without the
verifier only the CLI holds, and it is exchanged once across every api replica: the
exchange first writes the code's digest into the `rp-login-codes` bucket expecting no
earlier value (`update(last=0)`), which the bucket's stream leader grants to one writer
only (infra/kv.py). The consent form carries the session's CSRF token; an
admin-token session is refused (the admin token is no organization's user).

Without login.v1 in discovery (`--terraform-login token`, services/surfaces/tfe/discovery.py)
the CLI falls back to asking for a token pasted at its prompt, made by the signed-in user
at `/app/settings/tokens` (services/surfaces/ui/tokens.py) with `issue_token` below, as here.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import html
from datetime import datetime
from urllib.parse import urlencode, urlsplit

import msgspec
import nats.errors
import nats.js.errors
import structlog
from aiohttp import web
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from events import access
from events import members as mb
from events.errors import NotFound
from events.teams import LEVELS
from infra.ids import hash_token
from infra.kv import LOGIN_CODES_BUCKET
from services.surfaces.api.auth import Principal, authenticate
from services.surfaces.api.context import API, Api
from services.surfaces.api.problems import Problem
from services.surfaces.tfe.capability import CapabilityError
from services.surfaces.tfe.context import tfe_of
from services.surfaces.ui.sessions import COOKIE, SessionError, check_csrf, check_origin
from services.surfaces.ui.web import SESSIONS, read_form

CLIENT = "terraform-cli"
CLI_CLIENT = "runplane-cli"  # `runplane login --sso` (services/surfaces/client/sso.py)
CLIENTS = {CLIENT: "Terraform", CLI_CLIENT: "runplane's CLI"}
PORTS = (10000, 10010)
AUTHZ, TOKEN = "/app/oauth/authorize", "/app/oauth/token"
CODE_TTL_S = 60
KIND = "login-code"
SERVICE = {
    "client": CLIENT,
    "grant_types": ["authz_code"],
    "authz": AUTHZ,
    "token": TOKEN,
    "ports": list(PORTS),
}

log = structlog.get_logger("runplane.tfe.login")


class Grant(msgspec.Struct, frozen=True, array_like=True):
    user: str
    role: str
    challenge: str
    redirect: str
    expires: str = ""  # the session token's end (ISO 8601), which the new one keeps
    kind: str = ""  # the session token's kind, owner and ceiling, which the new one keeps
    owner: str = ""
    level: str = ""
    name: str = ""  # the new token's, after the client that asked ("Terraform login")


def token_kind(who: Principal) -> tuple[str, str, str]:
    """(kind, owner, level) of a token acting as `who` and never more: a person's own
    personal token (capped as theirs is), a team's token, or an organization token."""
    mine = who.access
    if mine.user_id:
        return "user", mine.user_id, LEVELS[mine.cap] if mine.cap < access.ADMIN else ""
    if not who.role and mine.teams:
        return "team", mine.teams[0], ""
    return "", "", ""


class _Refused(Exception):
    """An authorization request that cannot be answered by a redirect (RFC 6749 4.1.2.1:
    never redirect to a URI not known good)."""


def _page(title: str, body: str, status: int = 200) -> web.Response:
    text = (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title></head><body><h1>{html.escape(title)}</h1>"
        f"{body}</body></html>"
    )
    return web.Response(
        text=text,
        status=status,
        content_type="text/html",
        headers={"Cache-Control": "no-store", "X-Frame-Options": "DENY"},
    )


def _checked(params: dict[str, str]) -> tuple[str, str, str]:
    """The (redirect, challenge, state) of an authorization request, or _Refused."""
    if params.get("client_id") not in CLIENTS or params.get("response_type") != "code":
        raise _Refused("this page serves Terraform's and runplane's CLI login only")
    redirect = params.get("redirect_uri", "")
    parts = urlsplit(redirect)
    port_ok = parts.port is not None and PORTS[0] <= parts.port <= PORTS[1]
    if not (parts.scheme == "http" and parts.hostname == "localhost" and port_ok):
        raise _Refused("the redirect is not Terraform's own listener on localhost")
    if parts.path != "/login" or parts.query or parts.fragment or parts.username:
        raise _Refused("the redirect is not Terraform's own listener on localhost")
    challenge = params.get("code_challenge", "")
    if params.get("code_challenge_method") != "S256" or not 43 <= len(challenge) <= 128:
        raise _Refused("a PKCE code challenge (S256) is required")
    return redirect, challenge, params.get("state", "")


async def _session(request: web.Request) -> tuple[str, str, str, str, str, Principal]:
    """(org, user, role, csrf, expiry, caller) of the browser's session, or SessionError."""
    session = await request.app[SESSIONS].get(request.cookies.get(COOKIE))
    if session is None:
        raise SessionError("not signed in")
    api = request.app[API]
    who = await authenticate(api, f"Bearer {session.token}")
    if who.org is None:
        raise SessionError("signed in with the admin token, which is no organization's user")
    expiry = await token_expiry(api, session.token)
    return who.org, who.user, who.role, session.csrf, expiry, who


async def token_expiry(api: Api, token: str) -> str:
    """When `token` expires (ISO 8601), "" never: a token it makes ends no later, so an
    expiring token is never traded for one that outlives it."""
    row = await api.token(hash_token(token))
    expires = row.get("expires_at") if row is not None else None
    return str(expires) if expires else ""


def _signin_needed(detail: str, request: web.Request) -> web.Response:
    """Sign in first: with a token in another tab, or single sign-on, which comes back
    here (services/surfaces/ui/sso.py)."""
    here = html.escape(request.raw_path if request.method == "GET" else AUTHZ)
    return _page(
        "Sign in to runplane first",
        f"<p>{html.escape(detail)}.</p><p>Open <a href='/' target='_blank'>runplane</a>, sign "
        "in with your organization token, then reload this page.</p>"
        "<form method='get' action='/app/sso/start'><p>Or sign in with your organization's "
        "identity provider: <label>organization <input name='org' required></label>"
        f"<input type='hidden' name='next' value='{here}'> "
        "<button>Sign in with single sign-on</button></p></form>",
        status=401,
    )


async def authorize_page(request: web.Request) -> web.Response:
    """GET /app/oauth/authorize: what the CLI opened; asks the signed-in user."""
    params = dict(request.query)
    try:
        _checked(params)
    except _Refused as e:
        return _page("Not a login request", f"<p>{html.escape(str(e))}.</p>", status=400)
    try:
        org, user, role, csrf, _, _ = await _session(request)
    except (SessionError, Problem) as e:
        return _signin_needed(str(e), request)
    hidden = "".join(
        f"<input type='hidden' name='{html.escape(k)}' value='{html.escape(v)}'>"
        for k, v in sorted(params.items())
        if k
        in (
            "client_id",
            "response_type",
            "redirect_uri",
            "code_challenge",
            "code_challenge_method",
            "state",
        )
    )
    return _page(
        "Log in Terraform",
        f"<p>{CLIENTS[params['client_id']]} on this machine asks for a runplane token acting as "
        f"<b>{html.escape(user)}</b> ({html.escape(role)}) in organization "
        f"<b>{html.escape(org)}</b>.</p>"
        f"<form method='post' action='{AUTHZ}'>{hidden}"
        f"<input type='hidden' name='csrf' value='{html.escape(csrf)}'>"
        "<button name='decision' value='allow'>Allow</button> "
        "<button name='decision' value='deny'>Deny</button></form>",
    )


async def authorize(request: web.Request) -> web.Response:
    """POST /app/oauth/authorize: the user's answer; back to the CLI with a code."""
    try:
        check_origin(request)
        fields = {k: str(v) for k, v in (await read_form(request)).items()}
        redirect, challenge, state = _checked(fields)
    except (SessionError, _Refused, Problem) as e:
        return _page("Refused", f"<p>{html.escape(str(e))}.</p>", status=400)
    try:
        org, user, role, csrf, expires, who = await _session(request)
        check_csrf(fields.get("csrf", ""), csrf)
    except (SessionError, Problem) as e:
        return _signin_needed(str(e), request)
    if fields.get("decision") != "allow":
        answer = {"error": "access_denied", "state": state}
    else:
        kind, owner, level = token_kind(who)
        name = f"{CLIENTS[fields.get('client_id', CLIENT)]} login"
        made = Grant(user, role, challenge, redirect, expires, kind, owner, level, name)
        grant = msgspec.json.encode(made).decode()
        code = tfe_of(request).need_signer().sign(KIND, org, grant, CODE_TTL_S)
        answer = {"code": code, "state": state}
    return web.Response(status=303, headers={"Location": f"{redirect}?{urlencode(answer)}"})


def _token_error(error: str, detail: str, status: int = 400) -> web.Response:
    return web.json_response(
        {"error": error, "error_description": detail},
        status=status,
        headers={"Cache-Control": "no-store"},
    )


def _pkce(verifier: str) -> str:
    digest = hashlib.sha256(verifier.encode()).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


async def token(request: web.Request) -> web.Response:
    """POST /app/oauth/token (form): a code and its verifier for a new runplane token."""
    try:
        fields = {k: str(v) for k, v in (await read_form(request)).items()}
    except Problem as p:
        return _token_error("invalid_request", p.detail)
    if fields.get("grant_type") != "authorization_code":
        return _token_error("unsupported_grant_type", "only authorization_code")
    if fields.get("client_id", CLIENT) not in CLIENTS:
        return _token_error("invalid_client", "unknown client")
    code, verifier = fields.get("code", ""), fields.get("code_verifier", "")
    try:
        org, granted = tfe_of(request).need_signer().verify(code, KIND)
        grant = msgspec.json.decode(granted, type=Grant)
    except (CapabilityError, msgspec.DecodeError):
        return _token_error("invalid_grant", "the code is not valid (or expired)")
    if not hmac.compare_digest(_pkce(verifier).encode(), grant.challenge.encode()):
        return _token_error("invalid_grant", "the code verifier does not match")
    if fields.get("redirect_uri", grant.redirect) != grant.redirect:
        return _token_error("invalid_grant", "the redirect is not the one authorized")
    try:
        first = await request.app[TAKEN].take(code)
    except (TimeoutError, nats.errors.Error) as e:
        log.warning("login_code_store_unavailable", error=repr(e))
        return _token_error("temporarily_unavailable", "try again", status=503)
    if not first:
        return _token_error("invalid_grant", "the code was used already")
    try:
        issued = await issue_token(
            request.app[API], org, grant.user, grant.role, grant.expires,
            kind=grant.kind, owner=grant.owner, level=grant.level, name=grant.name,
        )  # fmt: skip
    except (mb.Suspended, NotFound) as e:  # suspended (or gone) since the consent
        return _token_error("invalid_grant", str(e))
    return web.json_response(
        {"access_token": issued, "token_type": "bearer"}, headers={"Cache-Control": "no-store"}
    )


async def issue_token(
    api: Api, org: str, user: str, role: str, expires: str = "", *,
    kind: str = "", owner: str = "", level: str = "", name: str = "",
) -> str:  # fmt: skip
    """A new token of `org` acting as `user` with `role` and ending at `expires` (the
    caller's own: never more, never longer; "" never), recorded as any other
    (`org.token_issued`, by that user) and in this replica's read model before it is
    shown: the CLI checks it at once, maybe on this replica."""
    expires_at = datetime.fromisoformat(expires) if expires else None
    issued, result = await api.app.issue_token(
        org, user, role, user, expires_at=expires_at, kind=kind, owner=owner, level=level,
        name=name if kind else "",
    )  # fmt: skip
    await api.after_write(result.seq)
    return issued


class TakenCodes:
    """The codes already exchanged, by any replica: the `rp-login-codes` bucket."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js
        self._kv: KeyValue | None = None

    async def take(self, code: str) -> bool:
        """Whether this call is the code's first exchange anywhere. The write expects
        the key's last revision to be none (Nats-Expected-Last-Subject-Sequence 0), which
        the stream's leader checks and appends in one step: of two replicas taking the
        same code at once, one is refused. Marks are never deleted (a delete would let
        the key be written again); the bucket drops them once the code has expired."""
        if self._kv is None:
            self._kv = await self.js.key_value(LOGIN_CODES_BUCKET)
        key = "c." + hashlib.sha256(b"rp-login-code\0" + code.encode()).hexdigest()
        try:
            await self._kv.update(key, b"taken", last=0)
        except nats.js.errors.KeyWrongLastSequenceError:
            return False
        return True


TAKEN: web.AppKey[TakenCodes] = web.AppKey("runplane.tfe.taken_codes", TakenCodes)
