"""Requests from Slack: proven by signature, answered within Slack's 3 seconds.

No runplane token: Slack signs each request with the app's signing secret
(services/processes/chat/signing.py). Its signature's and timestamp's headers are judged
before a byte of its body is read; the raw body is read (bounded, few at a time); its
team id finds the organizations whose app names that team (one runplane serves the
Slack apps of many Slack workspaces), and the request is theirs only if one of their
signing secrets signs it. So a request proves its organization: another team's id, or
another organization's secret, proves nothing here, and an organization that names
someone else's team cannot take their requests (it does not hold their secret). The
organization is never taken from anything else in the request.

Then, within the 3 seconds: an unmapped Slack user's slash command hears so and nothing
is recorded (a button's click is recorded: Slack shows nothing of the answer to a click,
so the worker replies through response_url, and does nothing else); a query (`help`,
`status`, `runs`) is answered at once from this replica's read model; anything that
writes is recorded (`chat.slack_request_received`, on an empty subject named by the
signature, so a replay is refused) and acknowledged, and the worker
(services/processes/chat/worker.py) does it and posts the outcome to `response_url`.
"""

from __future__ import annotations

import urllib.parse
from datetime import datetime
from typing import Any

import msgspec
import structlog
from aiohttp import web

from events import chat as chat_agg
from events.errors import Conflict
from infra import jsonbody
from infra.eventstore import Append
from services.processes.chat import signing
from services.processes.chat import text as tx
from services.processes.chat.config import SIGNING_SECRET, ChatConfig, NotLinked, Who
from services.surfaces.api.common import json_response
from services.surfaces.api.context import API, Api
from services.surfaces.api.problems import Problem, unauthorized
from services.surfaces.webhooks.intake import INTAKE

log = structlog.get_logger(__name__)

MAX_BODY = 64 * 1024  # Slack's are a few KiB
CONFIG_WAIT_S = 2.0  # for an app configured a moment ago, maybe through another replica


class Signed(msgspec.Struct, frozen=True, kw_only=True):
    """A verified request: its organization, id, and fields as Slack sent them."""

    org: str
    request_id: str
    fields: dict[str, Any]


async def verified(request: web.Request, config: ChatConfig, kind: chat_agg.Kind) -> Signed:
    """The request, proven by its signature to come from an organization's Slack app;
    401 otherwise (missing, malformed, old, or matching no organization's secret).

    Its headers are judged before its body is read; the body is read within one of the
    process's slots for unproven bodies (services/surfaces/webhooks/intake.py), at most
    MAX_BODY bytes (or the deployment's `--webhook-max-body` if less). The organization,
    so the secret, is known only from the body's team id (Slack sends it nowhere else):
    the body is held until its signature is checked, inside that slot."""
    api = request.app[API]
    try:
        sig = signing.check_format(request.headers.get("X-Slack-Signature"))
        ts = request.headers.get("X-Slack-Request-Timestamp")
        signing.check_timestamp(ts, api.app.clock())
        assert ts is not None  # checked
    except signing.SignatureError as e:
        raise unauthorized(str(e)) from e
    intake = request.app[INTAKE]
    with intake.slot("slack"):
        body = await intake.read(request, cap=min(MAX_BODY, intake.limits.max_body))
        fields = _fields(body, kind)
        team = _team(fields, kind)
        for org in await _candidates(api, team):
            secret = await config.secret(org, SIGNING_SECRET)
            if secret and signing.matches(secret, ts, body, sig):
                return Signed(org=org, request_id=signing.request_id(sig), fields=fields)
    log.warning("slack_signature_refused", team=team[:32])
    raise unauthorized("the request's signature matches no organization's Slack app")


def _fields(body: bytes, kind: chat_agg.Kind) -> dict[str, Any]:
    """The form fields (commands), or the `payload` JSON (interactions); unverified yet:
    read only to find whose secret to try. A payload no JSON reader should take (too
    deep, a key repeated: infra/jsonbody.py) is a 400 and a warning, whoever signed it."""
    try:
        form = {k: v[0] for k, v in urllib.parse.parse_qs(body.decode(), max_num_fields=64).items()}
    except (UnicodeDecodeError, ValueError) as e:
        raise unauthorized("the request is not a Slack form") from e
    if kind == "command":
        return form
    try:
        payload = jsonbody.decode(form.get("payload", "").encode())
    except jsonbody.BodyError as e:
        log.warning("slack_body_refused", reason=str(e))
        raise Problem("invalid-body", f"the Slack payload is refused: {e}") from e
    except msgspec.DecodeError as e:
        raise unauthorized("the request has no Slack payload") from e
    if not isinstance(payload, dict):
        raise unauthorized("the request has no Slack payload")
    return payload


def _team(fields: dict[str, Any], kind: chat_agg.Kind) -> str:
    team = fields.get("team_id") if kind == "command" else get(fields, "team", "id")
    if not isinstance(team, str) or not chat_agg.valid_slack_id(team):
        raise unauthorized("the request names no Slack team")
    return team


async def _candidates(api: Api, team: str) -> list[str]:
    """The organizations whose app names `team`; a miss waits (bounded) for the read
    model to reach the stream's end: the app may be a moment old."""
    orgs = await api.read.integrations.slack_orgs(team)
    if not orgs:
        await api.reached(await api.app.store.last_seq(), CONFIG_WAIT_S)
        orgs = await api.read.integrations.slack_orgs(team)
    return orgs  # only the deployment's admin makes organizations: a handful at most


def get(data: Any, *path: str) -> Any:
    """`data[path[0]][path[1]]...`, or None where the payload has no such object."""
    for key in path:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def _str(value: Any, limit: int = 4000) -> str:
    return value[:limit] if isinstance(value, str) else ""


# ---------------------------------------------------------------- what came


def received(
    signed: Signed, kind: chat_agg.Kind, config: ChatConfig, now: datetime
) -> chat_agg.SlackRequestReceived:
    """The event recording a verified request."""
    f = signed.fields
    if kind == "command":
        user, channel, ts = _str(f.get("user_id")), _str(f.get("channel_id")), ""
        team, text, action, value = _str(f.get("team_id")), _str(f.get("text")), "", ""
    else:
        user, channel = _str(get(f, "user", "id")), _str(get(f, "channel", "id"))
        ts = _str(get(f, "container", "message_ts")) or _str(get(f, "message", "ts"))
        team, text = _str(get(f, "team", "id")), ""
        acts = f.get("actions")
        first = acts[0] if isinstance(acts, list) and acts else {}
        action, value = _str(get(first, "action_id"), 255), _str(get(first, "value"), 2000)
    url = _str(f.get("response_url"), 2000)
    return chat_agg.SlackRequestReceived(
        at=now,
        actor=user,
        request_id=signed.request_id,
        kind=kind,
        team_id=team,
        slack_user=user,
        channel=channel,
        message_ts=ts,
        text=text,
        action_id=action,
        value=value,
        response_url=config.seal_url(signed.org, signed.request_id, url) if url else "",
    )


async def record(api: Api, org: str, event: chat_agg.SlackRequestReceived) -> int:
    """Append the request on its own, empty subject; a replay (the same signature, so the
    same subject) is refused 401."""
    subject = chat_agg.request_subject(org, event.request_id)
    append = Append(subject=subject, event=event, expected=0, msg_id=api.app.ids())
    try:
        return await api.app.store.append([append])
    except Conflict as e:
        log.warning("slack_request_replayed", org=org, request_id=event.request_id)
        raise unauthorized("this signed request was received already (a replay)") from e


async def who_or_reply(config: ChatConfig, org: str, slack_user: str) -> Who | web.Response:
    """The runplane caller; or, for an unmapped Slack user, the ephemeral reply saying so."""
    if not chat_agg.valid_slack_id(slack_user):
        return json_response(tx.reply("this request names no Slack user"))
    try:
        return await config.who(org, slack_user)
    except NotLinked as e:
        return json_response(tx.reply(tx.escape(str(e))))
