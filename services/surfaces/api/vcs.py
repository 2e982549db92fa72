"""VCS connections over HTTP (events/vcs.py), and the webhook endpoint each one has.

`POST .../vcs-connections` `{"name", "provider": "github" | "gitlab", "api_url"?,
"webhook_secret", "token"?, "deploy_key"?}` creates one (admin; 201), `GET` lists them (viewer),
`GET|PATCH|DELETE .../vcs-connections/{id}` reads, changes (only the fields given) and
deletes one; `GET .../vcs-connections/{id}/deliveries` (viewer) lists the deliveries it
recorded, newest first, 100 a page (`?before=<seq>` the next): the runs each started, or
why it started nothing (`stale`: its commit was not current for the workspaces it names
in `stale`; `duplicate`: `duplicate_of` brought the same push first).

The webhook secret and the token are write-only: sealed into the secrets
bucket (services/processes/vcs/connections.py), never answered; `has_secret` / `has_token` say
whether each is set (`"token": ""` in a PATCH removes it). The token and the deploy key
(an ssh private key, also write-only, `""` removes it) are what runplane's git reaches the
repositories of the workspaces bound to the connection with (infra/gitenv.py): the
organization's own credentials, never the host's. `api_url` defaults to the
provider's public API; another (GitHub Enterprise, a self-hosted GitLab) is any http(s)
URL without credentials. The answer carries `webhook_path`, what to give the VCS.

A connection of another organization is not found, whatever the caller's role there.
`POST /api/v1/vcs/{connection}/webhook` is the VCS's (services/surfaces/webhooks/vcs.py).
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from aiohttp import web
from msgspec import Meta

from events import vcs
from events.errors import Invalid
from services.processes.vcs import connections
from services.processes.vcs.connections import DEPLOY_KEY, SECRET, TOKEN, Sealed
from services.surfaces.api import secrets as secrets_api
from services.surfaces.api.bodies import Body, read_body
from services.surfaces.api.common import (
    SEQ_HEADER,
    Row,
    items,
    json_response,
    path_id,
    scope,
    written,
)
from services.surfaces.api.context import Api
from services.surfaces.api.problems import Problem
from services.surfaces.api.schemas import (
    BOOL,
    REF,
    STR,
    Doc,
    list_of,
    ok,
    path_param,
    problems,
    ref,
)
from services.surfaces.webhooks import vcs as webhook

Secret = Annotated[str, Meta(max_length=connections.MAX_SECRET, description="write-only")]
Name = Annotated[str, Meta(min_length=1, max_length=vcs.MAX_NAME)]
Url = Annotated[str, Meta(min_length=1, max_length=vcs.MAX_URL)]


class ConnectionBody(Body, frozen=True, kw_only=True):
    name: Name
    provider: Annotated[str, Meta(description="github or gitlab")]
    api_url: Url | None = None
    webhook_secret: Annotated[str, Meta(min_length=1, max_length=connections.MAX_SECRET)]
    token: Secret = ""
    deploy_key: Secret = ""


class ConnectionPatchBody(Body, frozen=True, kw_only=True):
    name: Name | None = None
    api_url: Url | None = None
    webhook_secret: Annotated[str, Meta(min_length=1, max_length=connections.MAX_SECRET)] | None = (
        None
    )
    token: Secret | None = None
    deploy_key: Secret | None = None


def _check_key(key: str | None) -> None:
    """A deploy key is an ssh private key in PEM or OpenSSH form (or "": none)."""
    if key and not (key.lstrip().startswith("-----BEGIN ") and "PRIVATE KEY-----" in key):
        raise Invalid("deploy_key must be an ssh private key (-----BEGIN ... PRIVATE KEY-----)")


def webhook_path(connection_id: str) -> str:
    return f"/api/v1/vcs/{connection_id}/webhook"


def _row(c: vcs.VcsConnection | None) -> Row:
    assert c is not None  # a command that succeeded leaves one
    return {
        "id": c.id,
        "name": c.name,
        "provider": c.provider,
        "api_url": c.api_url,
        "has_secret": c.has_secret,
        "has_token": c.has_token,
        "webhook_path": webhook_path(c.id),
        "created_at": c.created_at.isoformat().replace("+00:00", "Z"),
        "created_by": c.created_by,
    }


def _shown(row: Row | None) -> Row | None:
    return None if row is None else {**row, "webhook_path": webhook_path(row["id"])}


def _sealed(request: web.Request) -> Sealed:
    store = secrets_api.store_of(request)  # 503 without the encryption key
    return Sealed(store.nc, store.keyring)


async def _command(
    api: Api, org: str, cmd: vcs.SaveConnection | vcs.DeleteConnection
) -> tuple[vcs.ConnectionState, int]:
    return await connections.command(api.app, org, cmd)


async def _found(api: Api, org: str, connection_id: str) -> vcs.VcsConnection:
    st, _ = await connections.state(api.app, org, connection_id)
    c = st.connection
    if not st.exists or c is None or c.org != org:
        raise Problem("not-found", f"VCS connection {connection_id} not found")
    return c


async def create(request: web.Request) -> web.Response:
    api, org, who = await scope(request, "vcs.manage")
    body = await read_body(request, ConnectionBody)
    if not (await api.app.load_org(org)).state.exists:
        raise Problem("not-found", f"organization {org} not found")
    if len(await connections.connections(api.app.store, org)) >= vcs.MAX_CONNECTIONS:
        raise Invalid(f"an organization has at most {vcs.MAX_CONNECTIONS} VCS connections")
    connection_id = api.app.ids()
    cmd = vcs.SaveConnection(
        actor=who.user,
        connection_id=connection_id,
        org=org,
        create=True,
        name=body.name,
        provider=body.provider,
        api_url=body.api_url,
        has_secret=True,
        has_token=bool(body.token),
    )
    vcs.decide(vcs.ConnectionState(), cmd, now=api.app.clock())  # 422 before anything is sealed
    _check_key(body.deploy_key)
    sealed = _sealed(request)
    await sealed.put(org, connection_id, SECRET, body.webhook_secret)
    if body.token:
        await sealed.put(org, connection_id, TOKEN, body.token)
    if body.deploy_key:
        await sealed.put(org, connection_id, DEPLOY_KEY, body.deploy_key)
    state, seq = await _command(api, org, cmd)
    return await written(
        api,
        seq,
        lambda: _fresh(api, org, connection_id),
        lambda: _row(state.connection),
        status=201,
        location=f"/api/v1/orgs/{org}/vcs-connections/{connection_id}",
    )


async def _fresh(api: Api, org: str, connection_id: str) -> Row | None:
    return _shown(await api.read.integrations.vcs_connection(org, connection_id))


async def list_connections(request: web.Request) -> web.Response:
    api, org, _ = await scope(request, "org.read")
    return items([r for r in map(_shown, await api.read.integrations.vcs_connections(org)) if r])


async def get_connection(request: web.Request) -> web.Response:
    api, org, _ = await scope(request, "org.read")
    connection_id = path_id(request, "connection")
    c = await _found(api, org, connection_id)
    return json_response(await _fresh(api, org, connection_id) or _row(c))


async def patch_connection(request: web.Request) -> web.Response:
    api, org, who = await scope(request, "vcs.manage")
    connection_id = path_id(request, "connection")
    body = await read_body(request, ConnectionPatchBody)
    await _found(api, org, connection_id)
    cmd = vcs.SaveConnection(
        actor=who.user,
        connection_id=connection_id,
        org=org,
        name=body.name,
        api_url=body.api_url,
        has_token=bool(body.token) if body.token is not None else None,
    )
    st, _ = await connections.state(api.app, org, connection_id)
    vcs.decide(st, cmd, now=api.app.clock())  # 422 before a secret changes
    _check_key(body.deploy_key)
    sealed = _sealed(request)
    if body.webhook_secret is not None:
        await sealed.put(org, connection_id, SECRET, body.webhook_secret)
    if body.token is not None:
        await sealed.put(org, connection_id, TOKEN, body.token)  # "" removes it
    if body.deploy_key is not None:
        await sealed.put(org, connection_id, DEPLOY_KEY, body.deploy_key)  # "" removes it
    state, seq = await _command(api, org, cmd)
    return await written(
        api,
        seq,
        lambda: _fresh(api, org, connection_id),
        lambda: _row(state.connection),
        status=200,
    )


async def delete_connection(request: web.Request) -> web.Response:
    api, org, who = await scope(request, "vcs.manage")
    connection_id = path_id(request, "connection")
    await _found(api, org, connection_id)
    cmd = vcs.DeleteConnection(actor=who.user, connection_id=connection_id)
    _, seq = await _command(api, org, cmd)
    if secrets_api.SECRETS in request.app:
        await _sealed(request).forget(org, connection_id)
    await api.after_write(seq)
    return web.Response(status=204, headers={SEQ_HEADER: str(seq)})


async def list_deliveries(request: web.Request) -> web.Response:
    api, org, _ = await scope(request, "org.read")
    connection_id = path_id(request, "connection")
    await _found(api, org, connection_id)
    raw = request.query.get("before")
    if raw is not None and not (raw.isdigit() and 0 < int(raw) < 2**63):
        raise Problem("invalid-query", "before must be the seq of a listed delivery")
    before = int(raw) if raw is not None else None
    return items(await api.read.integrations.vcs_deliveries(org, connection_id, before=before))


async def check_binding(api: Api, org: str, connection_id: str) -> None:
    """A workspace may name only a connection of its own organization (that exists): a
    workspace of org A bound to org B's connection would run on B's webhooks, and one
    bound to A's would let A's deliveries start B's runs."""
    if await connections.load_connection(api.app, org, connection_id) is None:
        raise Problem(
            "invalid-command", f"vcs_connection {connection_id} is not a VCS connection of {org}"
        )


WEBHOOK = "/api/v1/vcs/{connection}/webhook"


def routes(org: str) -> list[web.RouteDef]:
    one = org + "/vcs-connections/{connection}"
    return [
        web.get(org + "/vcs-connections", list_connections, allow_head=False),
        web.post(org + "/vcs-connections", create),
        web.get(one, get_connection, allow_head=False),
        web.patch(one, patch_connection),
        web.delete(one, delete_connection),
        web.get(one + "/deliveries", list_deliveries, allow_head=False),
        web.post(WEBHOOK, webhook.handle),
    ]


# ---------------------------------------------------------------- OpenAPI

_CONNECTION: Doc = {
    "type": "object",
    "required": ["id", "name", "provider", "api_url", "has_secret", "has_token", "webhook_path"],
    "properties": {
        "id": STR,
        "name": STR,
        "provider": {"enum": list(vcs.PROVIDERS)},
        "api_url": STR,
        "has_secret": {**BOOL, "description": "a webhook secret is set (never answered)"},
        "has_token": {**BOOL, "description": "a token is set (never answered)"},
        "webhook_path": {**STR, "description": "where the VCS sends its webhooks"},
        "created_at": STR,
        "created_by": STR,
        "updated_at": {"type": ["string", "null"]},
    },
}
_RUN = {"type": "object", "properties": {"workspace": STR, "run_id": STR, "existed": BOOL}}
_STALE: Doc = {
    "type": "array",
    "items": STR,
    "description": "workspaces not started: the commit was not current for them",
}
_DELIVERY: Doc = {
    "type": "object",
    "properties": {
        "delivery": STR,
        "ignored": {
            **STR,
            "description": "why nothing started (replay, stale, duplicate, a ping, ...)",
        },
        "runs": {"type": "array", "items": _RUN},
        "stale": _STALE,
        "duplicate_of": {**STR, "description": "the delivery that brought this push first"},
    },
}
_RECORDED: Doc = {
    "type": "object",
    "required": ["seq", "delivery", "at", "event", "ignored", "runs"],
    "properties": {
        "seq": {"type": "integer"},
        "delivery": STR,
        "at": STR,
        "event": {**STR, "description": "push, tag or pull_request"},
        "ignored": {**STR, "description": '"", stale or duplicate'},
        "repository": STR,
        "ref": STR,
        "commit": STR,
        "runs": {"type": "array", "items": _RUN},
        "stale": _STALE,
        "duplicate_of": STR,
    },
}
SCHEMAS: dict[str, Doc] = {
    **msgspec.json.schema_components((ConnectionBody, ConnectionPatchBody), ref_template=REF)[1],
    "VcsConnection": _CONNECTION,
    "VcsConnectionList": list_of("VcsConnection"),
    "VcsDelivery": _DELIVERY,
    "VcsRecordedDelivery": _RECORDED,
    "VcsRecordedDeliveryList": list_of("VcsRecordedDelivery"),
}
PARAMETERS: dict[str, Doc] = {
    "connection": path_param("connection", "VCS connection id"),
    "delivery_before": {
        "name": "before",
        "in": "query",
        "required": False,
        "description": "only deliveries older than this one (the `seq` of the last of a page)",
        "schema": {"type": "integer", "minimum": 1},
    },
}


def _body(name: str) -> Doc:
    return {"required": True, "content": {"application/json": {"schema": ref(name)}}}


_ORG = [{"$ref": "#/components/parameters/org"}]
_ONE = [*_ORG, {"$ref": "#/components/parameters/connection"}]
PATHS: dict[str, Doc] = {
    "/api/v1/orgs/{org}/vcs-connections": {
        "get": {
            "operationId": "listVcsConnections",
            "summary": "VCS connections",
            "parameters": _ORG,
            "responses": {"200": ok("VcsConnectionList"), **problems(403, 404, 422)},
        },
        "post": {
            "operationId": "createVcsConnection",
            "summary": "Create a VCS connection (secret and token write-only)",
            "parameters": _ORG,
            "requestBody": _body("ConnectionBody"),
            "responses": {
                "201": ok("VcsConnection", seq=True),
                **problems(400, 403, 404, 422, 503),
            },
        },
    },
    "/api/v1/orgs/{org}/vcs-connections/{connection}": {
        "get": {
            "operationId": "getVcsConnection",
            "summary": "A VCS connection",
            "parameters": _ONE,
            "responses": {"200": ok("VcsConnection"), **problems(403, 404, 422)},
        },
        "patch": {
            "operationId": "patchVcsConnection",
            "summary": 'Change the fields given (token "" removes it)',
            "parameters": _ONE,
            "requestBody": _body("ConnectionPatchBody"),
            "responses": {
                "200": ok("VcsConnection", seq=True),
                **problems(400, 403, 404, 422, 503),
            },
        },
        "delete": {
            "operationId": "deleteVcsConnection",
            "summary": "Delete a VCS connection",
            "parameters": _ONE,
            "responses": {"204": {"description": "deleted"}, **problems(403, 404, 422)},
        },
    },
    "/api/v1/orgs/{org}/vcs-connections/{connection}/deliveries": {
        "get": {
            "operationId": "listVcsDeliveries",
            "summary": "The deliveries a VCS connection recorded, newest first",
            "parameters": [*_ONE, {"$ref": "#/components/parameters/delivery_before"}],
            "responses": {"200": ok("VcsRecordedDeliveryList"), **problems(400, 403, 404, 422)},
        },
    },
    WEBHOOK: {
        "post": {
            "operationId": "vcsWebhook",
            "summary": "A GitHub or GitLab webhook delivery (signed; no bearer token)",
            "security": [],
            "parameters": [{"$ref": "#/components/parameters/connection"}],
            "responses": {
                "200": ok("VcsDelivery"),
                **problems(400, 401, 408, 413, 422, 503),
            },
        },
    },
}
