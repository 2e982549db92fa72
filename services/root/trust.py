"""Composition of what needs the encryption key (loaded once per process from its options
by `infra.options.keyring`): the secret store, the scheduler's `App`, the secrets responder.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

from nats.aio.client import Client as NATS

from infra.eventstore import EventStore
from infra.options import Options, keyring
from services.app.commands import App
from services.app.secrets import SecretsResponder, SecretStore
from services.app.snapshot import Snapshotter


def secret_store(nc: NATS, opts: Options) -> SecretStore:
    return SecretStore(nc, keyring(opts))


def scheduler_app(nc: NATS, opts: Options) -> App:
    """The scheduler's `App`: it pins each run to its snapshot at admission."""
    return App(EventStore(nc), snapshot=Snapshotter(secret_store(nc, opts)))


async def start_secrets_responder(opts: Options, stack: AsyncExitStack, nc: NATS, app: App) -> None:
    """Answer executors' secret requests from this process (it holds the key)."""
    await stack.enter_async_context(SecretsResponder(nc, app, secret_store(nc, opts)))
