"""RFC 9457 problem details: every error the API answers with, with a stable `type`.

A handler raises `Problem(slug, detail)`; the problems middleware turns it, a domain error,
an aiohttp HTTP exception or anything unexpected into an `application/problem+json` body.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec
from aiohttp import web

from events.errors import (
    AlreadyExists,
    Conflict,
    Deleted,
    DomainError,
    Forbidden,
    IllegalTransition,
    Invalid,
    NotFound,
    QuotaExceeded,
)

BASE = "https://runplane.dev/problems/"
CONTENT_TYPE = "application/problem+json"

# slug -> (HTTP status, title). Slugs are part of the API contract: never rename one.
KINDS: dict[str, tuple[int, str]] = {
    "invalid-body": (400, "The request body is invalid"),
    "invalid-query": (400, "A query parameter is invalid"),
    "invalid-header": (400, "A request header is invalid"),
    "as-of-unsupported": (400, "This endpoint answers only the present: as_of is not taken"),
    "unauthorized": (401, "Authentication is required"),
    "token-expired": (401, "The token has expired"),
    "user-suspended": (401, "The token's user is suspended (or its team is gone)"),
    "forbidden": (403, "The caller's access does not allow this"),
    "not-found": (404, "Not found"),
    "method-not-allowed": (405, "Method not allowed"),
    "request-timeout": (408, "The request body did not arrive in time"),
    "conflict": (409, "Not allowed in the current status"),
    "already-exists": (409, "Already exists"),
    "idempotency-in-progress": (409, "A request with this Idempotency-Key is in progress"),
    "workspace-deleted": (409, "The workspace is deleted"),
    "workspace-not-locked": (409, "The caller must hold the workspace's lock"),
    "run-active": (409, "A run is active on the workspace"),
    "state-changed": (409, "The workspace's state changed meanwhile"),
    "state-version-other-lineage": (404, "The state version is not of the current lineage"),
    "state-version-pruned": (410, "The state version's content is no longer stored"),
    "log-removed": (410, "Retention removed the run's stored logs"),
    "run-removed": (410, "Retention removed the run's whole record"),
    "body-too-large": (413, "The request body is too large"),
    "quota-exceeded": (429, "A quota of the deployment is reached"),
    "rate-limited": (429, "Too many requests from this address: wait a minute"),
    "invalid-id": (422, "An identifier is invalid"),
    "invalid-command": (422, "The command is invalid"),
    "invalid-as-of": (422, "as_of names no moment of the event log"),
    "invalid-policy": (422, "The policy does not compile"),
    "repository-not-allowed": (422, "The repository is not one this deployment allows"),
    "invalid-sso-issuer": (422, "The identity provider cannot be used"),
    "destination-refused": (422, "The destination's address is not one this deployment allows"),
    "policy-limit-exceeded": (422, "The policy passed the sandbox's memory or time cap"),
    "run-trigger-cycle": (422, "The run trigger would close a cycle"),
    "run-trigger-limit": (422, "A workspace would follow or be followed by too many"),
    "stack-cycle": (422, "The stack's edges would close a cycle"),
    "invalid-stack": (422, "The stack's definition breaks a rule (a node, an edge, a limit)"),
    "invalid-schedule": (422, "The schedule's cron, time zone, run type or template is invalid"),
    "schedule-limit-exceeded": (422, "The workspace has as many schedules as it may"),
    "idempotency-key-reused": (422, "The Idempotency-Key was used for another request"),
    "internal-error": (500, "Internal server error"),
    "unavailable": (503, "Temporarily unavailable"),
    "stale-read": (503, "The read model has not caught up"),
    "as-of-too-costly": (
        503,
        "Too much history to fold in one request",
    ),
    "not-ready": (503, "Not ready"),
    "projector-stopped": (503, "This replica's read model no longer follows the stream"),
    "projector-failing": (503, "This replica's read model fails to follow the stream"),
}

_encoder = msgspec.json.Encoder()


class Problem(Exception):
    """An HTTP error answered as problem details; `extra` adds members to the body."""

    def __init__(
        self,
        slug: str,
        detail: str,
        *,
        headers: Mapping[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(detail)
        self.slug = slug
        self.status, self.title = KINDS[slug]
        self.detail = detail
        self.headers = dict(headers or {})
        self.extra = extra

    def body(self) -> dict[str, Any]:
        return {
            "type": BASE + self.slug,
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
            **self.extra,
        }

    def response(self) -> web.Response:
        return web.Response(
            status=self.status,
            body=_encoder.encode(self.body()),
            content_type=CONTENT_TYPE,
            headers=self.headers,
        )


def run_removed(run_id: str, at: str) -> Problem:
    """410 `run-removed`: retention removed the run's record at `at` (ISO 8601)."""
    return Problem("run-removed", removed_text(run_id, at), removed_at=at)


def removed_text(run_id: str, at: str) -> str:
    """What a read of a run retention removed says, on every surface."""
    return (
        f"run {run_id} was removed by retention on {at[:10]}: its rows, logs and plan are "
        "deleted; its events stay in the event log"
    )


def unauthorized(
    detail: str, *, invalid_token: bool = False, slug: str = "unauthorized", **extra: Any
) -> Problem:
    challenge = 'Bearer realm="runplane"'
    if invalid_token:
        challenge += ', error="invalid_token"'
    return Problem(slug, detail, headers={"WWW-Authenticate": challenge}, **extra)


def from_domain(error: DomainError) -> Problem:
    """The problem a domain error stands for."""
    detail = str(error)
    match error:
        case Deleted():
            return Problem("workspace-deleted", detail)
        case IllegalTransition():
            return Problem("conflict", detail, current_status=error.status)
        case AlreadyExists():
            return Problem("already-exists", detail)
        case NotFound():
            return Problem("not-found", detail)
        case Invalid():
            return Problem("invalid-command", detail)
        case Forbidden():
            return Problem("forbidden", detail)
        case QuotaExceeded():
            return Problem("quota-exceeded", detail)
        case Conflict():
            # Optimistic retries ran out: heavy contention on one aggregate.
            return Problem("unavailable", detail, headers={"Retry-After": "1"})
        case _:
            return Problem("conflict", detail)


_HTTP_SLUGS = {404: "not-found", 405: "method-not-allowed", 413: "body-too-large"}
_KEPT_HEADERS = ("Allow",)


def from_http(exc: web.HTTPException, method: str, path: str) -> Problem:
    """The problem for an error aiohttp raised itself (no route, wrong method, ...)."""
    slug = _HTTP_SLUGS.get(exc.status, "internal-error" if exc.status >= 500 else "invalid-body")
    headers = {h: exc.headers[h] for h in _KEPT_HEADERS if h in exc.headers}
    match exc.status:
        case 404:
            detail = f"no route for {method} {path}"
        case 405:
            detail = f"{method} is not allowed on {path}; allowed: {headers.get('Allow', '')}"
        case _:
            detail = (
                exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
            )
    return Problem(slug, detail, headers=headers)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def refusals(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The handler's answer, its refusals (a Problem, a domain error, an HTTP error
    status) as their problem answers; anything else (a redirect included) is raised."""
    try:
        return await handler(request)
    except Problem as p:
        return p.response()
    except DomainError as e:
        return from_domain(e).response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return from_http(e, request.method, request.path).response()
