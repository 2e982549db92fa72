"""VCS connections: the aggregate's shell, and their write-only secrets, sealed.

The webhook secret and the token are sealed with the key ring into the secrets bucket
under `<org>._vcs.<connection id>.secret` / `.token` (a workspace name never starts with
`_`, so no workspace's secret variables list them), each bound to its key so a value
copied under another key does not open. Events say only whether each is set.

`find` answers a connection from its id alone, through the stream (`rp.org.*.vcs.<id>`:
one subject whatever the organization, since ids are made by the server), never the
read model: a connection made a moment ago through another replica is found.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import nats.js.errors
from nats.aio.client import Client as NATS

from events import vcs
from events.codec import valid_id
from infra.crypto import CryptoError, KeyRing
from infra.eventstore import EventStore
from infra.kv import SECRETS_BUCKET, last_values
from services.app.aggregates import VCS_CONNECTION
from services.app.commands import App
from services.app.execute import Repository
from services.app.secrets import DEPLOY_KEY as DEPLOY_KEY  # sealed here too
from services.app.secrets import SecretStore
from services.app.secrets import sealed_key as sealed_key  # the tests read sealed values
from services.processes.vcs import VcsError

SECRET, TOKEN = "secret", "token"
SEALED = (SECRET, TOKEN, DEPLOY_KEY)  # what a connection keeps sealed
MAX_SECRET = 4096


class SealError(VcsError):
    """A sealed value could not be stored or opened."""


@dataclass(frozen=True)
class Connection:
    """What the reporting side (services/processes/vcs, vcsout) needs of a connection."""

    id: str
    org: str
    name: str
    provider: str
    api_url: str


def _of(c: vcs.VcsConnection) -> Connection:
    return Connection(id=c.id, org=c.org, name=c.name, provider=c.provider, api_url=c.api_url)


async def state(repo: Repository, org: str, connection_id: str) -> tuple[vcs.ConnectionState, int]:
    found = await repo.load(VCS_CONNECTION, vcs.connection_subject(org, connection_id))
    return found.state, found.seq


async def load_connection(app: App, org: str, connection_id: str) -> Connection | None:
    """The organization's connection, or None (no such id, deleted, another org's)."""
    if not valid_id(org) or not valid_id(connection_id):
        return None
    st, _ = await state(app, org, connection_id)
    if not st.exists or st.connection is None or st.connection.org != org:
        return None
    return _of(st.connection)


async def find(store: EventStore, connection_id: str) -> vcs.VcsConnection | None:
    """The connection with this id in whichever organization holds it, or None."""
    if not valid_id(connection_id):
        return None
    envs = await store.read(vcs.any_org_subject(connection_id))
    orgs = {e.subject for e in envs}
    if len(orgs) != 1:  # ids are the server's: two organizations never share one
        return None
    st = vcs.fold([e.event for e in envs])
    c = st.connection
    if not st.exists or c is None or envs[0].subject != vcs.connection_subject(c.org, c.id):
        return None
    return c


async def connections(store: EventStore, org: str) -> list[vcs.VcsConnection]:
    """Every connection of the organization that exists (from the stream)."""
    by_subject: dict[str, list[Any]] = {}
    for env in await store.read(vcs.connections_subject(org)):
        by_subject.setdefault(env.subject, []).append(env.event)
    states = (vcs.fold(events) for events in by_subject.values())
    return [s.connection for s in states if s.exists and s.connection is not None]


async def command(
    repo: Repository, org: str, cmd: vcs.SaveConnection | vcs.DeleteConnection
) -> tuple[vcs.ConnectionState, int]:
    """Decide and append on the connection's subject (`Repository.execute`)."""
    done = await repo.execute(VCS_CONNECTION, vcs.connection_subject(org, cmd.connection_id), cmd)
    return done.state, done.seq


# ---------------------------------------------------------------- sealed values


class Sealed:
    """A connection's webhook secret and token, sealed in the secrets bucket."""

    def __init__(self, nc: NATS, keyring: KeyRing) -> None:
        self.nc = nc
        self.keyring = keyring

    async def put(self, org: str, connection_id: str, which: str, value: str) -> None:
        key = sealed_key(org, connection_id, which)
        kv = await self.nc.jetstream().key_value(SECRETS_BUCKET)
        if not value:
            await _purge(kv, key)
            return
        await kv.put(key, self.keyring.seal(value.encode(), key))

    async def forget(self, org: str, connection_id: str) -> None:
        kv = await self.nc.jetstream().key_value(SECRETS_BUCKET)
        for which in SEALED:
            await _purge(kv, sealed_key(org, connection_id, which))

    async def get(self, org: str, connection_id: str, which: str) -> str:
        """The clear value, "" if none is set; SealError if it does not open."""
        key = sealed_key(org, connection_id, which)
        found = (await last_values(self.nc, SECRETS_BUCKET, key)).get(key)
        if not found:
            return ""
        try:
            return self.keyring.open(found, key).decode()
        except CryptoError as e:
            raise SealError(f"the {which} of VCS connection {connection_id} does not open") from e


async def _purge(kv: Any, key: str) -> None:
    try:
        await kv.purge(key)
    except nats.js.errors.NotFoundError:
        pass


async def connection_token(secrets: SecretStore, org: str, connection_id: str) -> str:
    """The connection's token (what statuses and comments are posted with); "" if none."""
    return await Sealed(secrets.nc, secrets.keyring).get(org, connection_id, TOKEN)


async def webhook_secret(secrets: SecretStore, org: str, connection_id: str) -> str:
    return await Sealed(secrets.nc, secrets.keyring).get(org, connection_id, SECRET)
