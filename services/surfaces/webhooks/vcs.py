"""`POST /api/v1/vcs/{connection_id}/webhook`: a VCS's delivery, proven by its signature.

No runplane token: the signature is the authentication (services/processes/vcs/signing.py).
In order:
1. before a byte of the body is read (services/surfaces/webhooks/intake.py): the
   connection is found from its id through the stream (never a stale read model) with
   its secret, and the request must carry a proof of its form: GitLab's token, compared
   there and then, or a GitHub signature header. A malformed or unknown id, a deleted
   connection, one without a secret, a missing or wrong token and a header that is no
   signature all answer the same 401, at once. (A caller can so tell an id that exists by
   the server waiting for its body: ids are random and the id is no authority, only the
   secret is.)
2. the body is read bounded (the deployment's `--webhook-max-body`, 1 MiB by default;
   413 beyond, read no further; GitHub's own cap is 25 MB, a real push or pull request is
   far below), a GitHub one within one of the process's slots for unproven bodies (503
   with Retry-After when all are taken), its HMAC fed as the chunks arrive: a mismatch is
   the same 401;
3. the delivery id (`X-GitHub-Delivery`; GitLab's `Idempotency-Key`, the same on its
   retries, else `X-Gitlab-Event-UUID`) and the event's name are read from the headers;
4. the verified delivery is handled (services/processes/vcs/deliveries.py): a delivery id
   already recorded starts nothing (`replay`); the payload is read (a malformed or
   hostile one is a 400 that writes nothing); a push starts only the workspaces it is
   current for (else `stale`), and only once whatever delivery id brings it (else
   `duplicate`); the runs' ids are derived from the delivery, and the delivery is
   recorded on its own subject. What must be delivered again (the read model behind,
   a repository that cannot tell where its ref is) is a 503 that records nothing.
"""

from __future__ import annotations

from typing import Any

import structlog
from aiohttp import web

from events import vcs
from events.codec import valid_id
from services.processes.vcs import BadPayload, VcsError, connections, signing
from services.processes.vcs.deliveries import Deliveries, Outcome
from services.surfaces.api.context import API, Api
from services.surfaces.api.problems import Problem, unauthorized
from services.surfaces.api.secrets import SECRETS
from services.surfaces.webhooks.intake import INTAKE, closes_unread

log = structlog.get_logger(__name__)

MAX_DELIVERY = 200  # characters of a delivery id
_REFUSED = "the request's signature matches no VCS connection"
# What handles a verified delivery (services/processes/vcs/deliveries.py), built with the API.
DELIVERIES: web.AppKey[Deliveries] = web.AppKey("runplane.vcs_deliveries", Deliveries)


@closes_unread
async def handle(request: web.Request) -> web.Response:
    """The delivery's answer (module docstring)."""
    conn, secret = await _known(request)
    body = await _proven(request, conn.provider, secret)
    provider = conn.provider
    delivery = _delivery(provider, request)
    event = _event(provider, request)
    try:
        outcome = await request.app[DELIVERIES].handle(conn, delivery, event, body)
    except BadPayload as e:
        log.warning("vcs_payload_refused", connection=conn.id, reason=str(e)[:200])
        raise Problem("invalid-body", str(e)) from e
    except VcsError as e:
        if e.retryable:
            raise Problem("unavailable", str(e)) from e
        raise Problem("invalid-command", f"the delivery cannot be acted on: {e}") from e
    return _answer(delivery, outcome)


def _refused() -> Problem:
    log.warning("vcs_signature_refused")
    return unauthorized(_REFUSED)


async def _known(request: web.Request) -> tuple[vcs.VcsConnection, str]:
    """The connection the path names, and its secret; 401 (before the body) for an id
    that names none that could be proven (module docstring, 1)."""
    conn = await _connection(request.app[API], request.match_info["connection"])
    secret = "" if conn is None else await _secret(request, conn)
    if conn is None or not secret:
        raise _refused()
    return conn, secret


async def _proven(request: web.Request, provider: str, secret: str) -> bytes:
    """The body, proven the connection's: GitLab's token before it is read, GitHub's
    signature as it streams, in one of the intake's slots (module docstring, 1 and 2)."""
    intake = request.app[INTAKE]
    if provider != "github":
        if not signing.gitlab_verified(secret, request.headers):
            raise _refused()
        return await intake.read(request)
    sent = signing.github_sent(request.headers)
    if sent is None:
        raise _refused()
    mac = signing.github_hmac(secret)
    with intake.slot("vcs"):
        body = await intake.read(request, sink=mac.update)
        if not signing.github_matches(mac, sent):
            raise _refused()
    return body


async def _connection(api: Api, connection_id: str) -> vcs.VcsConnection | None:
    if not valid_id(connection_id):
        return None
    return await connections.find(api.app.store, connection_id)


async def _secret(request: web.Request, conn: vcs.VcsConnection) -> str:
    store = request.app.get(SECRETS)
    if store is None or not conn.has_secret:
        return ""
    try:
        return await connections.webhook_secret(store, conn.org, conn.id)
    except connections.SealError:
        log.warning("vcs_secret_does_not_open", connection=conn.id)
        return ""


def _delivery(provider: str, request: web.Request) -> str:
    names = (
        ("X-GitHub-Delivery",)
        if provider == "github"
        else ("Idempotency-Key", "X-Gitlab-Event-UUID")
    )
    for name in names:
        value = request.headers.get(name, "").strip()
        if value:
            if len(value) > MAX_DELIVERY or not value.isprintable():
                raise Problem("invalid-header", f"{name} is not a delivery id")
            return value
    raise Problem("invalid-header", f"a delivery needs {' or '.join(names)}")


def _event(provider: str, request: web.Request) -> str:
    name = "X-GitHub-Event" if provider == "github" else "X-Gitlab-Event"
    value = request.headers.get(name, "")
    if not value or len(value) > 100 or not value.isprintable():
        raise Problem("invalid-header", f"a delivery needs {name}")
    return value


def _answer(delivery: str, outcome: Outcome) -> web.Response:
    body: dict[str, Any] = {"delivery": delivery, "runs": outcome.runs}
    if outcome.ignored:
        body["ignored"] = outcome.ignored
    if outcome.stale:
        body["stale"] = outcome.stale
    if outcome.duplicate_of:
        body["duplicate_of"] = outcome.duplicate_of
    return web.json_response(body)
