"""What every process runs on: its NATS connection (the embedded server or the given
ones), an HTTP site, the wait for a signal. The graph itself is built in bootstrap.py."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import ssl
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import nats.js.errors
import structlog
from aiohttp import web
from nats.aio.client import Client as NATS

from infra import natsclient, streams
from infra.eventstore import wait_for_stream
from infra.natsclient import NatsAuth
from infra.natsserver import EmbeddedNats
from infra.options import ConfigError, Options, prepare_data_dir
from infra.replicas import ReplicationError

log = structlog.get_logger(__name__)


# How long a process waits for NATS at start before giving up with a clear error.
CONNECT_TIMEOUT_S = float(os.environ.get("RUNPLANE_CONNECT_TIMEOUT", "15"))


@asynccontextmanager
async def connected(
    servers: list[str], auth: NatsAuth, *, timeout: float | None = None
) -> AsyncIterator[NATS]:
    """A connection that keeps reconnecting across `servers`, declaring nothing; not
    made within `timeout` (default `CONNECT_TIMEOUT_S`): one `ConfigError` line."""

    async def on_error(e: Exception) -> None:
        log.warning("nats_error", error=str(e))

    try:
        nc = await natsclient.connect(
            servers,
            auth,
            timeout=CONNECT_TIMEOUT_S if timeout is None else timeout,
            error_cb=on_error,
            name="runplane",
        )
    except (natsclient.NatsUnreachableError, natsclient.NatsSettingError) as e:
        raise ConfigError(str(e)) from e
    try:
        yield nc
    finally:
        await nc.close()


@asynccontextmanager
async def nats_connection(
    servers: list[str], auth: NatsAuth, *, replicas: int = 0
) -> AsyncIterator[NATS]:
    """A connection that keeps reconnecting, with every stream declared."""
    async with connected(servers, auth) as nc:
        try:
            await streams.declare(nc, nc.jetstream(), replicas=replicas)
        except (ReplicationError, nats.js.errors.APIError) as e:
            raise ConfigError(f"declaring runplane's streams: {e}") from e
        await wait_for_stream(nc)
        yield nc


async def embedded_or_given(opts: Options, stack: AsyncExitStack) -> tuple[list[str], NatsAuth]:
    """The given servers and credentials, or the embedded server started on the data
    directory with its own."""
    if opts.nats_url:
        return opts.nats_servers(), opts.nats_auth
    prepare_data_dir(opts.data_dir)
    server = await stack.enter_async_context(EmbeddedNats(opts.data_dir / "nats"))
    return [server.url], server.auth


@asynccontextmanager
async def nats_for(opts: Options, stack: AsyncExitStack) -> AsyncIterator[NATS]:
    """Use the given servers, or start the embedded one on the data directory."""
    servers, auth = await embedded_or_given(opts, stack)
    async with nats_connection(servers, auth, replicas=opts.replicas) as nc:
        yield nc


@asynccontextmanager
async def http_site(
    application: web.Application, listen: str, ssl_context: ssl.SSLContext | None = None
) -> AsyncIterator[str]:
    """Serve an aiohttp application (over TLS with `ssl_context`); yields the base URL
    actually bound."""
    host, port = Options(listen=listen).host_port()
    runner = web.AppRunner(application, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    await site.start()
    bound = runner.addresses[0]
    scheme = "https" if ssl_context is not None else "http"
    where = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    try:
        yield f"{scheme}://{where}:{bound[1]}"
    finally:
        await runner.cleanup()


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
