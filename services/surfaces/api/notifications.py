"""Notification configurations (events/notification.py), at organization and workspace
level; the two add up.

`POST .../notifications` `{"name", "destination": "generic" | "slack" | "teams", "url",
"token"?, "triggers": [...], "enabled"?}` creates one (admin; 201), `GET` lists them
(viewer), `GET|PATCH|DELETE .../notifications/{id}` reads, changes (only the fields
given) and deletes one. The token is write-only: it is sealed into the secrets bucket
(services/processes/notifications/tokens.py) and never answered; `has_token` says whether one is
set (`"token": ""` in a PATCH removes it). Below admin, `url` is answered as its origin
only (`https://hooks.slack.com/…`): a Slack or Teams webhook's URL is its credential.
The URL is judged by the address guard when saved (services/processes/notifications/guard.py: a
422 `destination-refused` for loopback, private, link-local, metadata ... addresses the
deployment does not allow), and again at every send.

`POST .../notifications/{id}/verify` (admin) sends a `verification` payload now and
answers with what the receiver said; `GET .../notifications/{id}/deliveries` (viewer)
lists every attempt, newest first. A configuration of another organization is not
found, whatever the caller's role there.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any
from urllib.parse import urlsplit

import msgspec
from aiohttp import web
from msgspec import Meta

from events import access
from events import notification as nt
from events.errors import Invalid
from services.processes.notifications import Refused, formats, guard, outbox, signing
from services.processes.notifications.delivery import Policy, Sender, outcome
from services.processes.notifications.tokens import MAX_TOKEN, TokenStore
from services.surfaces.api import secrets as secrets_api
from services.surfaces.api.auth import Principal
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

Triggers = Annotated[list[str], Meta(description=f"any of {', '.join(nt.TRIGGERS)}")]
Token = Annotated[
    str, Meta(max_length=MAX_TOKEN, description="write-only: signs each delivery (HMAC)")
]


class NotificationBody(Body, frozen=True, kw_only=True):
    name: Annotated[str, Meta(min_length=1, max_length=nt.MAX_NAME)]
    destination: Annotated[str, Meta(description="generic, slack or teams")] = "generic"
    url: Annotated[str, Meta(min_length=1, max_length=nt.MAX_URL)]
    token: Token = ""
    triggers: Triggers = []
    enabled: bool = True


class NotificationPatchBody(Body, frozen=True, kw_only=True):
    name: Annotated[str, Meta(min_length=1, max_length=nt.MAX_NAME)] | None = None
    destination: str | None = None
    url: Annotated[str, Meta(min_length=1, max_length=nt.MAX_URL)] | None = None
    token: Token | None = None
    triggers: Triggers | None = None
    enabled: bool | None = None


def _row(c: nt.NotificationConfig, updated_at: str | None = None) -> Row:
    return {
        "id": c.id,
        "name": c.name,
        "destination": c.destination,
        "url": c.url,
        "triggers": list(c.triggers),
        "enabled": c.enabled,
        "has_token": c.has_token,
        "workspace": c.workspace or None,
        "created_at": formats._iso(c.created_at),
        "created_by": c.created_by,
        "updated_at": updated_at,
    }


def _tokens(request: web.Request) -> TokenStore:
    store = secrets_api.store_of(request)  # 503 without the encryption key
    return TokenStore(store.nc, store.keyring)


async def _workspace(api: Api, org: str, ws: str | None) -> None:
    if ws is not None and not (await api.app.load_ws(org, ws)).state.exists:
        raise Problem("not-found", f"workspace {ws} not found")


def _ws_of(request: web.Request) -> str | None:
    return path_id(request, "ws") if "ws" in request.match_info else None


def _settings(request: web.Request) -> str:
    """The action changing a configuration is: a workspace's settings, or the org's."""
    return "workspace.settings" if "ws" in request.match_info else "org.settings"


def _reading(request: web.Request) -> str:
    return "workspace.read" if "ws" in request.match_info else "org.read"


async def _guarded(url: str) -> None:
    try:
        await guard.check_url(url, guard.allowed_from_env())
    except Refused as e:
        raise Problem("destination-refused", str(e)) from e


async def _command(api: Api, org: str, cmd: nt.SaveConfig | nt.DeleteConfig) -> tuple[Any, int]:
    return await outbox.command(api.app, org, cmd)


async def _found(api: Api, org: str, config_id: str, ws: str | None) -> nt.NotificationConfig:
    state = await outbox.config(api.app.store, org, config_id)
    cfg = state.config
    if (
        not state.exists
        or cfg is None
        or cfg.org != org
        or (ws is not None and cfg.workspace != ws)
    ):
        raise Problem("not-found", f"notification configuration {config_id} not found")
    return cfg


async def create(request: web.Request) -> web.Response:
    api, org, who = await scope(request, _settings(request))
    ws = _ws_of(request)
    body = await read_body(request, NotificationBody)
    await _workspace(api, org, ws)
    if len(await outbox.configs(api.app.store, org)) >= nt.MAX_CONFIGS:
        # Each configuration is a lane of deliveries: a bound on what one tenant adds.
        raise Invalid(f"an organization has at most {nt.MAX_CONFIGS} notification configurations")
    config_id = api.app.ids()
    cmd = nt.SaveConfig(
        actor=who.user,
        config_id=config_id,
        org=org,
        workspace=ws or "",
        create=True,
        name=body.name,
        destination=body.destination,
        url=body.url,
        triggers=list(body.triggers),
        enabled=body.enabled,
        has_token=bool(body.token),
    )
    nt.check(nt.NotificationConfig(**_fields(cmd)))  # 422 before anything is stored
    await _guarded(body.url)
    if body.token:
        await _tokens(request).put(org, config_id, body.token)
    state, seq = await _command(api, org, cmd)
    where = f"/api/v1/orgs/{org}/notifications/{config_id}"
    return await written(
        api,
        seq,
        lambda: api.read.integrations.notification(org, config_id),
        lambda: _row(state.config),
        status=201,
        location=where,
    )


def _fields(cmd: nt.SaveConfig) -> dict[str, Any]:
    return {
        "id": cmd.config_id,
        "org": cmd.org,
        "workspace": cmd.workspace,
        "name": cmd.name or "",
        "destination": cmd.destination or "",
        "url": cmd.url or "",
        "triggers": cmd.triggers or [],
        "enabled": bool(cmd.enabled),
        "created_at": datetime(1970, 1, 1, tzinfo=UTC),  # checked only: not stored
        "created_by": cmd.actor,
    }


def _shown(row: Row, who: Principal, request: web.Request) -> Row:
    """The row as `who` may see it: to those who may not change it, the URL's origin only.
    A Slack or Teams incoming webhook's URL is its credential (whoever holds it posts in
    the channel, as runplane), so like the token it is for those who may change it."""
    target = access.Target(org=path_id(request, "org"), workspace=_ws_of(request) or "")
    if who.may(_settings(request), target):  # (a folder's admin sees the origin only)
        return row
    parts = urlsplit(str(row.get("url", "")))
    return {**row, "url": f"{parts.scheme}://{parts.netloc}/…"}


async def list_configs(request: web.Request) -> web.Response:
    api, org, who = await scope(request, _reading(request))
    ws = _ws_of(request)
    await _workspace(api, org, ws)
    return items(
        [_shown(r, who, request) for r in await api.read.integrations.notifications(org, ws)]
    )


async def get_config(request: web.Request) -> web.Response:
    api, org, who = await scope(request, _reading(request))
    config_id, ws = path_id(request, "notification"), _ws_of(request)
    cfg = await _found(api, org, config_id, ws)
    row = await api.read.integrations.notification(org, config_id)
    return json_response(_shown(row or _row(cfg), who, request))


async def patch_config(request: web.Request) -> web.Response:
    api, org, who = await scope(request, _settings(request))
    config_id, ws = path_id(request, "notification"), _ws_of(request)
    body = await read_body(request, NotificationPatchBody)
    await _found(api, org, config_id, ws)
    if body.url is not None:
        await _guarded(body.url)
    cmd = nt.SaveConfig(
        actor=who.user,
        config_id=config_id,
        org=org,
        name=body.name,
        destination=body.destination,
        url=body.url,
        triggers=list(body.triggers) if body.triggers is not None else None,
        enabled=body.enabled,
        has_token=bool(body.token) if body.token is not None else None,
    )
    if body.token:
        await _tokens(request).put(org, config_id, body.token)
    elif body.token == "":
        await _tokens(request).delete(org, config_id)
    state, seq = await _command(api, org, cmd)
    return await written(
        api,
        seq,
        lambda: api.read.integrations.notification(org, config_id),
        lambda: _row(state.config),
        status=200,
    )


async def delete_config(request: web.Request) -> web.Response:
    api, org, who = await scope(request, _settings(request))
    config_id, ws = path_id(request, "notification"), _ws_of(request)
    cfg = await _found(api, org, config_id, ws)
    _, seq = await _command(api, org, nt.DeleteConfig(actor=who.user, config_id=config_id))
    if cfg.has_token and secrets_api.SECRETS in request.app:
        await _tokens(request).delete(org, config_id)
    await api.after_write(seq)
    return web.Response(status=204, headers={SEQ_HEADER: str(seq)})


async def deliveries(request: web.Request) -> web.Response:
    api, org, _ = await scope(request, _reading(request))
    config_id, ws = path_id(request, "notification"), _ws_of(request)
    await _found(api, org, config_id, ws)
    return items(await api.read.integrations.notify_attempts(org, config_id))


async def verify(request: web.Request) -> web.Response:
    """Send a `verification` payload now and answer with the receiver's response (the
    attempt is recorded like any other; a verification is never retried)."""
    api, org, _ = await scope(request, _settings(request))
    config_id, ws = path_id(request, "notification"), _ws_of(request)
    cfg = await _found(api, org, config_id, ws)
    token = await _tokens(request).get(org, config_id) if cfg.has_token else ""
    now = api.app.clock()
    view = formats.RunView(org=org, workspace=cfg.workspace, run_id="", updated_at=now)
    did = f"v{api.app.ids()}"
    job = await outbox.schedule(api.app.store, cfg, view, nt.VERIFICATION, 0, now, delivery=did)
    assert job is not None  # new: not finished
    policy = Policy(allow=guard.allowed_from_env(), schedule=())
    headers = {
        "Content-Type": job.content_type,
        **signing.headers(token, job.body, did, now.timestamp()),
    }
    async with Sender(policy) as sender:
        answer = await sender.send(cfg.url, job.body, headers)
    event = outcome(job, answer, policy, api.app.clock())
    seq = await outbox.recorder(api.app.store)(job, event)
    return json_response(
        {
            "delivery_id": did,
            "delivered": answer.delivered,
            "response_code": answer.status or None,
            "response_excerpt": answer.excerpt,
            "error": answer.error or None,
        },
        headers={SEQ_HEADER: str(seq)},
    )


# ---------------------------------------------------------------- OpenAPI

_CONFIG: Doc = {
    "type": "object",
    "required": ["id", "name", "destination", "url", "triggers", "enabled", "has_token"],
    "properties": {
        "id": STR,
        "name": STR,
        "destination": {"enum": list(nt.DESTINATIONS)},
        "url": STR,
        "triggers": {"type": "array", "items": {"enum": list(nt.TRIGGERS)}},
        "enabled": BOOL,
        "has_token": {**BOOL, "description": "a token is set (it is never answered)"},
        "workspace": {"type": ["string", "null"]},
        "created_at": STR,
        "created_by": STR,
        "updated_at": {"type": ["string", "null"]},
    },
}
_ATTEMPT: Doc = {
    "type": "object",
    "properties": {
        "delivery_id": STR,
        "attempt": {"type": "integer"},
        "trigger": STR,
        "run_id": {"type": ["string", "null"]},
        "at": STR,
        "response_code": {"type": ["integer", "null"]},
        "response_excerpt": STR,
        "error": {"type": ["string", "null"]},
        "outcome": {"enum": ["delivered", "retry", "failed", "gave_up"]},
        "next_retry_at": {"type": ["string", "null"]},
    },
}
_VERIFY: Doc = {
    "type": "object",
    "properties": {
        "delivery_id": STR,
        "delivered": BOOL,
        "response_code": {"type": ["integer", "null"]},
        "response_excerpt": STR,
        "error": {"type": ["string", "null"]},
    },
}
SCHEMAS: dict[str, Doc] = {
    **msgspec.json.schema_components((NotificationBody, NotificationPatchBody), ref_template=REF)[
        1
    ],
    "Notification": _CONFIG,
    "NotificationList": list_of("Notification"),
    "NotificationAttempt": _ATTEMPT,
    "NotificationAttemptList": list_of("NotificationAttempt"),
    "NotificationVerification": _VERIFY,
}
PARAMETERS: dict[str, Doc] = {
    "notification": path_param("notification", "notification configuration id")
}


def body(name: str) -> Doc:
    return {"required": True, "content": {"application/json": {"schema": ref(name)}}}


def _paths(prefix: str, scope_params: list[str], tag: str) -> dict[str, Doc]:
    """The notification operations at one scope (an organization or a workspace)."""
    params = [{"$ref": f"#/components/parameters/{p}"} for p in scope_params]
    one = [*params, {"$ref": "#/components/parameters/notification"}]
    config = f"{prefix}/notifications/{{notification}}"
    return {
        f"{prefix}/notifications": _collection(params, tag),
        config: _config(one, tag),
        f"{config}/verify": _verify(one, tag),
        f"{config}/deliveries": _deliveries(one, tag),
    }


def _collection(params: list[Doc], tag: str) -> Doc:
    return {
        "get": {
            "operationId": f"list{tag}Notifications",
            "summary": "Notification configurations",
            "parameters": params,
            "responses": {"200": ok("NotificationList"), **problems(403, 404, 422)},
        },
        "post": {
            "operationId": f"create{tag}Notification",
            "summary": "Create a notification configuration (the token is write-only)",
            "parameters": params,
            "requestBody": body("NotificationBody"),
            "responses": {
                "201": ok("Notification", seq=True),
                **problems(400, 403, 404, 422, 503),
            },
        },
    }


def _config(one: list[Doc], tag: str) -> Doc:
    return {
        "get": {
            "operationId": f"get{tag}Notification",
            "summary": "A notification configuration",
            "parameters": one,
            "responses": {"200": ok("Notification"), **problems(403, 404, 422)},
        },
        "patch": {
            "operationId": f"patch{tag}Notification",
            "summary": 'Change the fields given (token "" removes it)',
            "parameters": one,
            "requestBody": body("NotificationPatchBody"),
            "responses": {
                "200": ok("Notification", seq=True),
                **problems(400, 403, 404, 422, 503),
            },
        },
        "delete": {
            "operationId": f"delete{tag}Notification",
            "summary": "Delete a notification configuration",
            "parameters": one,
            "responses": {"204": {"description": "deleted"}, **problems(403, 404, 422)},
        },
    }


def _verify(one: list[Doc], tag: str) -> Doc:
    return {
        "post": {
            "operationId": f"verify{tag}Notification",
            "summary": "Send a verification payload; answers the receiver's response",
            "parameters": one,
            "responses": {
                "200": ok("NotificationVerification", seq=True),
                **problems(403, 404, 422, 503),
            },
        },
    }


def _deliveries(one: list[Doc], tag: str) -> Doc:
    return {
        "get": {
            "operationId": f"list{tag}NotificationDeliveries",
            "summary": "Every delivery attempt, newest first",
            "parameters": one,
            "responses": {"200": ok("NotificationAttemptList"), **problems(403, 404, 422)},
        },
    }


PATHS: dict[str, Doc] = {
    **_paths("/api/v1/orgs/{org}", ["org"], "Org"),
    **_paths("/api/v1/orgs/{org}/workspaces/{ws}", ["org", "ws"], "Workspace"),
}


def routes(org: str, ws: str) -> list[web.RouteDef]:
    """The routes, at organization and workspace level."""
    out = []
    for prefix in (org, ws):
        one = prefix + "/notifications/{notification}"
        out += [
            web.get(prefix + "/notifications", list_configs, allow_head=False),
            web.post(prefix + "/notifications", create),
            web.get(one, get_config, allow_head=False),
            web.patch(one, patch_config),
            web.delete(one, delete_config),
            web.post(one + "/verify", verify),
            web.get(one + "/deliveries", deliveries, allow_head=False),
        ]
    return out
