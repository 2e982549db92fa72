"""VCS connections, as the reporter reads them: a STAND-IN for the `vcsin` branch's module.

The contract (CONTRACT-14.md) has `vcsin` own this module: connections event-sourced on
`rp.org.<org>.vcs.<id>`, their token sealed in `rp-secrets`. Until it lands, this file
gives the reporter the contract's names: `Connection`, `load_connection` (here from an
in-process table that tests fill with `register`) and `connection_token` (sealed in the
secrets bucket under `<org>._vcs.<id>`, bound to that key, as the notifications' tokens
are). On merge the lead keeps `vcsin`'s module; nothing else here is used by the reporter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import nats.js.errors

from services.infra.kv import SECRETS_BUCKET

if TYPE_CHECKING:
    from services.commands import App
    from services.secrets import SecretStore


@dataclass(frozen=True)
class Connection:
    id: str
    org: str
    name: str
    provider: str  # "github" | "gitlab"
    api_url: str


_KNOWN: dict[tuple[str, str], Connection] = {}


def register(conn: Connection) -> None:
    """(stand-in) Make `conn` known to `load_connection` in this process."""
    _KNOWN[(conn.org, conn.id)] = conn


async def load_connection(app: App, org: str, connection_id: str) -> Connection | None:
    """The organization's connection, None if it has none of that id (another
    organization's id among them: a connection is looked up within the run's org)."""
    return _KNOWN.get((org, connection_id))


def token_key(org: str, connection_id: str) -> str:
    return f"{org}._vcs.{connection_id}"


async def put_token(secrets: SecretStore, org: str, connection_id: str, token: str) -> None:
    """(stand-in) Seal the connection's token into the secrets bucket."""
    key = token_key(org, connection_id)
    kv = await secrets.js.key_value(SECRETS_BUCKET)
    await kv.put(key, secrets.keyring.seal(token.encode(), key))


async def connection_token(secrets: SecretStore, org: str, connection_id: str) -> str:
    """The clear token of the connection, "" if none is set."""
    key = token_key(org, connection_id)
    kv = await secrets.js.key_value(SECRETS_BUCKET)
    try:
        entry = await kv.get(key)
    except nats.js.errors.KeyNotFoundError:
        return ""
    if not entry.value:
        return ""
    return secrets.keyring.open(entry.value, key).decode()
