"""`Idempotency-Key` on the API's POSTs: a retried request answers the first answer again.

A POST under `/api/v1/` that a bearer token authenticated and that carries the header is
run once per key: the first answer (status, body and the headers a client acts on:
Location, RP-Seq) is kept 24 h and given again to the same key with the same request;
the same key with another request (method, path, query or body bytes differ) is 422
`idempotency-key-reused`. Keys belong to one organization and one token: the bucket key
is a digest of (the path's organization, the token's digest, the key), so org A's token
reusing org B's key, or another token of the same organization, names another entry and
sees nothing of it. Routes that no bearer token authenticates (the Slack commands, the
VCS webhooks: `middleware.PUBLIC`) and the web UI's (not under /api/v1) are left alone.

Across replicas and crashes the answers live in the `rp-idempotency` bucket
(infra/kv.py), whose entries expire 24 h after their last write. What it holds
names no key and gives no answer to anyone without the token: the value is sealed
(AES-GCM) with a key derived from the bearer token itself, which only its holder has (a
POST's answer may carry a secret: a new token's clear value).

Racing requests: the first to write the entry (an expected-last-sequence-0 write, which
the server makes atomic) does the work; the others wait, bounded (`wait_s`), polling the
entry as the stream's leader has it, and answer its answer when it comes, or 409
`idempotency-in-progress` (Retry-After) when it does not in time. Waiting rather than
refusing at once: a client that retried because the first try's answer was late gets
the real answer, not an error to interpret. A reservation is a lease (`lease_s`,
renewed while the handler runs): a process killed after reserving leaves an entry that
the next request with the key takes over (a checked write on the revision it read) once
the lease has run out, so a crash costs one lease, never 24 h.

Which answers are kept: the handler's 2xx and 4xx (problems included: a refused command
is refused again). A 5xx, a 503 or an exception releases the key (the client must retry
those, and a retry may succeed); so does an answer that is not a plain body or is too
large to keep (`MAX_ANSWER`).

The body is read here once; aiohttp keeps it, so `bodies.read_body` reads the same bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import os
import re
import time
from collections.abc import Awaitable, Callable

import msgspec
import nats.errors
import nats.js.errors
import structlog
from aiohttp import web
from aiohttp.typedefs import Handler
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from nats.aio.client import Client as NATS
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE, KeyValue

from infra.directget import as_raw, leader_get
from infra.kv import IDEMPOTENCY_BUCKET, KvError
from services.surfaces.api.auth import PRINCIPAL, bearer
from services.surfaces.api.problems import Problem, refusals

log = structlog.get_logger("runplane.api")

HEADER = "Idempotency-Key"
REPLAYED = "Idempotent-Replayed"  # "true" on an answer given again
MAX_KEY = 255
_KEY_RE = re.compile(rf"[\x21-\x7e]{{1,{MAX_KEY}}}")  # printable ASCII, no space
MAX_ANSWER = 256 * 1024  # bytes of body kept; a larger answer is not remembered
LEASE_S = 30.0  # a reservation's lease, renewed every third of it while the handler runs
WAIT_S = 10.0  # how long a racing request waits for the first one's answer
POLL_S = 0.05
_KEPT_HEADERS = ("Location", "RP-Seq", "Retry-After")
_STREAM = f"KV_{IDEMPOTENCY_BUCKET}"
_PREFIX = "/api/v1/"


class Entry(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One key's record: a reservation (`status` 0) or the answer it gave."""

    fingerprint: str  # digest of method, path, query and body
    status: int = 0
    lease_until: float = 0.0  # wall clock (s); a reservation past it may be taken over
    content_type: str = ""
    headers: dict[str, str] = {}
    body: bytes = b""

    @property
    def done(self) -> bool:
        return self.status != 0


_entry_decoder = msgspec.json.Decoder(Entry)


def valid_key(key: str) -> bool:
    return _KEY_RE.fullmatch(key) is not None


def bucket_key(org: str, token_digest: str, key: str) -> str:
    """The bucket's key of an Idempotency-Key: what names it is a digest only."""
    material = b"\0".join((b"rp-idempotency", org.encode(), token_digest.encode(), key.encode()))
    return "i." + hashlib.sha256(material).hexdigest()


def fingerprint(method: str, path_qs: str, body: bytes) -> str:
    h = hashlib.sha256()
    for part in (method.encode(), path_qs.encode(), body):
        h.update(len(part).to_bytes(8, "big") + part)
    return h.hexdigest()


def _sealing_key(token: str) -> bytes:
    return hmac.new(token.encode(), b"rp-idempotency-seal", hashlib.sha256).digest()


def seal(token: str, kv_key: str, entry: Entry) -> bytes:
    nonce = os.urandom(12)
    plain = msgspec.json.encode(entry)
    return nonce + AESGCM(_sealing_key(token)).encrypt(nonce, plain, kv_key.encode())


def unseal(token: str, kv_key: str, sealed: bytes) -> Entry | None:
    """The entry, or None if it does not open with this token (not its own: a digest
    collision, or a value written by something else)."""
    try:
        plain = AESGCM(_sealing_key(token)).decrypt(sealed[:12], sealed[12:], kv_key.encode())
        return _entry_decoder.decode(plain)
    except (InvalidTag, ValueError, msgspec.DecodeError):
        return None


class Found(msgspec.Struct, frozen=True, kw_only=True):
    entry: Entry | None  # None: no live entry (never written, deleted, expired, unreadable)
    revision: int  # the subject's last sequence (0: none): what a checked write expects


class Idempotency:
    """The answers of every api replica, in the `rp-idempotency` bucket."""

    def __init__(
        self,
        nc: NATS,
        *,
        lease_s: float = LEASE_S,
        wait_s: float = WAIT_S,
        clock: Callable[[], float] = time.time,
        timeout: float = 5.0,
    ) -> None:
        self.nc = nc
        self.lease_s = lease_s
        self.wait_s = wait_s
        self.clock = clock
        self.timeout = timeout
        self._kv: KeyValue | None = None

    async def bucket(self) -> KeyValue:
        if self._kv is None:
            js = self.nc.jetstream(timeout=self.timeout)
            self._kv = await js.key_value(IDEMPOTENCY_BUCKET)
        return self._kv

    async def read(self, token: str, kv_key: str) -> Found:
        """The entry as the stream's leader has it (a follower behind would show an
        answer stored a moment ago through another replica as missing)."""
        raw = await leader_get(
            self.nc,
            _STREAM,
            as_raw,
            subject=f"$KV.{IDEMPOTENCY_BUCKET}.{kv_key}",
            what="an idempotency key",
            error=KvError,
            timeout=self.timeout,
        )
        if raw is None:
            return Found(entry=None, revision=0)
        if raw.headers.get(KV_OP) in (KV_DEL, KV_PURGE) or not raw.data:
            return Found(entry=None, revision=raw.seq)
        return Found(entry=unseal(token, kv_key, raw.data), revision=raw.seq)

    async def write(self, token: str, kv_key: str, entry: Entry, last: int) -> int | None:
        """Write the entry if the key's last revision is `last` (0: none); its new
        revision, or None if another writer came first."""
        bucket = await self.bucket()
        try:
            return await bucket.update(kv_key, seal(token, kv_key, entry), last=last)
        except nats.js.errors.KeyWrongLastSequenceError:
            return None

    async def release(self, kv_key: str, revision: int) -> None:
        """Give a reservation up (the answer is not to be kept); a failure only costs
        the key its lease."""
        try:
            bucket = await self.bucket()
            await bucket.delete(kv_key, last=revision)
        except (TimeoutError, nats.errors.Error) as e:
            log.warning("idempotency_release_failed", error=repr(e))

    def reservation(self, fp: str) -> Entry:
        return Entry(fingerprint=fp, lease_until=self.clock() + self.lease_s)


IDEMPOTENCY: web.AppKey[Idempotency] = web.AppKey("runplane.idempotency", Idempotency)

PARAMETER = {
    "name": HEADER,
    "in": "header",
    "required": False,
    "description": "the same key with the same request answers the first answer again for "
    "24 h (header Idempotent-Replayed: true); with another request, 422 "
    "idempotency-key-reused; while the first is in progress, 409 idempotency-in-progress. "
    "Keys are per organization and token",
    "schema": {"type": "string", "minLength": 1, "maxLength": MAX_KEY, "pattern": "^[!-~]+$"},
}


class _Request(msgspec.Struct, frozen=True, kw_only=True):
    token: str
    kv_key: str
    fingerprint: str


def _scoped(request: web.Request) -> _Request | None:
    """The key's scope if the middleware takes this request, else None."""
    key = request.headers.get(HEADER)
    if key is None or request.method != "POST" or not request.path.startswith(_PREFIX):
        return None
    who = request.get(PRINCIPAL)
    if who is None:  # public: Slack, webhooks sign their own calls
        return None
    org = request.match_info.get("org", "")
    if org and not who.superuser and who.org != org:
        return None  # another organization's path: its handler answers 404, never a key's
    if not valid_key(key):
        raise Problem(
            "invalid-header",
            f"{HEADER} must be 1 to {MAX_KEY} printable ASCII characters without spaces",
        )
    token = bearer(request.headers.get("Authorization"))
    digest = hashlib.sha256(token.encode()).hexdigest()
    return _Request(token=token, kv_key=bucket_key(org, digest, key), fingerprint="")


@web.middleware
async def idempotent(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer a POST with an Idempotency-Key once per key (module docstring)."""
    scoped = _scoped(request)
    if scoped is None:
        return await handler(request)
    body = await request.read()  # kept by aiohttp: read_body gets the same bytes
    fp = fingerprint(request.method, request.path_qs, body)
    scoped = msgspec.structs.replace(scoped, fingerprint=fp)
    store = request.app[IDEMPOTENCY]
    try:
        return await _once(store, scoped, lambda: refusals(request, handler))
    except (KvError, TimeoutError, nats.errors.Error) as e:
        log.warning("idempotency_unavailable", error=repr(e))
        raise Problem("unavailable", "the idempotency store is unavailable; try again") from e


async def _once(
    store: Idempotency, req: _Request, work: Callable[[], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Reserve the key and do the work, or answer what the key's first request did."""
    deadline = time.monotonic() + store.wait_s
    last: int | None = 0  # the revision a reservation expects (0: none, the common case)
    while True:
        if last is not None:
            reservation = store.reservation(req.fingerprint)
            revision = await store.write(req.token, req.kv_key, reservation, last)
            if revision is not None:
                return await _reserved(store, req, revision, work)
        found = await store.read(req.token, req.kv_key)
        entry = found.entry
        if entry is not None and entry.fingerprint != req.fingerprint:
            raise Problem(
                "idempotency-key-reused",
                f"this {HEADER} was used for another request in the last 24 h",
            )
        if entry is not None and entry.done:
            return _answer(entry)
        if time.monotonic() >= deadline:
            raise Problem(
                "idempotency-in-progress",
                f"a request with this {HEADER} is still being handled; try again",
                headers={"Retry-After": "1"},
            )
        if entry is None or entry.lease_until <= store.clock():
            last = found.revision  # free, or its holder's lease ran out: take it over
            continue
        last = None  # held: wait for its answer
        await asyncio.sleep(POLL_S)


async def _reserved(
    store: Idempotency,
    req: _Request,
    revision: int,
    work: Callable[[], Awaitable[web.StreamResponse]],
) -> web.StreamResponse:
    """Do the work under the reservation (its lease renewed meanwhile), then keep the
    answer or give the key up."""
    held = [revision]
    renewing = asyncio.create_task(_renew(store, req, held))
    try:
        response = await work()
    except BaseException:
        renewing.cancel()
        await _stop(renewing)
        await store.release(req.kv_key, held[0])
        raise
    renewing.cancel()
    await _stop(renewing)
    entry = _entry_of(req.fingerprint, response)
    if entry is None:
        await store.release(req.kv_key, held[0])
        return response
    try:
        if await store.write(req.token, req.kv_key, entry, held[0]) is None:
            log.warning("idempotency_answer_not_kept", status=response.status)  # taken over
    except (TimeoutError, nats.errors.Error) as e:
        # The work is done: answer it. The key stays reserved until its lease runs out
        # (a retry in that time waits, then is told 409), then a retry does it again.
        log.warning("idempotency_answer_not_kept", status=response.status, error=repr(e))
    return response


async def _stop(task: asyncio.Task[None]) -> None:
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _renew(store: Idempotency, req: _Request, held: list[int]) -> None:
    """Move the reservation's lease on every third of it, while it is still ours."""
    while True:
        await asyncio.sleep(store.lease_s / 3)
        try:
            revision = await store.write(
                req.token, req.kv_key, store.reservation(req.fingerprint), held[0]
            )
        except (TimeoutError, nats.errors.Error) as e:
            log.warning("idempotency_lease_not_renewed", error=repr(e))
            continue
        if revision is None:
            return  # taken over: the work goes on, its answer will not be kept
        held[0] = revision


def _entry_of(fp: str, response: web.StreamResponse) -> Entry | None:
    """What to keep of an answer: a 2xx or 4xx plain body within `MAX_ANSWER`, but not
    a refusal of the caller's authority (401, 403): that depends on the caller's rights at
    the moment, which may be granted within the 24 h, and a key it bound would answer a
    caller who may not act here with the key's own refusals (found by the API fuzzer)."""
    if not isinstance(response, web.Response) or response.status >= 500:
        return None
    if response.status in (401, 403):
        return None
    body = response.body
    if body is None:
        body = b""
    if not isinstance(body, bytes) or len(body) > MAX_ANSWER:
        return None
    kept = {h: response.headers[h] for h in _KEPT_HEADERS if h in response.headers}
    return Entry(
        fingerprint=fp,
        status=response.status,
        content_type=response.headers.get("Content-Type", ""),
        headers=kept,
        body=body,
    )


def _answer(entry: Entry) -> web.Response:
    """The kept answer, given again."""
    headers = dict(entry.headers) | {REPLAYED: "true"}
    if entry.content_type:
        headers["Content-Type"] = entry.content_type
    return web.Response(status=entry.status, body=entry.body, headers=headers)
