"""Middlewares, outermost first: a span per request (a caller's `traceparent` is its
parent), one log line per request, problem details for every error, bearer
authentication, `as_of` refused where it is not taken, and the RP-Min-Seq wait of reads."""

from __future__ import annotations

import asyncio
import time

import nats.errors
import structlog
from aiohttp import web
from aiohttp.typedefs import Handler
from opentelemetry.trace import SpanKind

from infra import origin, tracing
from infra.directget import InfraError
from services.surfaces.api import asof, audit, docs, idempotency
from services.surfaces.api.auth import PRINCIPAL, authenticate
from services.surfaces.api.context import API
from services.surfaces.api.problems import Problem, refusals

log = structlog.get_logger("runplane.api")

# Routes the middleware lets through unauthenticated: /metrics checks its own tokens
# (services/surfaces/api/metrics.py); Slack signs its own calls
# (services/surfaces/webhooks/slack.py), and GitHub and GitLab theirs
# (services/surfaces/webhooks/vcs.py): they carry no runplane token.
PUBLIC = (
    frozenset(
        {
            "/healthz",
            "/readyz",  # liveness and readiness: no tenant's data (readiness.py)
            "/metrics",
            "/api/v1/chat/slack/commands",
            "/api/v1/chat/slack/interactions",
            "/api/v1/vcs/{connection}/webhook",
            audit.KEYS_PATH,  # public keys, no tenant data
        }
    )
    | docs.PUBLIC
)  # the API reference describes, never shows
MIN_SEQ = "RP-Min-Seq"
_BOUND = {"org": "org", "ws": "workspace", "run": "run_id"}
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


@web.middleware
async def trace_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A span per request, named by its route (not its path, which names tenants' things),
    current while it is handled: every event it appends carries its `traceparent`."""
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    method = request.method if request.method in _METHODS else "_OTHER"  # any token is one
    with tracing.span_from_headers(
        f"{method} {route}", request.headers, kind=SpanKind.SERVER
    ) as span:
        trace_id = tracing.trace_id()  # on the request's log lines, to find its trace
        bound = structlog.contextvars.bind_contextvars(trace_id=trace_id) if trace_id else {}
        try:
            response = await handler(request)
        finally:
            structlog.contextvars.reset_contextvars(**bound)
        if span.is_recording():
            span.set_attributes(
                {
                    "http.request.method": method,
                    "http.route": route,
                    "http.response.status_code": response.status,
                }
            )
        return response


@web.middleware
async def log_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
    """One summary line per request, with org / workspace / run bound for every line."""
    ids = {_BOUND[k]: v for k, v in request.match_info.items() if k in _BOUND}
    start = time.perf_counter()
    status = 500
    with structlog.contextvars.bound_contextvars(method=request.method, path=request.path, **ids):
        try:
            response = await handler(request)
            status = response.status
            return response
        except asyncio.CancelledError:
            status = 499  # the client went away
            raise
        finally:
            ms = round((time.perf_counter() - start) * 1000, 2)
            who = request.get(PRINCIPAL)
            log.info("request", status=status, duration_ms=ms, user=who.user if who else None)


@web.middleware
async def problems(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error becomes problem details: never a traceback, never an HTML page."""
    try:
        return await refusals(request, handler)
    except web.HTTPException:
        raise  # below 400 (a redirect): every error status was answered by `refusals`
    except (InfraError, nats.errors.Error) as e:
        # any of NATS's stores (the events, a bucket: the secrets' during its leader's
        # election) out of reach for a moment: retry, not an internal error
        log.warning("event_store_unavailable", error=str(e))
        return Problem("unavailable", "the event store is unavailable; try again").response()
    except Exception:
        log.exception("unhandled_error")
        return Problem("internal-error", "an unexpected error occurred").response()


# Routes (canonical paths) that authenticate their own requests: the web UI's, by its
# session cookie (services/surfaces/ui/sessions.py); the UI adds them when it is mounted.
SELF_AUTHENTICATED: web.AppKey[frozenset[str]] = web.AppKey("runplane.self_auth", frozenset)


def _is_public(request: web.Request) -> bool:
    resource = request.match_info.route.resource
    if resource is None:
        return False
    own = request.app.get(SELF_AUTHENTICATED, frozenset())
    return resource.canonical in PUBLIC or resource.canonical in own


@web.middleware
async def authenticate_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every route but the public ones needs a valid bearer token."""
    if _is_public(request):
        return await handler(request)
    who = await authenticate(request.app[API], request.headers.get("Authorization"))
    request[PRINCIPAL] = who
    here = origin.current.get()
    if here is not None:  # what its events' audit records say the caller is
        here.actor_kind = audit.actor_kind(who)
    with structlog.contextvars.bound_contextvars(user=who.user):
        return await handler(request)


def _min_seq(raw: str) -> int:
    try:
        seq = int(raw)
    except ValueError:
        seq = -1
    if seq < 0:
        raise Problem("invalid-header", f"{MIN_SEQ} must be a non-negative integer")
    return seq


@web.middleware
async def min_seq(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A read with RP-Min-Seq waits (bounded) until the projection holds that sequence."""
    raw = request.headers.get(MIN_SEQ)
    if raw is not None and request.method in ("GET", "HEAD"):
        seq = _min_seq(raw)
        api = request.app[API]
        if not await api.reached(seq, api.read_wait):
            raise Problem(
                "stale-read",
                f"the read model is at {api.projector.seq}, not yet at {seq}",
                headers={"Retry-After": "1"},
                projected_seq=api.projector.seq,
            )
    return await handler(request)


@web.middleware
async def as_of_supported(request: web.Request, handler: Handler) -> web.StreamResponse:
    """`?as_of=` on an API route that does not answer the past is refused before the
    handler (or a stored idempotent answer) runs (services/surfaces/api/asof.py)."""
    asof.refuse_unsupported(request)
    return await handler(request)


MIDDLEWARES = (
    trace_requests,
    log_requests,
    problems,
    audit.audit_requests,  # inside problems: sees refusals before they are answers
    authenticate_requests,
    as_of_supported,  # before idempotency: a stored answer is not an answer as of then
    idempotency.idempotent,  # after authentication: a key is its token's
    min_seq,
)
