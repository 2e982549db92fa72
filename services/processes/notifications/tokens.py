"""Notification tokens: write-only, stored only sealed, like secret variables.

A token is sealed with the key ring into the secrets bucket under
`<org>._notify.<config id>` (a workspace name never starts with `_`, so no workspace's
secret variables list it), bound to that key so a value copied elsewhere does not open.
Events say only whether a token is set.
"""

from __future__ import annotations

import time

import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

from infra.crypto import CryptoError, KeyRing
from infra.kv import SECRETS_BUCKET
from services.processes.notifications import NotifyError

MAX_TOKEN = 4096


class TokenError(NotifyError):
    """A token could not be stored or opened."""


class TokenStore:
    """Sealed tokens in KV. `get` keeps what it opened for `ttl` seconds: a delivery
    signs with a token at most that old (a changed token takes effect within it), and
    a burst of deliveries costs one read of the bucket per configuration, not one each."""

    def __init__(self, nc: NATS, keyring: KeyRing | None, *, ttl: float = 5.0) -> None:
        self.js = nc.jetstream()
        self.keyring = keyring
        self.ttl = ttl
        self._kv: KeyValue | None = None
        self._opened: dict[str, tuple[float, str]] = {}

    def _keys(self) -> KeyRing:
        if self.keyring is None:
            raise TokenError("notification tokens need the encryption key; this process has none")
        return self.keyring

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            self._kv = await self.js.key_value(SECRETS_BUCKET)
        return self._kv

    @staticmethod
    def key(org: str, config_id: str) -> str:
        return f"{org}._notify.{config_id}"

    async def put(self, org: str, config_id: str, token: str) -> None:
        key = self.key(org, config_id)
        kv = await self._bucket()
        await kv.put(key, self._keys().seal(token.encode(), key))
        self._opened.pop(key, None)

    async def delete(self, org: str, config_id: str) -> None:
        kv = await self._bucket()
        self._opened.pop(self.key(org, config_id), None)
        try:
            await kv.purge(self.key(org, config_id))
        except nats.js.errors.NotFoundError:
            pass

    async def get(self, org: str, config_id: str) -> str:
        """The clear token, "" if none is set; TokenError if it does not open."""
        key = self.key(org, config_id)
        kept = self._opened.get(key)
        if kept is not None and time.monotonic() - kept[0] < self.ttl:
            return kept[1]
        token = await self._read(key, config_id)
        self._opened[key] = (time.monotonic(), token)
        return token

    async def _read(self, key: str, config_id: str) -> str:
        kv = await self._bucket()
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            return ""
        if not entry.value:
            return ""
        try:
            return self._keys().open(entry.value, key).decode()
        except CryptoError as e:
            raise TokenError(f"the token of {config_id} does not open: {e}") from e
