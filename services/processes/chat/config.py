"""An organization's Slack app: its aggregate, its sealed secrets, and who a Slack user is.

The signing secret and the bot token are sealed with the key ring into the secrets
bucket (as secret variables are: services/app/secrets.py), under keys no workspace can have
(`<org>._chat.<name>`: a workspace name never starts with `_`), each bound to its key
name. Events say only that they were set (events/chat.py).

Who a Slack user is, is read from the aggregates, never the read model (never stale): the
mapping from the chat aggregate, and from the organization's own history the user's
role (the highest of the user's tokens there that are neither revoked nor expired: a
user whose tokens are all revoked can do nothing from Slack either) and groups.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from datetime import datetime

import msgspec
from nats.aio.client import Client as NATS

from events import approval
from events import chat as chat_agg
from events import org as org_agg
from events.codec import org_subject
from events.errors import Forbidden, NotFound
from infra.crypto import CryptoError, KeyRing
from infra.kv import SECRETS_BUCKET, last_values
from services.app.aggregates import CHAT
from services.app.commands import App
from services.app.execute import Result

SIGNING_SECRET = "slack-signing-secret"
BOT_TOKEN = "slack-bot-token"
OPERATOR = "operator"  # what creating and canceling runs needs, as in the API


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
        role = standing(events, user, self.app.clock())
        if not role:
            raise NotLinked(
                f"{user} holds no valid token in {org}, so no role: an admin issues one"
            )
        groups = approval.groups_of(user, org_state.groups)
        return Who(
            caller=approval.Caller(user=user, role=role, groups=groups), slack_user=slack_user
        )


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


def require(who: Who, role: str, what: str) -> None:
    """Forbidden unless the caller's role is at least `role` (as the API's routes ask)."""
    roles: tuple[str, ...] = org_agg.ROLES
    if roles.index(who.caller.role) < roles.index(role):
        raise Forbidden(
            f"role {who.caller.role} of {who.caller.user} may not {what}; it needs {role}"
        )


def _url_context(org: str, request_id: str) -> str:
    return f"slack-response-url:{org}:{request_id}"
