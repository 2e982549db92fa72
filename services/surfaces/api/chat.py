"""Chat-ops over HTTP: an organization's Slack app and users (an admin's, with a token),
and the two endpoints Slack itself calls (signed, no token: services/surfaces/webhooks/slack.py).

`PUT .../chat/slack` `{"team_id", "signing_secret", "bot_token"}`: the secrets are
write-only (sealed, shown as `(sensitive)`); the first PUT needs the signing secret, a
later one may leave either out to keep it. `PUT .../chat/slack/users/{slack_id}`
`{"user"}` says which runplane user a Slack user is; what they may do is what that user
may (their tokens' role, their groups, the workspace's approvers, four-eyes).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from aiohttp import web

from events import access
from events import chat as chat_agg
from events.chat import SlackState
from events.users import MAX_USER
from events.values import SENSITIVE
from services.processes.chat import text as tx
from services.processes.chat.config import BOT_TOKEN, SIGNING_SECRET, ChatConfig, Who
from services.surfaces.api.bodies import Body, read_body
from services.surfaces.api.common import Row, command_answer, items, json_response, scope
from services.surfaces.api.context import API
from services.surfaces.api.problems import Problem
from services.surfaces.api.schemas import (
    BOOL,
    REF,
    STR,
    TIME,
    Doc,
    json_content,
    list_of,
    operation,
    problems,
)
from services.surfaces.api.secrets import SECRETS
from services.surfaces.webhooks import slack as inbound
from services.surfaces.webhooks.intake import closes_unread

SLACK = "/api/v1/orgs/{org}/chat/slack"
Secret = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]


class SlackAppBody(Body, frozen=True, kw_only=True):
    team_id: Annotated[str, msgspec.Meta(description="the Slack workspace's id (T...)")]
    signing_secret: Secret | None = None
    bot_token: Secret | None = None


class SlackUserBody(Body, frozen=True, kw_only=True):
    user: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_USER)]


def config_of(request: web.Request) -> ChatConfig:
    store = request.app.get(SECRETS)
    if store is None:
        raise Problem("unavailable", "chat-ops need the encryption key; this api has none")
    return ChatConfig(store.nc, request.app[API].app, store.keyring)


def _slack_id(request: web.Request) -> str:
    value = request.match_info["slack_id"]
    if not chat_agg.valid_slack_id(value):
        raise Problem("invalid-id", f"{value[:64]!r} is not a Slack user id")
    return value


def _app_row(state: SlackState) -> Row:
    return {
        "team_id": state.team_id,
        "signing_secret": SENSITIVE,
        "bot_token": SENSITIVE if state.bot_token else None,
        "configured_at": state.configured_at.isoformat() if state.configured_at else None,
        "configured_by": state.configured_by,
        "users": len(state.users),
    }


# ---------------------------------------------------------------- the app and its users


async def put_slack(request: web.Request) -> web.Response:
    """PUT .../chat/slack: configure the organization's Slack app."""
    api, org, who = await scope(request, "org.settings")
    body = await read_body(request, SlackAppBody)
    config = config_of(request)
    state, _ = await config.load(org)
    if body.signing_secret is None and not state.configured:
        raise Problem("invalid-command", "the first configuration needs the signing_secret")
    if not chat_agg.valid_slack_id(body.team_id):
        raise Problem("invalid-command", f"team_id {body.team_id[:64]!r} is not a Slack id")
    await api.app.load_org(org)
    if body.signing_secret is not None:
        await config.put_secret(org, SIGNING_SECRET, body.signing_secret)
    if body.bot_token is not None:
        await config.put_secret(org, BOT_TOKEN, body.bot_token)
    bot = body.bot_token is not None or state.bot_token
    cmd = chat_agg.ConfigureSlack(actor=who.user, team_id=body.team_id, bot_token=bot)
    result = await config.command(org, cmd)
    await api.after_write(result.seq)  # the next signed request may come to this replica
    return command_answer(_app_row(result.state), result.seq)


async def get_slack(request: web.Request) -> web.Response:
    _, org, _ = await scope(request, "org.settings")
    state, _ = await config_of(request).load(org)
    if not state.configured:
        raise Problem("not-found", f"organization {org} has no Slack app")
    return json_response(_app_row(state))


async def delete_slack(request: web.Request) -> web.Response:
    _, org, who = await scope(request, "org.settings")
    config = config_of(request)
    result = await config.command(org, chat_agg.RemoveSlack(actor=who.user))
    await config.forget_secrets(org)  # after: a request until then is still the app's
    return web.Response(status=204, headers={"RP-Seq": str(result.seq)})


async def put_slack_user(request: web.Request) -> web.Response:
    """PUT .../chat/slack/users/{slack_id} {"user"}: the Slack user acts as `user`."""
    _, org, who = await scope(request, "org.settings")
    slack_id = _slack_id(request)
    body = await read_body(request, SlackUserBody)
    cmd = chat_agg.MapSlackUser(actor=who.user, slack_id=slack_id, user=body.user)
    result = await config_of(request).command(org, cmd)
    return command_answer({"slack_id": slack_id, "user": body.user}, result.seq)


async def get_slack_user(request: web.Request) -> web.Response:
    _, org, _ = await scope(request, "org.settings")
    slack_id = _slack_id(request)
    state, _ = await config_of(request).load(org)
    if slack_id not in state.users:
        raise Problem("not-found", f"Slack user {slack_id} is not mapped")
    return json_response({"slack_id": slack_id, "user": state.users[slack_id]})


async def list_slack_users(request: web.Request) -> web.Response:
    _, org, _ = await scope(request, "org.settings")
    state, _ = await config_of(request).load(org)
    return items([{"slack_id": k, "user": v} for k, v in sorted(state.users.items())])


async def delete_slack_user(request: web.Request) -> web.Response:
    _, org, who = await scope(request, "org.settings")
    cmd = chat_agg.UnmapSlackUser(actor=who.user, slack_id=_slack_id(request))
    result = await config_of(request).command(org, cmd)
    return web.Response(status=204, headers={"RP-Seq": str(result.seq)})


# ---------------------------------------------------------------- Slack's own calls


async def slack_command(request: web.Request) -> web.Response:
    """POST /api/v1/chat/slack/commands: a slash command, signed by Slack."""
    config = config_of(request)
    signed = await inbound.verified(request, config, "command")
    who = await inbound.who_or_reply(config, signed.org, str(signed.fields.get("user_id", "")))
    if isinstance(who, web.Response):
        return who
    try:
        parsed = tx.parse(str(signed.fields.get("text", "")))
    except tx.BadCommand as e:
        return json_response(tx.reply(str(e)))
    if parsed.verb not in tx.WRITES:
        return json_response(await _query(request, signed.org, parsed, who))
    api = request.app[API]
    event = inbound.received(signed, "command", config, api.app.clock())
    await inbound.record(api, signed.org, event)
    what = f"{parsed.verb} {parsed.arg}".strip()
    return json_response(
        tx.reply(f"Working on `{tx.escape(what)}` as {tx.escape(who.caller.user)}…")
    )


async def slack_interaction(request: web.Request) -> web.Response:
    """POST /api/v1/chat/slack/interactions: a button, signed by Slack."""
    config = config_of(request)
    signed = await inbound.verified(request, config, "interaction")
    if signed.fields.get("type") != "block_actions":
        return web.Response(status=200)  # nothing runplane offers
    # Slack shows nothing of this answer's body: whoever clicked, the worker replies
    # through response_url (an unmapped user hears that they are not linked, no more).
    api = request.app[API]
    event = inbound.received(signed, "interaction", config, api.app.clock())
    await inbound.record(api, signed.org, event)
    return web.Response(status=200)


def _reads(who: Who, org: str, ws: str, folder: str | None) -> bool:
    target = access.Target(org=org, workspace=ws, folders=(folder,) if folder else ())
    return access.allowed(who.access, "workspace.read", target)


async def _query(request: web.Request, org: str, parsed: tx.Parsed, who: Who) -> tx.Message:
    """help, status and runs: read from this replica's projection, answered at once, of
    the workspaces the mapped user may read (events/access.py)."""
    read = request.app[API].read
    if parsed.verb == "help":
        return tx.reply(tx.help_text())
    if parsed.verb == "runs":
        status = [parsed.arg] if parsed.arg else None
        runs = await read.runs.find(org, status=status, limit=10)
        if not who.access.uniform(access.READ):
            folders = await read.workspaces.folders(org)
            mine = {ws for ws, folder in folders.items() if _reads(who, org, ws, folder)}
            runs = [r for r in runs if r["workspace"] in mine]
        lines = [tx.run_line(r) for r in runs] or ["no runs"]
        return tx.reply("\n".join(lines))
    ws = await read.workspaces.get(org, parsed.arg)
    folder = await read.workspaces.folder_of(org, parsed.arg)
    if ws is None or not _reads(who, org, ws["name"], folder):
        return tx.reply(f"workspace {tx.shown(parsed.arg)} not found")
    active = await read.runs.get(org, ws["active_run"]) if ws.get("active_run") else None
    lines = [f"*{tx.escape(parsed.arg)}*: " + (tx.run_line(active) if active else "idle")]
    if ws.get("queue"):
        waiting = ", ".join(f"`{tx.escape(r)}`" for r in ws["queue"][:5])
        more = len(ws["queue"]) - 5
        lines.append(f"waiting: {waiting}" + (f" and {more} more" if more > 0 else ""))
    if ws.get("lock"):
        lines.append(f"locked by {tx.escape(ws['lock'].get('holder', '?'))}")
    return tx.reply("\n".join(lines))


ROUTES = [
    web.put(SLACK, put_slack),
    web.get(SLACK, get_slack, allow_head=False),
    web.delete(SLACK, delete_slack),
    web.get(SLACK + "/users", list_slack_users, allow_head=False),
    web.put(SLACK + "/users/{slack_id}", put_slack_user),
    web.get(SLACK + "/users/{slack_id}", get_slack_user, allow_head=False),
    web.delete(SLACK + "/users/{slack_id}", delete_slack_user),
    # a refusal before their body is read closes the connection (webhooks/intake.py)
    web.post("/api/v1/chat/slack/commands", closes_unread(slack_command)),
    web.post("/api/v1/chat/slack/interactions", closes_unread(slack_interaction)),
]
PUBLIC = frozenset({"/api/v1/chat/slack/commands", "/api/v1/chat/slack/interactions"})


# ---------------------------------------------------------------- OpenAPI

_SLACK_APP: Doc = {
    "type": "object",
    "required": ["team_id", "signing_secret"],
    "properties": {
        "team_id": STR,
        "signing_secret": {"const": SENSITIVE},
        "bot_token": {"anyOf": [{"const": SENSITIVE}, {"type": "null"}]},
        "configured_at": {"anyOf": [TIME, {"type": "null"}]},
        "configured_by": STR,
        "users": {"type": "integer"},
    },
}
_SLACK_USER: Doc = {
    "type": "object",
    "required": ["slack_id", "user"],
    "properties": {"slack_id": STR, "user": STR},
}
SCHEMAS: dict[str, Doc] = {
    **msgspec.json.schema_components((SlackAppBody, SlackUserBody), ref_template=REF)[1],
    "SlackApp": _SLACK_APP,
    "SlackUser": _SLACK_USER,
    "SlackUserList": list_of("SlackUser"),
    "SlackMessage": {
        "type": "object",
        "description": "a Slack message (response_type, text, blocks)",
        "properties": {"response_type": STR, "text": STR, "replace_original": BOOL},
    },
}
PARAMETERS: dict[str, Doc] = {
    "slack_id": {
        "name": "slack_id",
        "in": "path",
        "required": True,
        "description": "a Slack user id (U...)",
        "schema": {**STR, "pattern": chat_agg.SLACK_ID_RE.pattern},
    },
}


def _op(op_id: str, summary: str, answer: tuple[int, str], body: str = "", **kw: Any) -> Doc:
    params = ("org", "slack_id") if kw.pop("user", False) else ("org",)
    errors = (400, 403, 404, 422) if body else (403, 404, 422)
    return operation(op_id, summary, answer, params=params, body=body, errors=errors, **kw)


def _delete(op_id: str, summary: str, *, user: bool = False) -> Doc:
    params = ("org", "slack_id") if user else ("org",)
    return {
        "operationId": op_id,
        "summary": summary,
        "parameters": [{"$ref": f"#/components/parameters/{p}"} for p in params],
        "responses": {"204": {"description": "removed"}, **problems(403, 404, 422)},
    }


def _signed(op_id: str, summary: str) -> Doc:
    return {
        "operationId": op_id,
        "summary": summary,
        "description": "Called by Slack, form-encoded, signed with the app's signing secret "
        "(X-Slack-Signature v0, X-Slack-Request-Timestamp within 5 minutes); no bearer token.",
        "security": [],
        "responses": {
            "200": {"description": "acknowledged", "content": json_content("SlackMessage")},
            **problems(400, 408, 413),
        },
    }


PATHS: dict[str, Doc] = {
    SLACK: {
        "put": _op("putSlackApp", "Configure the Slack app", (200, "SlackApp"), "SlackAppBody"),
        "get": _op("getSlackApp", "The Slack app (secrets never shown)", (200, "SlackApp")),
        "delete": _delete("deleteSlackApp", "Remove the Slack app"),
    },
    SLACK + "/users": {
        "get": _op("listSlackUsers", "Slack users and who they are", (200, "SlackUserList")),
    },
    SLACK + "/users/{slack_id}": {
        "put": _op(
            "putSlackUser",
            "Map a Slack user to a user",
            (200, "SlackUser"),
            "SlackUserBody",
            user=True,
        ),
        "get": _op("getSlackUser", "Who a Slack user is", (200, "SlackUser"), user=True),
        "delete": _delete("deleteSlackUser", "Unmap a Slack user", user=True),
    },
    "/api/v1/chat/slack/commands": {"post": _signed("slackCommand", "A Slack slash command")},
    "/api/v1/chat/slack/interactions": {"post": _signed("slackInteraction", "A Slack button")},
}
