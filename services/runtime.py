"""Composition root: build each process's graph from its options. Tests build the same."""

from __future__ import annotations

import asyncio
import gc
import os
import secrets
import signal
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import nats
import nats.errors
import structlog
from aiohttp import web
from nats.aio.client import Client as NATS

from services.commands import App
from services.infra import streams
from services.infra.eventstore import EventStore, wait_for_stream
from services.infra.natsserver import EmbeddedNats

log = structlog.get_logger(__name__)


# How long a process waits for NATS at start before giving up with a clear error.
CONNECT_TIMEOUT_S = float(os.environ.get("RUNPLANE_CONNECT_TIMEOUT", "15"))


class ConfigError(Exception):
    """A setting is missing or wrong; the message says which and how to fix it."""


@dataclass
class Options:
    data_dir: Path = Path(".runplane")
    nats_url: str = ""
    listen: str = "127.0.0.1:8080"
    admin_token: str = ""
    pool: str = "default"
    terraform_binary: str = ""
    provider_mirrors: list[Path] = field(default_factory=list)
    demo: bool = True
    executor_id: str = ""
    encryption_key: str = ""  # base64 keys, current first; else <data_dir>/encryption.key

    def host_port(self) -> tuple[str, int]:
        host, sep, port = self.listen.rpartition(":")
        if not sep or not port.isdigit():
            raise ConfigError(f"--listen wants HOST:PORT, got {self.listen!r}")
        return host or "127.0.0.1", int(port)


def admin_token(opts: Options) -> str:
    """The bootstrap admin token: given, or generated once into the data directory (0600)."""
    if opts.admin_token:
        return opts.admin_token
    path = opts.data_dir / "admin-token"
    if path.exists():
        return path.read_text().strip()
    opts.data_dir.mkdir(parents=True, exist_ok=True)
    token = f"rp_admin_{secrets.token_urlsafe(32)}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


@asynccontextmanager
async def nats_connection(url: str) -> AsyncIterator[NATS]:
    """A connection that keeps reconnecting, with every stream declared."""

    async def on_error(e: Exception) -> None:
        log.warning("nats_error", error=str(e))

    try:
        nc = await asyncio.wait_for(
            nats.connect(
                url,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                error_cb=on_error,
                name="runplane",
            ),
            CONNECT_TIMEOUT_S,
        )
    except (TimeoutError, OSError, nats.errors.Error) as e:
        raise ConfigError(f"cannot reach NATS at {url} ({type(e).__name__})") from e
    try:
        await streams.declare(nc, nc.jetstream())
        await wait_for_stream(nc)
        yield nc
    finally:
        await nc.close()


@asynccontextmanager
async def nats_for(opts: Options, stack: AsyncExitStack) -> AsyncIterator[NATS]:
    """Use the given server, or start the embedded one on the data directory."""
    url = opts.nats_url
    if not url:
        server = await stack.enter_async_context(EmbeddedNats(opts.data_dir / "nats"))
        url = server.url
    async with nats_connection(url) as nc:
        yield nc


@asynccontextmanager
async def http_site(application: web.Application, listen: str) -> AsyncIterator[str]:
    """Serve an aiohttp application; yields the base URL actually bound."""
    host, port = Options(listen=listen).host_port()
    runner = web.AppRunner(application, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0]
    try:
        yield f"http://{bound[0]}:{bound[1]}"
    finally:
        await runner.cleanup()


def make_app(nc: NATS) -> App:
    return App(EventStore(nc))


GC_THRESHOLDS = (50_000, 50, 1000)


async def wait_for_signal() -> None:
    """Return on SIGINT or SIGTERM. Called once a process has started everything: what it
    allocated to start (modules, configuration, connections) is moved out of the garbage
    collector's sight (`gc.freeze`), so the full collections that come every so often
    while it runs traverse only what it made since, and hold its event loop that much
    shorter (they reached 30 ms in the scheduler)."""
    gc.collect()
    gc.freeze()
    # Young collections every 50,000 allocations rather than 700: a scheduler holding
    # caches of tens of thousands of events spent a quarter of its time collecting
    # (admission at 10,000 workspaces: 287 runs/s, 382 with these thresholds, 397 with no
    # collector at all).
    gc.set_threshold(*GC_THRESHOLDS)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
