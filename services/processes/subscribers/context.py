"""What every subscriber is built from (`SubscriberContext`): its own module, so that the
subscribers and the registry that lists them (registry.py) both import it, and neither
imports the other's module but the registry its subscribers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nats.aio.client import Client as NATS

from infra.options import Options
from services.app.commands import App


@dataclass(frozen=True)
class SubscriberContext:
    """What a subscriber is built from: the connection, the command side, the process's
    options, and where the read model lives (the api's, when it shares the data dir)."""

    nc: NATS
    app: App
    opts: Options
    readmodel_path: Path
