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
3. a delivery id already accepted (`X-GitHub-Delivery`; GitLab's `Idempotency-Key`, the
   same on its retries, else `X-Gitlab-Event-UUID`) is answered 200 and starts nothing;
4. the payload is read (services/processes/vcs/payloads.py; a malformed or hostile one is a 400
   that writes nothing), the bound workspaces of its repository are read from the read
   model (one indexed query), and each run the change starts is created with an id
   derived from the organization, connection, delivery and workspace;
5. the delivery is recorded on its own subject, expecting it empty.

Why this order holds across replicas and crashes: the runs' ids are derived, so a
redelivery handled twice at once, or after a crash between 4 and 5, finds its runs and
writes none again; and the record of step 5 is what makes a later redelivery start
nothing even in a workspace bound since.

The read model lags the stream by a few milliseconds: before matching, the request waits
(bounded, READ_WAIT_S) until this replica's projection holds everything the stream held
when the request arrived, so a workspace created (and acknowledged) before the VCS sent
its webhook is seen. If the projection cannot catch up in time the request answers 503
and records nothing, so a redelivery (GitHub's "Redeliver", GitLab's retry) does it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog
from aiohttp import web

from events import vcs
from events.codec import valid_id
from events.errors import Conflict, DomainError
from events.values import Cause
from infra.eventstore import Append
from infra.ids import derived_id
from services.processes.vcs import BadPayload, connections, matching, payloads, signing
from services.processes.vcs.payloads import Change
from services.surfaces.api.context import API, Api
from services.surfaces.api.problems import Problem, unauthorized
from services.surfaces.api.secrets import SECRETS
from services.surfaces.webhooks.intake import INTAKE, closes_unread

log = structlog.get_logger(__name__)

MAX_DELIVERY = 200  # characters of a delivery id
READ_WAIT_S = 2.0
CONCURRENT_RUNS = 64  # run creations in flight for one delivery
_REFUSED = "the request's signature matches no VCS connection"


@closes_unread
async def handle(request: web.Request) -> web.Response:
    """The delivery's answer (module docstring)."""
    api = request.app[API]
    conn, secret = await _known(request)
    body = await _proven(request, conn.provider, secret)
    provider = conn.provider
    delivery = _delivery(provider, request)
    event = _event(provider, request)
    subject = vcs.delivery_subject(conn.org, conn.id, delivery)
    if await api.app.store.last_seq_of(subject):
        log.info("vcs_delivery_replayed", connection=conn.id)
        return _answer(delivery, "replay", [])
    try:
        change = payloads.parse(provider, event, body)
    except BadPayload as e:
        log.warning("vcs_payload_refused", connection=conn.id, reason=str(e)[:200])
        raise Problem("invalid-body", str(e)) from e
    if change.kind in (payloads.PING, payloads.IGNORED):
        return _answer(delivery, change.reason or change.kind, [])
    runs = await _start(api, conn, delivery, change)
    await _record(api, conn, subject, delivery, change, runs)
    return _answer(delivery, "", runs)


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


def _cause(conn: vcs.VcsConnection, delivery: str, change: Change) -> Cause:
    return Cause(
        kind="vcs",
        provider=conn.provider,
        connection=conn.id,
        delivery=delivery,
        event=change.kind,
        ref=change.ref,
        commit=change.commit,
        repository=change.repository,
        pull_request=change.pull_request,
    )


def _message(change: Change) -> str:
    if change.kind == payloads.PULL_REQUEST:
        return f"pull request #{change.pull_request} of {change.repository} at {change.commit[:12]}"
    return f"{change.kind} of {change.ref} at {change.commit[:12]}"


async def _start(
    api: Api, conn: vcs.VcsConnection, delivery: str, change: Change
) -> list[dict[str, Any]]:
    """Create every run the change starts (concurrently, bounded); what they are."""
    if not await api.reached(await api.app.store.last_seq(), READ_WAIT_S):
        raise Problem("unavailable", "the read model is behind; deliver again shortly")
    tag = change.kind == payloads.TAG
    complete = change.kind == payloads.PUSH and not change.everything
    bindings = await api.read.integrations.vcs_bindings(
        conn.org,
        conn.id,
        change.repo_keys,
        branch=None if tag else change.branch,
        files=change.files if complete else None,
        tags=tag,
    )
    targets = matching.targets(change, bindings)
    cause, message = _cause(conn, delivery, change), _message(change)
    gate = asyncio.Semaphore(CONCURRENT_RUNS)

    async def one(t: matching.Target) -> dict[str, Any] | None:
        run_id = derived_id("vcs", conn.org, conn.id, delivery, t.workspace)
        async with gate:
            try:
                result = await api.app.create_run(
                    conn.org,
                    t.workspace,
                    t.run_type,
                    f"vcs:{conn.id}",
                    message,
                    cause=cause,
                    commit=change.commit,
                    run_id=run_id,
                    speculative=True if t.speculative else None,
                )
            except DomainError as e:
                if e.retryable:
                    raise
                # the workspace went, or names a run type it cannot have: the others run
                log.warning("vcs_run_refused", workspace=t.workspace, error=str(e))
                return None
        return {"workspace": t.workspace, "run_id": run_id, "existed": result.existed}

    made = await asyncio.gather(*(one(t) for t in targets))
    return [m for m in made if m is not None]


async def _record(
    api: Api,
    conn: vcs.VcsConnection,
    subject: str,
    delivery: str,
    change: Change,
    runs: list[dict[str, Any]],
) -> None:
    event = vcs.DeliveryAccepted(
        at=api.app.clock(),
        actor=f"vcs:{conn.id}",
        connection_id=conn.id,
        delivery=delivery,
        event=change.kind,
        repository=change.repository,
        ref=change.ref,
        commit=change.commit,
        runs=[f"{r['workspace']}/{r['run_id']}" for r in runs],
    )
    append = Append(subject=subject, event=event, expected=0, msg_id=api.app.ids())
    try:
        await api.app.store.append([append])
    except Conflict:  # a twin of this delivery, handled at once elsewhere: same runs
        log.info("vcs_delivery_twin", connection=conn.id)


def _answer(delivery: str, ignored: str, runs: list[dict[str, Any]]) -> web.Response:
    body: dict[str, Any] = {"delivery": delivery, "runs": runs}
    if ignored:
        body["ignored"] = ignored
    return web.json_response(body)
