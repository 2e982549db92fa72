"""Audit destinations over HTTP: where the organization's audit log is streamed (a SIEM;
events/audit_stream.py says what is sent, services/processes/audit_stream.py sends it).

`POST /api/v1/orgs/{org}/audit/destinations` `{"name", "format": "runplane" |
"splunk-hec", "url", "secret", "enabled"?, "sourcetype"?, "index"?, "start"?: "beginning"
| "now"}` creates one (organization admin; 201), `GET` lists them, `GET|PATCH|DELETE
.../audit/destinations/{destination}` reads, changes (only the fields given) and deletes
one. The secret (the signing secret, or the HEC token) is write-only: sealed into the
secrets bucket as a notification token is, never answered (`has_secret` says one is
set). The URL must be https:// unless the deployment allows http
(`--audit-stream-allow-http`), and is judged by the notifications' address guard when
saved and at every send (422 `destination-refused`). Each answer carries the
destination's progress (`delivered`: the last record delivered, the last failure;
`last_failure`: status, error and time of the last failed try, kept once delivered
again; `failing_since`: when the tries began failing, null while delivering).
The organization streamed is the path's: a destination of another organization is not
found, whatever the caller's role there.
"""

from __future__ import annotations

import contextlib
from datetime import UTC, datetime
from typing import Annotated, Any

import msgspec
import nats.js.errors
from aiohttp import web
from msgspec import Meta

from events import audit_stream as ads
from events.errors import Invalid
from infra.eventstore import EventStore
from infra.kv import AUDIT_BUCKET
from services.app.execute import Aggregate
from services.processes.audit_stream import (
    DestinationSecrets,
    Progress,
    cursor_key,
    read_progress,
)
from services.processes.notifications import Refused, guard
from services.surfaces.api import secrets as secrets_api
from services.surfaces.api.bodies import Body, read_body
from services.surfaces.api.common import SEQ_HEADER, Row, items, json_response, path_id, scope
from services.surfaces.api.context import Api
from services.surfaces.api.problems import Problem
from services.surfaces.api.schemas import REF, Doc, operation, path_param, problems

ALLOW_HTTP = web.AppKey("audit_stream_allow_http", bool)
ACTION = "org.settings"  # an organization admin's
DESTINATION: Aggregate[ads.DestinationState, ads.SaveDestination | ads.DeleteDestination] = (
    Aggregate(
        name="audit_destination",
        initial=ads.fold([]),
        fold=ads.fold,
        decide=lambda s, c, now, new_id: ads.decide(s, c, now=now),
    )
)
Name = Annotated[str, Meta(min_length=1, max_length=ads.MAX_NAME)]
Url = Annotated[str, Meta(min_length=1, max_length=ads.MAX_URL)]
Secret = Annotated[
    str, Meta(max_length=ads.MAX_SECRET, description="write-only: the signing secret or HEC token")
]
Field = Annotated[str, Meta(max_length=ads.MAX_FIELD)]


class DestinationBody(Body, frozen=True, kw_only=True):
    name: Name
    format: Annotated[str, Meta(description="runplane or splunk-hec")] = ads.RUNPLANE
    url: Url
    secret: Secret = ""
    enabled: bool = True
    sourcetype: Field = ""
    index: Field = ""
    start: Annotated[str, Meta(description="beginning (default) or now")] = "beginning"


class DestinationPatchBody(Body, frozen=True, kw_only=True):
    name: Name | None = None
    format: str | None = None
    url: Url | None = None
    secret: Secret | None = None
    enabled: bool | None = None
    sourcetype: Field | None = None
    index: Field | None = None


async def destinations(store: EventStore, org: str) -> list[ads.AuditDestination]:
    """Every destination of the organization that exists, oldest first."""
    by_subject: dict[str, list[Any]] = {}
    for env in await store.read(ads.subjects(org)):
        by_subject.setdefault(env.subject, []).append(env.event)
    states = (ads.fold(events) for events in by_subject.values())
    return [s.destination for s in states if s.exists and s.destination is not None]


async def _found(api: Api, org: str, destination_id: str) -> ads.AuditDestination:
    envs = await api.app.store.read(ads.subject(org, destination_id))
    state = ads.fold([e.event for e in envs])
    d = state.destination
    if not state.exists or d is None or d.org != org:
        raise Problem("not-found", f"audit destination {destination_id} not found")
    return d


def _secrets(request: web.Request) -> DestinationSecrets:
    store = secrets_api.store_of(request)  # 503 without the encryption key
    return DestinationSecrets(store.nc, store.keyring)


async def _guarded(request: web.Request, url: str) -> None:
    if url.startswith("http://") and not request.app.get(ALLOW_HTTP, False):
        raise Problem("destination-refused", "the destination must be https:// on this deployment")
    try:
        await guard.check_url(url, guard.allowed_from_env())
    except Refused as e:
        raise Problem("destination-refused", str(e)) from e


async def _row(api: Api, d: ads.AuditDestination) -> Row:
    kv = await api.app.store.nc.jetstream().key_value(AUDIT_BUCKET)
    p, _ = await read_progress(kv, d.org, d.id)
    return {
        "id": d.id, "name": d.name, "format": d.format, "url": d.url, "enabled": d.enabled,
        "has_secret": d.has_secret, "sourcetype": d.sourcetype or None,
        "index": d.index or None, "created_at": _iso(d.created_at),
        "created_by": d.created_by, "delivered": _delivered(p),
        "last_failure": _last_failure(p), "failing_since": _at(p.failing_since),
    }  # fmt: skip


def _last_failure(p: Progress) -> Row | None:
    """The last failed try (kept once delivered again): its HTTP status (None: no
    answer), why, and when."""
    if not p.last_failed_at:
        return None
    return {"status": p.last_status or None, "error": p.last_error, "at": _at(p.last_failed_at)}


def _at(unix: float) -> str | None:
    return _iso(datetime.fromtimestamp(unix, UTC)) if unix else None


def _delivered(p: Progress) -> Row:
    at = datetime.fromtimestamp(p.delivered_at, UTC) if p.delivered_at else None
    return {
        "seq": p.seq, "n": p.n, "at": _iso(at) if at else None, "error": p.error or None,
        "failures": p.failures,
    }  # fmt: skip


def _iso(at: datetime) -> str:
    return at.astimezone(UTC).isoformat().replace("+00:00", "Z")


async def _start_now(api: Api, org: str, destination_id: str) -> None:
    """The destination's cursor at the chain's head: only what comes next is sent."""
    seq, _, record = await api.audit.head(org)
    kv = await api.app.store.nc.jetstream().key_value(AUDIT_BUCKET)
    p = Progress(seq=seq, n=record.n if record is not None else 0)
    await kv.put(cursor_key(org, destination_id), msgspec.json.encode(p))


async def create(request: web.Request) -> web.Response:
    api, org, who = await scope(request, ACTION)
    body = await read_body(request, DestinationBody)
    if body.start not in ("beginning", "now"):
        raise Invalid("start must be beginning or now")
    if len(await destinations(api.app.store, org)) >= ads.MAX_DESTINATIONS:
        raise Invalid(f"an organization has at most {ads.MAX_DESTINATIONS} audit destinations")
    did = api.app.ids()
    cmd = ads.SaveDestination(
        actor=who.user, destination_id=did, org=org, create=True, name=body.name,
        format=body.format, url=body.url, enabled=body.enabled, has_secret=bool(body.secret),
        sourcetype=body.sourcetype, index=body.index,
    )  # fmt: skip
    ads.check(ads.AuditDestination(id=did, org=org, created_at=_EPOCH, created_by=who.user,
                                   **_given(cmd)))  # fmt: skip  # 422 before anything is stored
    await _guarded(request, body.url)
    if body.secret:
        await _secrets(request).put(org, did, body.secret)
    if body.start == "now":
        await _start_now(api, org, did)
    done = await api.app.execute(DESTINATION, ads.subject(org, did), cmd)
    assert done.state.destination is not None
    await api.after_write(done.seq)
    headers = {
        SEQ_HEADER: str(done.seq),
        "Location": f"/api/v1/orgs/{org}/audit/destinations/{did}",
    }
    return json_response(await _row(api, done.state.destination), status=201, headers=headers)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _given(cmd: ads.SaveDestination) -> dict[str, Any]:
    return {
        "name": cmd.name or "", "format": cmd.format or "", "url": cmd.url or "",
        "enabled": bool(cmd.enabled), "has_secret": bool(cmd.has_secret),
        "sourcetype": cmd.sourcetype or "", "index": cmd.index or "",
    }  # fmt: skip


async def list_destinations(request: web.Request) -> web.Response:
    api, org, _ = await scope(request, ACTION)
    return items([await _row(api, d) for d in await destinations(api.app.store, org)])


async def get_destination(request: web.Request) -> web.Response:
    api, org, _ = await scope(request, ACTION)
    d = await _found(api, org, path_id(request, "destination"))
    return json_response(await _row(api, d))


async def patch_destination(request: web.Request) -> web.Response:
    api, org, who = await scope(request, ACTION)
    did = path_id(request, "destination")
    body = await read_body(request, DestinationPatchBody)
    await _found(api, org, did)
    if body.url is not None:
        await _guarded(request, body.url)
    cmd = ads.SaveDestination(
        actor=who.user, destination_id=did, org=org, name=body.name, format=body.format,
        url=body.url, enabled=body.enabled, sourcetype=body.sourcetype, index=body.index,
        has_secret=bool(body.secret) if body.secret is not None else None,
    )  # fmt: skip
    if body.secret:
        await _secrets(request).put(org, did, body.secret)
    done = await api.app.execute(DESTINATION, ads.subject(org, did), cmd)
    if body.secret == "":  # once the change is taken (an enabled destination needs one)
        await _secrets(request).delete(org, did)
    if body.enabled is False:
        await _not_failing(api, org, did)
    assert done.state.destination is not None
    await api.after_write(done.seq)
    answer = await _row(api, done.state.destination)
    return json_response(answer, headers={SEQ_HEADER: str(done.seq)})


async def _not_failing(api: Api, org: str, did: str) -> None:
    """A disabled destination is tried no more: no longer counted failing (its last
    failure stays on record). A checked update, so a lane's last write is not undone."""
    kv = await api.app.store.nc.jetstream().key_value(AUDIT_BUCKET)
    for _ in range(5):
        p, revision = await read_progress(kv, org, did)
        if not p.failing_since:
            return
        cleared = msgspec.structs.replace(p, failing_since=0.0, failures=0)
        with contextlib.suppress(nats.js.errors.KeyWrongLastSequenceError):
            await kv.update(cursor_key(org, did), msgspec.json.encode(cleared), last=revision)
            return


async def delete_destination(request: web.Request) -> web.Response:
    api, org, who = await scope(request, ACTION)
    did = path_id(request, "destination")
    d = await _found(api, org, did)
    cmd = ads.DeleteDestination(actor=who.user, destination_id=did)
    done = await api.app.execute(DESTINATION, ads.subject(org, did), cmd)
    if d.has_secret and secrets_api.SECRETS in request.app:
        await _secrets(request).delete(org, did)
    kv = await api.app.store.nc.jetstream().key_value(AUDIT_BUCKET)
    await kv.purge(cursor_key(org, did))
    await api.after_write(done.seq)
    return web.Response(status=204, headers={SEQ_HEADER: str(done.seq)})


ROOT = "/api/v1/orgs/{org}/audit/destinations"
ONE = ROOT + "/{destination}"
ROUTES = [
    web.get(ROOT, list_destinations, allow_head=False),
    web.post(ROOT, create),
    web.get(ONE, get_destination, allow_head=False),
    web.patch(ONE, patch_destination),
    web.delete(ONE, delete_destination),
]


# ---------------------------------------------------------------- the API reference

_DESTINATION: Doc = {
    "type": "object",
    "required": ["id", "name", "format", "url", "enabled", "has_secret", "delivered"],
    "properties": {
        "id": {"type": "string"},
        "name": {"type": "string"},
        "format": {"enum": list(ads.FORMATS)},
        "url": {"type": "string"},
        "enabled": {"type": "boolean"},
        "has_secret": {"type": "boolean", "description": "a secret is set (never answered)"},
        "sourcetype": {"type": ["string", "null"]},
        "index": {"type": ["string", "null"]},
        "created_at": {"type": "string"},
        "created_by": {"type": "string"},
        "delivered": {
            "type": "object",
            "description": "the last record delivered (stream seq, chain n, when) and the "
            "last failure",
        },
        "last_failure": {
            "type": ["object", "null"],
            "description": "the last failed try, kept once delivered again: status (the "
            "HTTP status, null: no answer), error, at",
        },
        "failing_since": {
            "type": ["string", "null"],
            "description": "when the tries began failing (null: delivering); the records "
            "wait, none is skipped, and are tried again for as long as it takes",
        },
    },
}
SCHEMAS: dict[str, Doc] = {
    **msgspec.json.schema_components((DestinationBody, DestinationPatchBody), ref_template=REF)[1],
    "AuditDestination": _DESTINATION,
    "AuditDestinationList": {
        "type": "object",
        "required": ["items"],
        "properties": {
            "items": {"type": "array", "items": {"$ref": "#/components/schemas/AuditDestination"}}
        },
    },
}
PARAMETERS: dict[str, Doc] = {"destination": path_param("destination", "audit destination id")}
_one = ("org", "destination")
PATHS: dict[str, Doc] = {
    ROOT: {
        "get": operation(
            "listAuditDestinations", "Where the organization's audit log is streamed",
            (200, "AuditDestinationList"), params=("org",), errors=(403, 404),
        ),
        "post": operation(
            "createAuditDestination", "Stream the audit log to a SIEM (the secret is "
            "write-only)", (201, "AuditDestination"), params=("org",),
            body="DestinationBody", errors=(400, 403, 404, 422),
        ),
    },
    ONE: {
        "get": operation(
            "getAuditDestination", "An audit destination and its progress",
            (200, "AuditDestination"), params=_one, errors=(403, 404),
        ),
        "patch": operation(
            "patchAuditDestination", 'Change the fields given (secret "" removes it)',
            (200, "AuditDestination"), params=_one, body="DestinationPatchBody",
            errors=(400, 403, 404, 422),
        ),
        "delete": {
            "operationId": "deleteAuditDestination",
            "summary": "Stop streaming to it and forget its progress",
            "parameters": [{"$ref": f"#/components/parameters/{p}"} for p in _one],
            "responses": {"204": {"description": "deleted"}, **problems(403, 404)},
        },
    },
}  # fmt: skip
