"""Browser sessions of the web UI: a token given once at sign-in, a cookie after.

The cookie (`rp_session`) carries only a random session id: `HttpOnly` (no script reads
it), `SameSite=Strict` (no other site's page sends it), `Secure` when the request came by
TLS (to this process, or to the deployment's TLS proxy when it says it has one:
`--behind-tls-proxy`; else X-Forwarded-Proto is a client's word, ignored).

The server keeps the session (its token, organization and CSRF token) in a NATS bucket
(`rp-ui-sessions`, infra/kv.py) that every api replica reads, so a browser
signed in through one replica is signed in on all, and signing out on any ends it on
all, whatever the browser keeps. Signing out of a single sign-on session also revokes
the token the sign-in made for it (`org.token_revoked`: every replica refuses it from
the answer on), so neither a copied cookie nor that token works after. Each request
authenticates the session's token again (services/surfaces/api/auth.py), so a token
revoked or expired ends its sessions at once. A sign-in always mints a new id (no
fixation: an id planted before it is never promoted), and a session is bound to the one
organization it signed in to.

What the bucket holds names no usable cookie and no token: the key is a digest of the
session id, the value is sealed (AES-GCM) with a key derived from that id, which only the
browser has. Sessions are read from the bucket's stream leader: a follower behind would
miss a session just started on another replica, or still show one just ended there.

CSRF: every form carries the session's token (`csrf`), compared in constant time; the
sign-in form, before any session, carries the value of a pre-session cookie
(`rp_presign`, double submit). A cross-origin `Origin` header is refused as well.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time

import msgspec
import nats.errors
import nats.js.errors
from aiohttp import web
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from nats.aio.client import Client as NATS
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE, KeyValue

from infra import kv
from infra.directget import as_raw, leader_get
from infra.kv import UI_SESSION_IDLE_S, UI_SESSIONS_BUCKET, KvError

COOKIE = "rp_session"
PRESIGN = "rp_presign"
IDLE_S = UI_SESSION_IDLE_S  # a session unused this long is gone
PER_TOKEN = 100  # sessions of one token; the least recently used goes first
# A session's "last used" is written back at most this often: a page costs one leader
# read, not a write as well; the bucket's own expiry (IDLE_S) counts from that write.
TOUCH_S = 60.0
_STREAM = f"KV_{UI_SESSIONS_BUCKET}"


class Session(msgspec.Struct, kw_only=True):
    """One signed-in browser: its token (never sent back), organization and CSRF token.
    `minted`: the token was made for this session (single sign-on's), so signing out
    revokes it; a token the person pasted at sign-in is theirs to keep."""

    token: str
    org: str
    csrf: str
    used: float
    minted: bool = False


class SessionError(Exception):
    """A request without a valid session or CSRF token. Never retryable: sign in again."""

    retryable = False


def _key(session_id: str) -> str:
    # Only a digest names the entry: a copy of the bucket names no usable cookie.
    return "s." + hashlib.sha256(b"rp-ui-session\0" + session_id.encode()).hexdigest()


def _sealing_key(session_id: str) -> bytes:
    return hmac.new(session_id.encode(), b"rp-ui-session-seal", hashlib.sha256).digest()


def _token_ref(token: str) -> str:
    """What the index of a token's sessions is keyed by (not the token's API digest)."""
    return hashlib.sha256(b"rp-ui-token\0" + token.encode()).hexdigest()[:40]


def _index(token: str, key: str) -> str:
    return f"t.{_token_ref(token)}.{key[2:]}"


def _seal(session_id: str, key: str, session: Session) -> bytes:
    nonce = os.urandom(12)
    return nonce + AESGCM(_sealing_key(session_id)).encrypt(
        nonce, msgspec.json.encode(session), key.encode()
    )


def _unseal(session_id: str, key: str, sealed: bytes) -> Session | None:
    try:
        plain = AESGCM(_sealing_key(session_id)).decrypt(sealed[:12], sealed[12:], key.encode())
        return msgspec.json.decode(plain, type=Session)
    except (InvalidTag, ValueError, msgspec.DecodeError):
        return None


class Sessions:
    """The sessions of every api replica, in the `rp-ui-sessions` bucket."""

    def __init__(
        self,
        nc: NATS,
        *,
        idle_s: float = IDLE_S,
        per_token: int = PER_TOKEN,
        touch_s: float = TOUCH_S,
        timeout: float = 5.0,
    ) -> None:
        self.nc = nc
        self.idle_s = idle_s
        self.per_token = per_token
        self.touch_s = touch_s
        self.timeout = timeout
        self._kv: KeyValue | None = None

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            self._kv = await self.nc.jetstream(timeout=self.timeout).key_value(UI_SESSIONS_BUCKET)
        return self._kv

    async def start(self, token: str, org: str, *, minted: bool = False) -> tuple[str, Session]:
        """A new session with a fresh id (the cookie's value) and CSRF token."""
        session_id = secrets.token_urlsafe(32)
        session = Session(
            token=token, org=org, csrf=secrets.token_urlsafe(32), used=time.time(), minted=minted
        )
        key = _key(session_id)
        try:
            bucket = await self._bucket()
            await self._make_room(bucket, token)
            await bucket.put(key, _seal(session_id, key, session))
            await bucket.put(_index(token, key), _used(session.used))
        except (TimeoutError, nats.errors.Error) as e:
            raise KvError(f"starting a session: {e!r}") from e
        return session_id, session

    async def _make_room(self, bucket: KeyValue, token: str) -> None:
        """End the token's least recently used sessions past `per_token - 1`."""
        pattern = f"t.{_token_ref(token)}.*"
        found = await kv.leader_last_values(
            self.nc, UI_SESSIONS_BUCKET, pattern, timeout=self.timeout
        )
        if len(found) < self.per_token:
            return
        by_use = sorted(found, key=lambda k: _used_of(found[k]))
        for index in by_use[: len(found) - self.per_token + 1]:
            await bucket.delete("s." + index.rsplit(".", 1)[1])
            await bucket.delete(index)

    async def get(self, session_id: str | None) -> Session | None:
        """The live session of a cookie's id, or None (read from the stream's leader)."""
        if not session_id:
            return None
        key = _key(session_id)
        try:
            found = await self._leader_get(key)
            if found is None:
                return None
            sealed, revision = found
            session = _unseal(session_id, key, sealed)
            if session is None:
                return None
            now = time.time()
            if now - session.used > self.idle_s:
                await self._drop(key, session.token)
                return None
            if now - session.used >= self.touch_s:
                await self._touch(session_id, key, session, revision, now)
            return session
        except (TimeoutError, nats.errors.Error) as e:
            raise KvError(f"reading a session: {e!r}") from e

    async def _leader_get(self, key: str) -> tuple[bytes, int] | None:
        subject = f"$KV.{UI_SESSIONS_BUCKET}.{key}"
        raw = await leader_get(
            self.nc,
            _STREAM,
            as_raw,
            subject=subject,
            what="a session",
            error=KvError,
            timeout=self.timeout,
        )
        if raw is None or raw.headers.get(KV_OP) in (KV_DEL, KV_PURGE) or not raw.data:
            return None
        return raw.data, raw.seq

    async def _touch(
        self, session_id: str, key: str, session: Session, revision: int, now: float
    ) -> None:
        """Write back "last used", unless the entry changed since it was read (ended on
        another replica: a plain put would bring it back)."""
        session.used = now
        bucket = await self._bucket()
        try:
            await bucket.update(key, _seal(session_id, key, session), last=revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            return
        await bucket.put(_index(session.token, key), _used(now))

    async def _drop(self, key: str, token: str) -> None:
        bucket = await self._bucket()
        await bucket.delete(key)
        await bucket.delete(_index(token, key))

    async def end(self, session_id: str | None) -> None:
        """Forget the session on every replica: its cookie is worthless from now on."""
        if not session_id:
            return
        key = _key(session_id)
        try:
            found = await self._leader_get(key)
            session = _unseal(session_id, key, found[0]) if found else None
            if session is not None:
                await self._drop(key, session.token)
        except (TimeoutError, nats.errors.Error) as e:
            raise KvError(f"ending a session: {e!r}") from e

    async def end_token(self, token: str) -> None:
        """Forget every session signed in with `token` (it was found revoked or expired)."""
        pattern = f"t.{_token_ref(token)}.*"
        try:
            found = await kv.leader_last_values(
                self.nc, UI_SESSIONS_BUCKET, pattern, timeout=self.timeout
            )
            bucket = await self._bucket()
            for index in found:
                await bucket.delete("s." + index.rsplit(".", 1)[1])
                await bucket.delete(index)
        except (TimeoutError, nats.errors.Error) as e:
            raise KvError(f"ending a token's sessions: {e!r}") from e


def _used(at: float) -> bytes:
    return json.dumps({"used": at}).encode()


def _used_of(raw: bytes) -> float:
    try:
        return float(json.loads(raw)["used"])
    except (ValueError, KeyError, TypeError):
        return 0.0


# Whether the deployment says browsers come through a TLS proxy that sets
# X-Forwarded-Proto (`--behind-tls-proxy`). Off, the header is a client's word and ignored.
TLS_PROXY: web.AppKey[bool] = web.AppKey("runplane.ui.tls_proxy", bool)


def scheme(request: web.Request) -> str:
    """How the browser reached us: TLS to this process, or, behind the deployment's TLS
    proxy, what that proxy says (the last X-Forwarded-Proto value: the nearest hop's)."""
    if request.secure:
        return "https"
    if request.app.get(TLS_PROXY, False):
        forwarded = request.headers.get("X-Forwarded-Proto", "")
        if forwarded.rsplit(",", 1)[-1].strip().lower() == "https":
            return "https"
    return "http"


def secure(request: web.Request) -> bool:
    """Whether the browser reached us by TLS (directly, or as the deployment's proxy says)."""
    return scheme(request) == "https"


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
    expected = f"{scheme(request)}://{request.host}"
    if origin != expected:
        raise SessionError(f"the request came from another origin ({origin})")


def check_csrf(sent: str, expected: str) -> None:
    if not same(sent, expected):
        raise SessionError("the form's CSRF token is missing or wrong: reload the page")
