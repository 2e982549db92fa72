"""Browser sessions of the web UI: a token given once at sign-in, a cookie after.

The cookie (`rp_session`) carries only a random session id: `HttpOnly` (no script reads
it), `SameSite=Strict` (no other site's page sends it), `Secure` when the request came by
TLS. The server keeps the session (its token, organization and CSRF token) in memory,
so signing out ends it here whatever the browser keeps. Each request authenticates the
session's token again (services/api/auth.py), so a token revoked or expired ends its
sessions at once. A sign-in always mints a new id (no fixation: an id planted before it
is never promoted), and a session is bound to the one organization it signed in to.

CSRF: every form carries the session's token (`csrf`), compared in constant time; the
sign-in form, before any session, carries the value of a pre-session cookie
(`rp_presign`, double submit). A cross-origin `Origin` header is refused as well.

Sessions live in this process: behind several api replicas a browser needs sticky
routing (or signs in again on another replica).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass

from aiohttp import web

COOKIE = "rp_session"
PRESIGN = "rp_presign"
IDLE_S = 8 * 3600  # a session unused this long is gone
MAX_SESSIONS = 10_000  # per process; the least recently used goes first


@dataclass
class Session:
    """One signed-in browser: its token (never sent back), organization and CSRF token."""

    token: str
    org: str
    csrf: str
    used: float


class SessionError(Exception):
    """A request without a valid session or CSRF token. Never retryable: sign in again."""

    retryable = False


def _key(session_id: str) -> str:
    # Only a digest is kept: a dump of the process's memory names no usable cookie.
    return hashlib.sha256(session_id.encode()).hexdigest()


class Sessions:
    """The sessions of this process, least recently used first."""

    def __init__(self, *, idle_s: float = IDLE_S, limit: int = MAX_SESSIONS) -> None:
        self.idle_s = idle_s
        self.limit = limit
        self._by_key: OrderedDict[str, Session] = OrderedDict()

    def start(self, token: str, org: str) -> tuple[str, Session]:
        """A new session with a fresh id (the cookie's value) and CSRF token."""
        session_id = secrets.token_urlsafe(32)
        session = Session(token=token, org=org, csrf=secrets.token_urlsafe(32), used=time.time())
        self._by_key[_key(session_id)] = session
        while len(self._by_key) > self.limit:
            self._by_key.popitem(last=False)
        return session_id, session

    def get(self, session_id: str | None) -> Session | None:
        """The live session of a cookie's id, or None."""
        if not session_id:
            return None
        key = _key(session_id)
        session = self._by_key.get(key)
        if session is None:
            return None
        now = time.time()
        if now - session.used > self.idle_s:
            del self._by_key[key]
            return None
        session.used = now
        self._by_key.move_to_end(key)
        return session

    def end(self, session_id: str | None) -> None:
        """Forget the session: its cookie is worthless from now on."""
        if session_id:
            self._by_key.pop(_key(session_id), None)

    def end_token(self, token: str) -> None:
        """Forget every session signed in with `token` (it was found revoked or expired)."""
        for key in [k for k, s in self._by_key.items() if s.token == token]:
            del self._by_key[key]


def secure(request: web.Request) -> bool:
    """Whether the browser reached us by TLS (directly, or as a proxy says it)."""
    return request.secure


def set_cookie(response: web.StreamResponse, request: web.Request, name: str, value: str) -> None:
    response.set_cookie(
        name,
        value,
        httponly=True,
        samesite="Strict",
        secure=secure(request),
        path="/",
    )


def same(a: str, b: str) -> bool:
    """Constant-time equality of two tokens (empty never matches)."""
    return bool(a) and bool(b) and hmac.compare_digest(a.encode(), b.encode())


def check_origin(request: web.Request) -> None:
    """Refuse a post whose Origin names another site (browsers send it on every post)."""
    origin = request.headers.get("Origin")
    if origin is None:  # not a browser's post; the CSRF token still decides
        return
    expected = f"{request.scheme}://{request.host}"
    if origin != expected:
        raise SessionError(f"the request came from another origin ({origin})")


def check_csrf(sent: str, expected: str) -> None:
    if not same(sent, expected):
        raise SessionError("the form's CSRF token is missing or wrong: reload the page")
