"""What every subscriber is built from (`SubscriberContext`): its own module, so that the
subscribers and the registry that lists them (registry.py) both import it, and neither
imports the other's module but the registry its subscribers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nats.aio.client import Client as NATS

from infra import options
from infra.crypto import KeyRing
from infra.options import Options
from services.app.commands import App


@dataclass(frozen=True)
class SubscriberContext:
    """What a subscriber is built from: the connection, the command side, the process's
    options, where the read model lives (the api's, when it shares the data dir), and the
    process's key ring (services/root/bootstrap.py; None: read from the options)."""

    nc: NATS
    app: App
    opts: Options
    readmodel_path: Path
    keyring: KeyRing | None = None

    def keys(self) -> KeyRing:
        """The process's key ring; ConfigError if the deployment has none."""
        return self.keyring if self.keyring is not None else options.keyring(self.opts)
