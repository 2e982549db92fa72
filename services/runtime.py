"""Composition root: build each process's graph from its options. Tests build the same."""

from __future__ import annotations

import asyncio
import gc
import os
import secrets
import signal
import ssl
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import nats.js.errors
import structlog
from aiohttp import web
from nats.aio.client import Client as NATS

from services.commands import App
from services.infra import natsclient, streams
from services.infra.eventstore import EventStore, wait_for_stream
from services.infra.natsclient import NatsAuth
from services.infra.natsserver import EmbeddedNats
from services.infra.replicas import MAX_REPLICAS, ReplicationError

log = structlog.get_logger(__name__)


# How long a process waits for NATS at start before giving up with a clear error.
CONNECT_TIMEOUT_S = float(os.environ.get("RUNPLANE_CONNECT_TIMEOUT", "15"))


class ConfigError(Exception):
    """A setting is missing or wrong; the message says which and how to fix it."""


@dataclass
class Options:
    data_dir: Path = Path(".runplane")
    nats_url: str = ""  # one server or several, comma separated; empty: the embedded one
    nats_auth: NatsAuth = field(default_factory=NatsAuth)
    replicas: int = 0  # of every stream, bucket and consumer; 0: 1 alone, 3 on a cluster
    listen: str = "127.0.0.1:8080"
    behind_tls_proxy: bool = False  # X-Forwarded-Proto is believed (services/ui/sessions.py)
    terraform_login: str = "browser"  # or "token": no login.v1 (services/tfe/discovery.py)
    admin_token: str = ""
    pool: str = "default"
    terraform_binary: str = ""
    provider_mirrors: list[Path] = field(default_factory=list)
    demo: bool = True
    executor_id: str = ""
    encryption_key: str = ""  # base64 keys, current first; else <data_dir>/encryption.key
    allowed_repos: str = "https://,ssh://"  # repository sources (services/repositories.py)
    isolation: str = "auto"  # who jobs run as (executor/isolation.py MODES)
    # HTTPS (services/tfe/tls.py): `tls` with no cert and key: a local CA and its certificate
    tls: bool = False
    tls_cert: str = ""
    tls_key: str = ""
    tls_names: list[str] = field(default_factory=list)  # more names the local certificate covers

    def nats_servers(self) -> list[str]:
        """The `--nats-url` list, checked (a bad URL is a `ConfigError`)."""
        try:
            return natsclient.server_list([self.nats_url])
        except natsclient.NatsSettingError as e:
            raise ConfigError(str(e)) from e

    def check(self) -> None:
        """Settings that can be judged before anything starts."""
        self.host_port()
        self.nats_servers()
        if not 0 <= self.replicas <= MAX_REPLICAS:
            raise ConfigError(f"--replicas wants 1 to {MAX_REPLICAS}, got {self.replicas}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("--tls-cert and --tls-key go together")
        if self.terraform_login not in ("browser", "token"):
            wanted = "--terraform-login wants browser or token"
            raise ConfigError(f"{wanted}, got {self.terraform_login}")

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
    prepare_data_dir(opts.data_dir)
    token = f"rp_admin_{secrets.token_urlsafe(32)}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


PRIVATE_UMASK = 0o077


def private_files() -> None:
    """From now on, what this process (and nats-server, git, terraform under it) creates
    is its owner's alone: files 0600, directories 0700. The data directory holds the
    keys, the NATS credentials and store, the read model (and SQLite's -wal and -shm,
    made with the database's mode) and the job directories."""
    os.umask(PRIVATE_UMASK)


def prepare_data_dir(path: Path) -> None:
    """Create the data directory 0700, and take group and other access away from one
    made before (by an older runplane under a wider umask)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o077:
        path.chmod(0o700)


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
