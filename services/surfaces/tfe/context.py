"""What every TFE handler needs, and the wrapper that authenticates and answers errors
(the refusals that matter on the audit record first: refusals.py).

The TFE routes authenticate themselves (runplane's middleware lets them through:
`SELF_AUTHENTICATED`), with the same bearer tokens as runplane's API
(services/surfaces/api/auth.py): an organization's token sees only its organization, and
another organization's objects are answered 404 as if they did not exist.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
import nats.errors
import structlog
from aiohttp import web

from events import access
from events.errors import DomainError
from executor.statestore import StateStore
from infra import jsonbody
from infra.eventstore import StoreError
from services.surfaces.api.auth import PRINCIPAL, Principal, authenticate
from services.surfaces.api.common import may_on, require_on
from services.surfaces.api.context import API, Api
from services.surfaces.api.problems import Problem, from_domain
from services.surfaces.tfe import refusals
from services.surfaces.tfe.capability import Signer
from services.surfaces.tfe.jsonapi import TfeError, error_response

log = structlog.get_logger("runplane.tfe")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# A JSON:API document the CLI sends (a workspace, a lock reason): a few hundred bytes.
# States, the only large bodies, are streamed to a file instead (state_body.py).
MAX_JSON = 1024 * 1024


@dataclass(frozen=True)
class Tfe:
    """The TFE side's own dependencies. Without a key ring (no encryption key) there
    are no capabilities and no state: those routes answer 503."""

    signer: Signer | None
    states: StateStore | None

    def need_signer(self) -> Signer:
        if self.signer is None:
            raise TfeError(503, "unavailable", "this deployment has no encryption key")
        return self.signer

    def need_states(self) -> StateStore:
        if self.states is None:
            raise TfeError(503, "unavailable", "this deployment has no encryption key")
        return self.states


TFE: web.AppKey[Tfe] = web.AppKey("runplane.tfe", Tfe)


def tfe_of(request: web.Request) -> Tfe:
    return request.app[TFE]


def api_of(request: web.Request) -> Api:
    return request.app[API]


def principal(request: web.Request) -> Principal:
    return request[PRINCIPAL]


async def require(request: web.Request, org: str, action: str, ws: str = "") -> Principal:
    """The caller, once it may do `action` (events/access.py) in `org`, on workspace `ws`
    if given: 404 for another organization and a workspace it may not read."""
    who = principal(request)
    request[refusals.CHECKED] = (org, ws)
    if ws:
        await require_on(api_of(request), who, org, action, ws)
    else:
        access.require(who.access, action, access.Target(org=org))
    return who


async def may(request: web.Request, org: str, action: str, ws: str) -> bool:
    """Whether the caller may also do `action` on workspace `ws`."""
    return await may_on(api_of(request), principal(request), org, action, ws)


def _from_problem(p: Problem) -> TfeError:
    return TfeError(p.status, p.title.lower(), p.detail, **p.headers)


async def _refused(request: web.Request, error: TfeError, slug: str) -> web.Response:
    """The refusal's answer, once it is on the record where it matters (refusals.py)."""
    await refusals.record(request, error, slug)
    return error_response(error)


def route(handler: Handler, *, public: bool = False) -> Handler:
    """A TFE handler: authenticated unless `public`, every error a JSON:API error."""

    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            if not public:
                header = request.headers.get("Authorization")
                request[PRINCIPAL] = await authenticate(request.app[API], header)
            return await handler(request)
        except TfeError as e:
            return await _refused(request, e, refusals.slug_of(e))
        except Problem as p:
            return await _refused(request, _from_problem(p), p.slug)
        except DomainError as e:
            problem = from_domain(e)
            return await _refused(request, _from_problem(problem), problem.slug)
        except (StoreError, nats.errors.Error) as e:
            log.warning("event_store_unavailable", error=str(e))
            return error_response(TfeError(503, "unavailable", "try again"))
        except Exception:
            log.exception("unhandled_error")
            return error_response(TfeError(500, "internal error", "an unexpected error"))

    wrapped.__name__ = handler.__name__
    wrapped.__doc__ = handler.__doc__
    return wrapped


async def read_json(request: web.Request, *, limit: int = MAX_JSON) -> object:
    """The request's JSON body, read up to `limit` bytes; 413 beyond it, 422 if it is not
    JSON, nests too deep or repeats a key (infra/jsonbody.py)."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > limit:
            raise TfeError(413, "body too large", f"the body passes {limit} bytes")
        chunks.append(chunk)
    try:
        return jsonbody.decode(b"".join(chunks))
    except msgspec.DecodeError as e:
        raise TfeError(422, "invalid body", f"the body is not JSON: {e}") from e
    except jsonbody.BodyError as e:
        raise TfeError(422, "invalid body", str(e)) from e
