"""The organization's audit log over HTTP, and what the api adds to it.

- `GET /api/v1/orgs/{org}/audit`: the organization's records, oldest first, filtered by
  `actor`, `action` (exact, or a prefix ending in `*`), `thing` (likewise), `outcome`
  (`ok` | `refused`), `since` / `until` (RFC 3339), paged by `cursor` (the `next` of the
  page before: a stream sequence) and `limit` (1 to 1000, default 100); `format=jsonl`
  answers JSON lines (`application/x-ndjson`, the next cursor in `RP-Audit-Next`). Each
  item is the record as stored with its stream sequence `seq` and `hash` (SHA-256 of its
  stored bytes: what the next record's `prev` is). A page reads at most `SCAN` records,
  so a filter matching little answers fewer items with a `next` to go on from. Action
  `audit.read`: organization admins and teams with the right `read-audit`.
- `GET /api/v1/audit/keys`: the checkpoints' public keys (no tenant data; public), for
  an auditor to pin (`runplane audit verify --pubkey FILE`).
- `audit_requests`, a middleware: every request's origin (request id: the caller's
  `X-Request-Id` when it is a short token, else a new one, answered in `X-Request-Id`;
  the client's address, behind the deployment's TLS proxy the nearest hop's
  X-Forwarded-For (`client_address`, the device flow's too); the surface: `ui`, `tfe`,
  `cli` for runplane's own client, else `api`) goes into the headers of the events it
  appends (infra/origin.py), and a refusal that matters (403; 409 on approve, discard,
  cancel, lock, unlock) of a caller of the path's organization is recorded in that
  organization's chain where it happens: at most `FLOOD_LIMIT` a minute of one caller in
  one organization (`ORG_FLOOD_LIMIT` of all its callers) per api process, the others
  counted and the count put on the next one recorded (`more`), so a caller flooding
  refusals grows no chain nor the shared stream without bound, nor holds the chain's
  writers (the auditor's appends to it included) in a race.
"""

from __future__ import annotations

import re
import time
import uuid
from collections import Counter, deque
from datetime import datetime
from typing import Any
from weakref import WeakKeyDictionary

import msgspec
import structlog
from aiohttp import web

from events.audit import OK, REFUSED, Facts, Record, decode
from events.audit_stream import answered
from events.errors import DomainError
from infra import auditkeys, origin
from infra.auditlog import AuditLog
from infra.directget import InfraError
from infra.ids import utcnow
from services.surfaces.api import audit_stream
from services.surfaces.api.auth import PRINCIPAL, Principal
from services.surfaces.api.bodies import check_name
from services.surfaces.api.common import scope
from services.surfaces.api.context import API
from services.surfaces.api.problems import Problem, from_domain
from services.surfaces.api.schemas import Doc, operation
from services.surfaces.ui.sessions import TLS_PROXY

log = structlog.get_logger("runplane.api")

KEYS_PATH = "/api/v1/audit/keys"
SCAN = 10_000  # records one page reads at most
MAX_LIMIT = 1000
REQUEST_ID = "X-Request-Id"
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
_CLIENT_HEADER = "X-Runplane-Client"
_CONFLICTS = ("/approve", "/discard", "/cancel", "/lock", "/unlock")
_FILTERS = ("actor", "action", "thing", "outcome", "since", "until", "cursor", "limit", "format")
_encoder = msgspec.json.Encoder()
FLOOD_LIMIT = 60  # refusals of one caller in one organization recorded a window, per process
ORG_FLOOD_LIMIT = 600  # of all callers in one organization (an admin mints callers at will)
FLOOD_WINDOW_S = 60.0


class Flood:
    """Which refusals are recorded: at most `limit` of one key (organization, caller) and
    `org_limit` of one organization in `window` seconds; the others are counted until
    the key's next one admitted, which carries the count."""

    def __init__(self, limit: int, org_limit: int, window: float) -> None:
        self.limit, self.org_limit, self.window = limit, org_limit, window
        self.seen: dict[tuple[str, ...], deque[float]] = {}
        self.skipped: Counter[tuple[str, ...]] = Counter()

    def _recent(self, key: tuple[str, ...], now: float) -> deque[float]:
        times = self.seen.setdefault(key, deque())
        while times and now - times[0] >= self.window:
            times.popleft()
        return times

    def admit(self, key: tuple[str, ...], now: float) -> int | None:
        """None: not recorded (counted); else how many were not, before this one."""
        if len(self.seen) > 10_000:  # forget the quiet ones
            self.seen = {k: v for k, v in self.seen.items() if v and now - v[-1] < self.window}
        mine, org = self._recent(key, now), self._recent(key[:1], now)
        if len(mine) >= self.limit or len(org) >= self.org_limit:
            self.skipped[key] += 1
            if self.skipped[key] % 1000 == 1:
                log.warning("audit_refusals_flood", key=key, unrecorded=self.skipped[key])
            return None
        mine.append(now)
        org.append(now)
        return self.skipped.pop(key, 0)


_floods: WeakKeyDictionary[object, Flood] = WeakKeyDictionary()


def _flood(api: object) -> Flood:
    found = _floods.get(api)
    if found is None:
        found = _floods[api] = Flood(FLOOD_LIMIT, ORG_FLOOD_LIMIT, FLOOD_WINDOW_S)
    return found


def client_address(request: web.Request) -> str:
    """The caller's address: the peer's, or behind the deployment's TLS proxy
    (`--behind-tls-proxy`) the nearest hop's X-Forwarded-For (else it is a client's
    word, ignored). Printable text only, at most 64 characters."""
    found = request.remote or "unknown"
    if request.app.get(TLS_PROXY, False):
        forwarded = request.headers.get("X-Forwarded-For", "").rsplit(",", 1)[-1].strip()
        found = forwarded or found
    return "".join(c for c in found if c.isprintable() and c != " ")[:64] or "unknown"


def _request_id(request: web.Request) -> str:
    given = request.headers.get(REQUEST_ID, "")
    return given if _REQUEST_ID_RE.fullmatch(given) else uuid.uuid4().hex


def _via(request: web.Request) -> str:
    path = request.path
    if path.startswith("/api/v2/") or path.startswith("/.well-known/terraform"):
        return "tfe"
    if not path.startswith("/api/"):
        return "ui"
    return "cli" if request.headers.get(_CLIENT_HEADER, "").lower() == "cli" else "api"


def actor_kind(who: Principal) -> str:
    """admin (the deployment's token), user (a personal token), token (an organization
    token of a role) or team (a team token)."""
    if who.superuser:
        return "admin"
    if who.access.user_id:
        return "user"
    return "token" if who.role else "team"


@web.middleware
async def audit_requests(request: web.Request, handler: Any) -> web.StreamResponse:
    """The request's origin for its events, and its refusals on the record."""
    here = origin.Origin(
        request_id=_request_id(request), client=client_address(request), via=_via(request)
    )
    token = origin.current.set(here)
    try:
        response: web.StreamResponse = await handler(request)
    except (Problem, DomainError) as e:
        problem = e if isinstance(e, Problem) else from_domain(e)
        problem.headers[REQUEST_ID] = here.request_id
        await record_refusal(request, problem)
        if problem is e:
            raise
        raise problem from e
    finally:
        origin.current.reset(token)
    if not response.prepared:
        response.headers[REQUEST_ID] = here.request_id
    return response


def _matters(request: web.Request, problem: Problem) -> bool:
    if problem.status == 403:
        return True
    return problem.status == 409 and request.path.endswith(_CONFLICTS)


async def record_refusal(request: web.Request, problem: Problem) -> None:
    """Record a refusal that matters in the path's organization's chain, when the caller
    is of that organization (another's is answered 404 and recorded nowhere: nobody
    writes into a chain not theirs). The middleware calls it for every refusal raised; a
    surface that answers a refusal itself (the UI's run page) calls it too."""
    who = request.get(PRINCIPAL)
    raw_org = request.match_info.get("org", "")
    if who is None or not raw_org or not _matters(request, problem):
        return
    try:
        org = check_name("org", raw_org)
    except Problem:
        return
    if not who.superuser and who.org != org:
        return
    thing = _thing(request.match_info, org)
    await append_refusal(request, org, status=problem.status, detail=problem.slug, thing=thing)


async def append_refusal(
    request: web.Request, org: str, *, status: int, detail: str, thing: str
) -> None:
    """Append the request's refusal (`status`, `detail` a stable slug, on `thing`) to
    `org`'s chain under the flood limits (module docstring), shared by every surface of
    this api process: the caller decided whose chain it is."""
    who = request.get(PRINCIPAL)
    here = origin.current.get()
    if who is None or here is None:
        return
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else request.path
    more = _flood(request.app[API]).admit((org, actor_kind(who), who.user), time.monotonic())
    if more is None:
        return
    facts = Facts(
        org=org, at=utcnow(), actor=who.user, actor_kind=actor_kind(who), via=here.via,
        action=f"refused {request.method} {route}", thing=thing,
        outcome=REFUSED, status=status, detail=detail,
        request_id=here.request_id, client=here.client, more=more,
    )  # fmt: skip
    try:
        await request.app[API].audit.append(facts)
    except InfraError as e:  # the refusal stands; the log says it went unrecorded
        log.warning("audit_refusal_unrecorded", org=org, error=str(e))


def _thing(match: Any, org: str) -> str:
    if "run" in match:
        return f"run {match['run']}"
    if "ws" in match:
        return f"workspace {match['ws']}"
    return f"organization {org}"


# ------------------------------------------------------------ reading


class Query(msgspec.Struct, frozen=True, kw_only=True):
    actor: str = ""
    action: str = ""
    thing: str = ""
    outcome: str = ""
    since: datetime | None = None
    until: datetime | None = None
    cursor: int = 0
    limit: int = 100
    jsonl: bool = False

    def keeps(self, r: Record) -> bool:
        return (
            (not self.actor or r.actor == self.actor)
            and _matches(self.action, r.action)
            and _matches(self.thing, r.thing)
            and (not self.outcome or r.outcome == self.outcome)
            and (self.since is None or r.at >= self.since)
            and (self.until is None or r.at < self.until)
        )


def _matches(wanted: str, value: str) -> bool:
    if not wanted:
        return True
    if wanted.endswith("*"):
        return value.startswith(wanted[:-1])
    return value == wanted


def query(params: Any) -> Query:
    """The page asked for, or 400 invalid-query."""
    unknown = sorted(set(params) - set(_FILTERS))
    if unknown:
        raise Problem("invalid-query", f"unknown query parameter {', '.join(unknown)}")
    outcome = params.get("outcome", "")
    if outcome not in ("", OK, REFUSED):
        raise Problem("invalid-query", "outcome must be ok or refused")
    fmt = params.get("format", "json")
    if fmt not in ("json", "jsonl"):
        raise Problem("invalid-query", "format must be json or jsonl")
    return Query(
        actor=params.get("actor", ""), action=params.get("action", ""),
        thing=params.get("thing", ""), outcome=outcome,
        since=_time(params, "since"), until=_time(params, "until"),
        cursor=_int(params, "cursor", 0, 0, 2**63 - 1),
        limit=_int(params, "limit", 100, 1, MAX_LIMIT), jsonl=fmt == "jsonl",
    )  # fmt: skip


def _time(params: Any, key: str) -> datetime | None:
    raw = params.get(key)
    if raw is None:
        return None
    try:
        at = datetime.fromisoformat(raw)
    except ValueError:
        at = None
    if at is None or at.tzinfo is None:
        raise Problem("invalid-query", f"{key} must be an RFC 3339 time with its offset")
    return at


def _int(params: Any, key: str, default: int, lo: int, hi: int) -> int:
    raw = params.get(key)
    if raw is None:
        return default
    if not raw.isdigit() or not lo <= int(raw) <= hi:
        raise Problem("invalid-query", f"{key} must be a whole number from {lo} to {hi}")
    return int(raw)


async def read_page(audit: AuditLog, org: str, q: Query) -> tuple[list[dict[str, Any]], int]:
    """The page's items and the cursor after it (0: the end of the chain)."""
    out: list[dict[str, Any]] = []
    start, scanned = q.cursor + 1, 0
    while scanned < SCAN:
        page = await audit.page(org, start)
        for raw in page:
            scanned += 1
            start = raw.seq + 1
            try:
                record = decode(raw.data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue  # not a record: `runplane audit verify` names it
            if q.keeps(record):
                out.append(answered(raw.seq, raw.data, record))
                if len(out) == q.limit:
                    return out, raw.seq
        if len(page) < 1000:
            return out, 0
    return out, start - 1


async def org_audit(request: web.Request) -> web.StreamResponse:
    """The organization's audit records (module docstring)."""
    _, org, _ = await scope(request, "audit.read")
    q = query(request.query)
    items, nxt = await read_page(request.app[API].audit, org, q)
    if q.jsonl:
        body = b"".join(_encoder.encode(i) + b"\n" for i in items)
        headers = {"RP-Audit-Next": str(nxt)} if nxt else {}
        return web.Response(body=body, content_type="application/x-ndjson", headers=headers)
    return web.Response(
        body=_encoder.encode({"items": items, "next": nxt or None}),
        content_type="application/json",
    )


async def keys(request: web.Request) -> web.Response:
    """The audit checkpoints' public keys."""
    found, _ = await auditkeys.read(request.app[API].app.store.nc)
    return web.Response(
        body=_encoder.encode({"keys": auditkeys.published(found)}),
        content_type="application/json",
        headers={"Cache-Control": "public, max-age=300"},
    )


ROUTES = [
    web.get("/api/v1/orgs/{org}/audit", org_audit, allow_head=False),
    web.get(KEYS_PATH, keys, allow_head=False),
    *audit_stream.ROUTES,  # where the log is streamed (a SIEM)
]


# ------------------------------------------------------------ the API reference

_QUERY = (
    ("actor", "exactly this actor"),
    ("action", "exactly this action, or a prefix ending in *"),
    ("thing", "exactly this thing, or a prefix ending in *"),
    ("outcome", "ok or refused"),
    ("since", "RFC 3339: records at or after"),
    ("until", "RFC 3339: records before"),
    ("cursor", "the previous page's next"),
    ("limit", "1 to 1000 (100)"),
    ("format", "json (default) or jsonl"),
)
PARAMETERS: dict[str, Doc] = {
    f"audit_{n}": {"name": n, "in": "query", "required": False, "schema": {"type": "string"},
                   "description": d}
    for n, d in _QUERY
} | audit_stream.PARAMETERS  # fmt: skip
SCHEMAS: dict[str, Doc] = {
    "AuditPage": {
        "type": "object",
        "required": ["items", "next"],
        "properties": {
            "items": {
                "type": "array",
                "items": {"type": "object", "description": "a record as stored, with seq and hash"},
            },
            "next": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        },
    },
    "AuditKeys": {
        "type": "object",
        "required": ["keys"],
        "properties": {"keys": {"type": "array", "items": {"type": "object"}}},
    },
    **audit_stream.SCHEMAS,
}
_page = operation(
    "getAudit", "The organization's audit records", (200, "AuditPage"),
    params=("org", *PARAMETERS), errors=(400, 403, 404, 503),
)  # fmt: skip
_keys = operation("getAuditKeys", "The audit checkpoints' public keys", (200, "AuditKeys"))
PATHS: dict[str, Doc] = {
    "/api/v1/orgs/{org}/audit": {"get": _page},
    KEYS_PATH: {"get": {**_keys, "security": []}},
    **audit_stream.PATHS,
}
