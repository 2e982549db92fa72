"""An organization's Slack app: its aggregate, its sealed secrets, and who a Slack user is.

The signing secret and the bot token are sealed with the key ring into the secrets
bucket (as secret variables are: services/app/secrets.py), under keys no workspace can have
(`<org>._chat.<name>`: a workspace name never starts with `_`), each bound to its key
name. Events say only that they were set (events/chat.py).

Who a Slack user is, is read from the aggregates, never the read model (never stale): the
mapping from the chat aggregate, and from the organization's own history their access
(events/access.py): a mapped user of the organization (by email or id) has their teams'
access, nothing once suspended; a mapped token user name of before users has the role of
the highest of their tokens that are neither revoked nor expired (a user whose tokens
are all revoked can do nothing from Slack either); and their groups.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from datetime import datetime

import msgspec
from nats.aio.client import Client as NATS

from events import access, approval
from events import chat as chat_agg
from events import members as mb
from events import org as org_agg
from events.codec import org_subject
from events.errors import NotFound
from events.teams import LEVELS
from infra.crypto import CryptoError, KeyRing
from infra.kv import SECRETS_BUCKET, last_values
from services.app.aggregates import CHAT
from services.app.commands import App
from services.app.execute import Result

SIGNING_SECRET = "slack-signing-secret"
BOT_TOKEN = "slack-bot-token"


class ChatError(Exception):
    """Root of chat-ops errors; `slug` names the problem answered to Slack or the API."""

    retryable = False
    slug = "chat-error"


class NotLinked(ChatError):
    """The Slack user is not mapped, or maps to a user with no standing in the org."""

    slug = "forbidden"


def secret_key(org: str, name: str) -> str:
    return f"{org}._chat.{name}"


class Who(msgspec.Struct, frozen=True, kw_only=True):
    """A Slack user as runplane sees them: the core's Caller, and the Slack ids."""

    caller: approval.Caller
    slack_user: str
    access: access.Access


class ChatConfig:
    """The Slack side of every organization, over the App's store and the key ring."""

    def __init__(self, nc: NATS, app: App, keyring: KeyRing) -> None:
        self.nc = nc
        self.app = app
        self.keyring = keyring

    # ------------------------------------------------------------ sealed values

    async def put_secret(self, org: str, name: str, value: str) -> None:
        kv = await self.nc.jetstream().key_value(SECRETS_BUCKET)
        key = secret_key(org, name)
        await kv.put(key, self.keyring.seal(value.encode(), key))

    async def forget_secrets(self, org: str) -> None:
        """Purge the app's sealed secrets (the app was removed)."""
        kv = await self.nc.jetstream().key_value(SECRETS_BUCKET)
        for name in (SIGNING_SECRET, BOT_TOKEN):
            await kv.purge(secret_key(org, name))

    async def secret(self, org: str, name: str) -> str:
        """The clear value, or "" if none is set (or it no longer opens)."""
        key = secret_key(org, name)
        found = await last_values(self.nc, SECRETS_BUCKET, key)
        sealed = found.get(key)
        if not sealed:
            return ""
        try:
            return self.keyring.open(sealed, key).decode()
        except CryptoError:
            return ""

    def seal_url(self, org: str, request_id: str, url: str) -> str:
        sealed = self.keyring.seal(url.encode(), _url_context(org, request_id))
        return base64.b64encode(sealed).decode()

    def open_url(self, org: str, request_id: str, sealed: str) -> str:
        """The response_url of a request; "" if it does not open (another org's, altered)."""
        try:
            raw = base64.b64decode(sealed, validate=True)
            return self.keyring.open(raw, _url_context(org, request_id)).decode()
        except (ValueError, CryptoError):
            return ""

    # ------------------------------------------------------------ the aggregate

    async def load(self, org: str) -> tuple[chat_agg.SlackState, int]:
        loaded = await self.app.load(CHAT, chat_agg.config_subject(org))
        return loaded.state, loaded.seq

    async def command(self, org: str, command: chat_agg.ChatCommand) -> Result[chat_agg.SlackState]:
        """Decide and append a command on the organization's Slack app (which must exist)."""
        if not (await self.app.load_org(org)).state.exists:
            raise NotFound(f"organization {org} not found")
        return await self.app.execute(CHAT, chat_agg.config_subject(org), command)

    # ------------------------------------------------------------ who asks

    async def who(self, org: str, slack_user: str) -> Who:
        """The runplane caller a Slack user acts as in `org`; NotLinked if none."""
        state, _ = await self.load(org)
        user = state.users.get(slack_user)
        if user is None:
            raise NotLinked(
                f"Slack user {slack_user} is not linked to a runplane user of {org}: "
                "an admin maps them (PUT .../chat/slack/users/<slack id>)"
            )
        envs = await self.app.store.read(org_subject(org))
        events = [e.event for e in envs]
        org_state = org_agg.fold(events)  # type: ignore[arg-type]  # the org's own subject
        role, found = _access_of(org, org_state, events, user, self.app.clock())
        groups = approval.groups_of(found.user, org_state.groups)
        caller = approval.Caller(user=found.user, role=role, groups=groups, teams=list(found.teams))
        return Who(caller=caller, slack_user=slack_user, access=found)

    async def allow(self, org: str, who: Who, action: str, ws: str) -> Who:
        """`who`, once they may `action` on workspace `ws` (events/access.py), with their
        level there in the caller the core's approval rule reads."""
        folder = (await self.app.load_ws(org, ws)).state.folder
        target = access.Target(org=org, workspace=ws, folders=(folder,) if folder else ())
        access.require(who.access, action, target)
        level = LEVELS[who.access.level_on(target)]
        return msgspec.structs.replace(who, caller=msgspec.structs.replace(who.caller, level=level))


def _access_of(
    org: str, state: org_agg.OrgState, events: Sequence[object], user: str, now: datetime
) -> tuple[str, access.Access]:
    """(role, access) of a mapped user: a user of the organization (email or id) has
    their teams' access; a token user name, the role of their live tokens."""
    email = "@" in user and user.isascii()  # no user of a non-ASCII email (members.py)
    user_id = user if user.startswith("u-") else mb.user_id_of(user) if email else ""
    member = state.members.get(user_id) if user_id else None
    if member is not None:
        found = access.for_member(org, member, state.teams)
        if found is None:
            raise NotLinked(f"{member.email} is suspended in {org}")
        return "", access.inherited(found, state.folders)
    role = standing(events, user, now)
    if not role:
        raise NotLinked(f"{user} holds no valid token in {org}, so no role: an admin issues one")
    return role, access.for_role(org, user, role)


def standing(events: Sequence[object], user: str, now: datetime) -> str:
    """The highest role among `user`'s tokens that are neither revoked nor expired at
    `now`, from the organization's history; "" if none."""
    issued: dict[str, org_agg.TokenIssued] = {}
    for e in events:
        if isinstance(e, org_agg.TokenIssued) and e.user == user:
            issued[e.token_id] = e
        elif isinstance(e, org_agg.TokenRevoked):
            issued.pop(e.token_id, None)
    live = [t.role for t in issued.values() if t.expires_at is None or t.expires_at > now]
    ranked = [r for r in org_agg.ROLES if r in live]
    return ranked[-1] if ranked else ""


def _url_context(org: str, request_id: str) -> str:
    return f"slack-response-url:{org}:{request_id}"
