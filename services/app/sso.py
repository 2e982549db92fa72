"""Single sign-on's configuration per organization, its sealed client secret, and the one
hook that turns a verified person into a runplane user.

The configuration is the aggregate of events/sso.py on `rp.org.<org>.sso`. Its client
secret is sealed with the key ring into the secrets bucket under a key no workspace can
have (`<org>._sso.client-secret`: a workspace name never starts with `_`), bound to that
key's name: it is write-only, never in an event, an answer or a log.

`SignIn` is the hook that turns the verified person into a user: `sign_in_user` of
services/app/identity.py (it creates or finds the user, keyed by email with the first
(issuer, subject) kept, sets the team memberships the groups give through each team's
`idp_groups`, and issues the session's personal token). It is called in one place only,
`SsoFlows.finish` (services/app/sso_flows.py).
"""

from __future__ import annotations

from typing import Protocol

import msgspec
from nats.aio.client import Client as NATS

from events import sso
from events.errors import NotFound
from infra.crypto import CryptoError, KeyRing
from infra.eventstore import LATEST
from infra.kv import SECRETS_BUCKET, last_values
from services.app.aggregates import SSO
from services.app.commands import App
from services.app.execute import Result
from services.app.identity import SignedIn, sign_in_user

CLIENT_SECRET = "client-secret"


def secret_key(org: str) -> str:
    return f"{org}._sso.{CLIENT_SECRET}"


class Person(msgspec.Struct, frozen=True, kw_only=True):
    """Who the identity provider vouched for, every claim checked."""

    org: str
    email: str
    name: str
    groups: list[str]
    issuer: str
    subject: str


class SignIn(Protocol):
    """The identity hook: services/app/identity.py `sign_in_user` over an App."""

    async def __call__(
        self,
        org: str,
        *,
        email: str,
        name: str,
        groups: list[str],
        issuer: str,
        subject: str,
        rules: list[tuple[str, str]],
    ) -> SignedIn: ...


def sign_in_of(app: App) -> SignIn:
    """The identity hook over `app`: the person becomes (or is found as) a user of the
    organization, their teams set from their groups, with a personal token for the
    session."""

    async def sign_in(
        org: str,
        *,
        email: str,
        name: str,
        groups: list[str],
        issuer: str,
        subject: str,
        rules: list[tuple[str, str]],
    ) -> SignedIn:
        return await sign_in_user(
            app, org, email=email, name=name, groups=groups, issuer=issuer, subject=subject,
            rules=rules,
        )  # fmt: skip

    return sign_in


class SsoConfigs:
    """Every organization's single sign-on, over the App's store and the key ring."""

    def __init__(self, nc: NATS, app: App, keyring: KeyRing) -> None:
        self.nc = nc
        self.app = app
        self.keyring = keyring

    async def load(self, org: str, *, latest: bool = False) -> sso.SsoState:
        """The organization's configuration (`latest`: as the stream's leader has it)."""
        subject = sso.config_subject(org)
        loaded = await self.app.load(SSO, subject, min_seq=LATEST if latest else 0)
        return loaded.state

    async def command(self, org: str, command: sso.SsoCommand) -> Result[sso.SsoState]:
        if not (await self.app.load_org(org)).state.exists:
            raise NotFound(f"organization {org} not found")
        return await self.app.execute(SSO, sso.config_subject(org), command)

    async def put_secret(self, org: str, value: str) -> None:
        kv = await self.nc.jetstream().key_value(SECRETS_BUCKET)
        key = secret_key(org)
        await kv.put(key, self.keyring.seal(value.encode(), key))

    async def forget_secret(self, org: str) -> None:
        kv = await self.nc.jetstream().key_value(SECRETS_BUCKET)
        await kv.purge(secret_key(org))

    async def secret(self, org: str) -> str:
        """The clear client secret, "" if none is set (a public client) or it no longer
        opens (sealed with a key the ring lost, or copied from another key)."""
        key = secret_key(org)
        sealed = (await last_values(self.nc, SECRETS_BUCKET, key)).get(key)
        if not sealed:
            return ""
        try:
            return self.keyring.open(sealed, key).decode()
        except CryptoError:
            return ""
