"""Composition of what needs the encryption key: loaded once per process from its options.

`runplane up` generates the key once into its data directory and every component it runs
shares it; a standalone `api`, `scheduler` or `executor` takes it from
`RUNPLANE_ENCRYPTION_KEY` or from `<data-dir>/encryption.key`, and refuses to start
without one (one line saying how to provide it).
"""

from __future__ import annotations

from contextlib import AsyncExitStack

from nats.aio.client import Client as NATS

from infra.crypto import KeyConfigError, KeyRing, load_keyring
from infra.eventstore import EventStore
from infra.options import ConfigError, Options
from services.app.commands import App
from services.app.secrets import SecretsResponder, SecretStore
from services.app.snapshot import Snapshotter


def keyring(opts: Options, *, create: bool = False) -> KeyRing:
    """The deployment's keys; with `create`, a missing key file is generated once."""
    try:
        return load_keyring(opts.encryption_key, opts.data_dir, create=create)
    except KeyConfigError as e:
        raise ConfigError(str(e)) from e


def secret_store(nc: NATS, opts: Options) -> SecretStore:
    return SecretStore(nc, keyring(opts))


def scheduler_app(nc: NATS, opts: Options) -> App:
    """The scheduler's `App`: it pins each run to its snapshot at admission."""
    return App(EventStore(nc), snapshot=Snapshotter(secret_store(nc, opts)))


async def start_secrets_responder(opts: Options, stack: AsyncExitStack, nc: NATS, app: App) -> None:
    """Answer executors' secret requests from this process (it holds the key)."""
    await stack.enter_async_context(SecretsResponder(nc, app, secret_store(nc, opts)))
