"""The composition root: every component of a runplane process, built from its options in
one place.

`build` makes what a process shares (its one event store, one `App`, one key ring, one
secret store, the repository sources it takes); a `Plane` then makes each component over
them and starts the ones the process runs (`start_api`, `start_scheduler`,
`start_executor`, `start_subscribers`, `start_runwatch`), each an async context manager
entered into the process's `AsyncExitStack`, so they stop in reverse order. The process
entry points (processes.py) and the test harness (tests/bootstrap_support.py) build the
system through here; a test's knobs (a clock, quick heartbeats, its own read model) are
keyword overrides of the component they belong to.

The `App` takes each admitted run's snapshot (`pinning`): it is queued `pinning` and
pinned before any executor may claim it. Only the scheduler admits (`admit_next`,
`admit_speculative`, `pin_run`); every other command is the same with or without the
hook, so the api, executor and subscribers of a process share the scheduler's `App`.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import structlog
from aiohttp import web
from nats.aio.client import Client as NATS

from executor.caps import JobCaps
from executor.errors import IsolationError
from executor.isolation import Isolation
from executor.turns import parse_weights
from executor.warm import WarmSettings
from executor.worker import Executor, TerraformSettings, default_executor_id, default_jobs_dir
from infra import options
from infra.auditkeys import AuditKeys
from infra.crypto import KeyRing
from infra.eventstore import EventStore
from infra.ids import new_id, utcnow
from infra.options import ConfigError, Options, admin_token, prepare_data_dir
from infra.signing import SigningKeys
from projections.asof import Bounds
from projections.projector import Projector
from projections.snapshot_writer import SnapshotWriter
from projections.snapshots import Snapshots
from services.app.commands import App
from services.app.flows import SnapshotHook
from services.app.gitcreds import GitAccess
from services.app.openruns import Limits as OpenRunLimits
from services.app.openruns import OpenRuns
from services.app.repositories import Sources, deployment_sources
from services.app.secrets import SecretsResponder, SecretStore
from services.app.snapshot import Snapshotter
from services.app.workload import Minter
from services.processes.audit import Auditor
from services.processes.audit_stream import AuditStreamer, StreamSettings
from services.processes.notifications.guard import allowed_from_env
from services.processes.retention import Retention
from services.processes.runwatch import RunWatch
from services.processes.scheduler.reaper import Reaper
from services.processes.scheduler.scheduler import Scheduler
from services.processes.schedules.loop import ScheduleLoop
from services.processes.subscribers.context import SubscriberContext
from services.processes.subscribers.host import Host
from services.processes.vcs.heads import GitHeads
from services.root.runtime import http_site
from services.surfaces.api import asof as asof_api
from services.surfaces.api import audit_stream as audit_stream_api
from services.surfaces.api import device as device_api
from services.surfaces.api import sso as sso_api
from services.surfaces.api.app import build_app
from services.surfaces.api.oidc import Issuer
from services.surfaces.tfe import tls
from services.surfaces.webhooks.intake import Limits

log = structlog.get_logger(__name__)

METRICS_TOKEN_ENV = "RUNPLANE_METRICS_TOKEN"

# What takes an admitted run's snapshot, given the process's secret store (the names of a
# workspace's secret variables); None: runs are queued without one.
Pinning = Callable[[SecretStore], SnapshotHook | None]


def build(
    opts: Options,
    nc: NATS,
    stack: AsyncExitStack,
    *,
    keyring: KeyRing | None = None,
    store: EventStore | None = None,
    pinning: Pinning = Snapshotter,
    clock: Callable[[], datetime] = utcnow,
    ids: Callable[[], str] = new_id,
) -> Plane:
    """The process's graph over `nc`, its components started into `stack` by the
    `Plane`'s `start_*`. `keyring`: the key ring the process loaded before connecting
    (default: the options'). `store`, `pinning`, `clock`, `ids`: a test's knobs."""
    keys = keyring if keyring is not None else options.keyring(opts)
    events = store if store is not None else EventStore(nc)
    secrets = SecretStore(nc, keys)
    try:
        sources = deployment_sources(
            opts.allowed_repos,
            opts.data_dir,
            unscoped=opts.unscoped_repos,
            host_git=opts.host_git_credentials,
        )
    except ValueError as e:
        raise ConfigError(f"--allowed-repos: {e}") from e
    hook = pinning(secrets)
    app = App(events, clock=clock, ids=ids, snapshot=hook)
    limits = OpenRunLimits(opts.org_max_open_runs, opts.workspace_max_open_runs)
    app.open_runs = OpenRuns(nc.jetstream(), limits, app.run_is_open)
    access = GitAccess(app, secrets, sources.host_credentials)
    if isinstance(hook, Snapshotter):  # its `ls-remote` asks with the organization's own
        hook.access = access  # credential, of a repository the sources take for it
        hook.sources = sources
    _say_repository_rules(sources)
    signing = SigningKeys(nc, keys, rotate_after=opts.workload_key_rotation, clock=app_seconds(app))
    return Plane(opts, nc, stack, keys, events, app, secrets, sources, access, signing)


def app_seconds(app: App) -> Callable[[], float]:
    """The `App`'s clock as unix seconds (a test's clock moves the keys' rotation too)."""
    return lambda: app.clock().timestamp()


def _say_repository_rules(sources: Sources) -> None:
    """At every start: the rules every organization may use, and who uses the host's git
    credentials (services/app/repositories.py)."""
    unscoped = [p.text for p in sources.unscoped()]
    if unscoped:
        log.warning(
            "repository_rules_unscoped",
            rules=unscoped,
            detail="every organization's workspaces may name these repository sources "
            "(local paths too if file:// or a directory is among them); name organizations "
            "(org=rule) and start with --unscoped-repos none to keep them apart",
        )
    if sources.host_git:
        log.warning("git_host_credentials", organizations=sorted(sources.host_git))


def _provider_cache(opts: Options) -> Path | None:
    """The executor's provider cache directory (executor/providers.py): beside its jobs
    directory unless the options name one; None: `none`, off."""
    if opts.provider_cache == "none":
        return None
    if opts.provider_cache:
        return Path(opts.provider_cache)
    jobs = default_jobs_dir(opts.data_dir / "work")
    return jobs.with_name(f"{jobs.name}-providers")


def readmodel_path(opts: Options) -> Path:
    """Where the api's projector keeps its read model: in the data directory."""
    prepare_data_dir(opts.data_dir)  # 0700: the read model holds every organization's data
    return opts.data_dir / "readmodel.sqlite"


@dataclass
class Plane:
    """What one process shares, and each component over it. A `start_*` starts
    components into `stack`; the unstarted ones (`scheduler()`, `executor()`, ...) are
    for a caller that enters them where it wants them stopped."""

    opts: Options
    nc: NATS
    stack: AsyncExitStack
    keyring: KeyRing
    store: EventStore
    app: App
    secrets: SecretStore
    repositories: Sources
    git_access: GitAccess
    signing: SigningKeys  # workload identity's keys (infra/signing.py)

    # ------------------------------------------------------------ starting

    async def start_api(self, ready: Callable[[], bool] = lambda: True) -> str:
        """The projector (its read model in the data directory) and the HTTP API over it;
        the base URL it serves at. `ready`: false keeps /readyz 503 (`up`: until its other
        components are started), whatever the read model."""
        projector = await self.stack.enter_async_context(self.projector())
        await self.stack.enter_async_context(self.snapshot_writer(projector))
        web_app = self.web_app(projector, ready=ready)
        return await self.stack.enter_async_context(
            http_site(web_app, self.opts.listen, self.tls())
        )

    async def start_scheduler(self) -> Scheduler:
        """Admission and dispatch, the secrets responder (this process holds the key),
        the reaper and the cron schedules."""
        scheduler = await self.stack.enter_async_context(self.scheduler())
        await self.stack.enter_async_context(self.secrets_responder())
        await self.stack.enter_async_context(self.reaper())
        await self.stack.enter_async_context(self.retention())
        await self.stack.enter_async_context(self.schedule_loop())
        return scheduler

    async def start_executor(self, *, fallback_to_none: bool = False, **overrides: Any) -> Executor:
        """One executor of the options' pool (`executor()`)."""
        ex = self.executor(fallback_to_none=fallback_to_none, **overrides)
        return await self.stack.enter_async_context(ex)

    async def start_subscribers(self) -> Host:
        """Every registered subscription (services/processes/subscribers/), and the
        auditor (services/processes/audit.py) beside them."""
        await self.start_auditor()
        await self.start_audit_stream()
        return await self.stack.enter_async_context(self.subscribers())

    async def start_auditor(self, **overrides: Any) -> Auditor:
        """The audit chains' writer from the event log (`Auditor`)."""
        auditor = Auditor(self.nc, AuditKeys(self.nc, self.keyring), **overrides)
        return await self.stack.enter_async_context(auditor)

    async def start_audit_stream(self, **overrides: Any) -> AuditStreamer:
        """The audit log sent on to its destinations (services/processes/audit_stream.py)."""
        opts = self.opts
        settings = StreamSettings(
            retry=opts.audit_stream_retry, timeout=opts.audit_stream_timeout,
            batch=opts.audit_stream_batch, allow_http=opts.audit_stream_allow_http,
            allow=allowed_from_env(), host=urlsplit(opts.issuer()).hostname or "runplane",
        )  # fmt: skip
        streamer = AuditStreamer(self.nc, self.keyring, replace(settings, **overrides))
        return await self.stack.enter_async_context(streamer)

    async def start_runwatch(self) -> RunWatch:
        """A log line per run transition (what `runplane up` shows a person)."""
        return await self.stack.enter_async_context(RunWatch(self.nc))

    # ------------------------------------------------------------ components

    def projector(self, db_path: Path | None = None, **overrides: Any) -> Projector:
        """The read model's projector, at `db_path` (default: the data directory's),
        restoring from the newest snapshot when it has none (projections/snapshots.py)."""
        given: dict[str, Any] = {"snapshots": self.snapshots(), **overrides}
        return Projector(self.nc, db_path or readmodel_path(self.opts), **given)

    def snapshots(self) -> Snapshots:
        """The deployment's read-model snapshots, sealed with its key."""
        return Snapshots(self.nc, self.keyring, keep=self.opts.snapshot_keep)

    def snapshot_writer(self, projector: Projector, **overrides: Any) -> SnapshotWriter:
        """Snapshots of `projector`'s read model every `--snapshot-interval` seconds."""
        given: dict[str, Any] = {
            "interval": self.opts.snapshot_interval,
            "writer": new_id().lower(),
            **overrides,
        }
        return SnapshotWriter(self.snapshots(), projector, **given)

    def web_app(self, projector: Projector, **overrides: Any) -> web.Application:
        """The API over the process's `App` and `projector` (services/surfaces/api/app.py),
        with the deployment's admin token, secret store and repository sources."""
        given: dict[str, Any] = {
            "secret_store": self.secrets,
            "repositories": self.repositories,
            # the scraper's credential for /metrics alone (environment only: never argv)
            "metrics_token": os.environ.get(METRICS_TOKEN_ENV, ""),
            "behind_tls_proxy": self.opts.behind_tls_proxy,
            "browser_login": self.opts.terraform_login != "token",
            "webhook_limits": Limits(
                max_body=self.opts.webhook_max_body, concurrent=self.opts.webhook_concurrency
            ),
            # a push is started only if current: the API's own mirrors tell (never a job's)
            "vcs_heads": GitHeads(
                self.opts.data_dir / "vcs-git", sources=self.repositories, access=self.git_access
            ),
            "quotas": self.opts.quotas,
            "workload_identity": Issuer(self.signing, self.opts.issuer()),
            **overrides,
        }
        if "admin_token" not in given:  # made once into the data directory if not given
            given["admin_token"] = admin_token(self.opts)
        sso_allow = given.pop("sso_allow", self.opts.sso_allow)
        device_grants = given.pop("device_grants", None)  # tests: their clock and interval
        public_url = given.pop("public_url", self.opts.public_url)
        o = self.opts
        as_of = given.pop(
            "as_of",
            Bounds(o.as_of_models, o.as_of_max_events, per_minute=o.as_of_events_per_minute),
        )
        allow_http = given.pop("audit_stream_allow_http", self.opts.audit_stream_allow_http)
        web_app = build_app(app=self.app, projector=projector, **given)
        web_app[audit_stream_api.ALLOW_HTTP] = allow_http
        asof_api.mount(web_app, self.nc, as_of)  # `?as_of=`'s scratch read models
        sso_api.mount(web_app, allow=sso_allow)  # single sign-on, with the secret store's key
        # `runplane login --device` (after the UI: it adds to the self-authenticated routes)
        device_api.mount(web_app, device_grants, public_url=public_url)
        return web_app

    def tls(self) -> ssl.SSLContext | None:
        """The API's TLS (services/surfaces/tfe/tls.py): the given pair, or with `--tls`
        alone a local CA's certificate made in the data directory; None: plain HTTP."""
        opts = self.opts
        try:
            if opts.tls_cert or opts.tls_key:
                return tls.given(opts.tls_cert, opts.tls_key).context()
            if opts.tls:
                return tls.local(opts.data_dir, opts.tls_names).context()
        except tls.TlsError as e:
            raise ConfigError(str(e)) from e
        return None

    def scheduler(self, **overrides: Any) -> Scheduler:
        return Scheduler(self.nc, self.app, **{"pool": self.opts.pool, **overrides})

    def secrets_responder(self) -> SecretsResponder:
        """Answers executors' secret requests from this process's secret store."""
        minter = Minter(self.app, self.signing, self.opts.issuer())
        return SecretsResponder(self.nc, self.app, self.secrets, minter)

    def reaper(self, **overrides: Any) -> Reaper:
        return Reaper(self.nc, self.app, **overrides)

    def retention(self, **overrides: Any) -> Retention:
        """Retention passes (services/processes/retention.py) with the deployment's default."""
        given: dict[str, Any] = {
            "default_days": self.opts.log_retention_days,
            "record_days": self.opts.record_retention_days,
            "interval": self.opts.retention_interval,
        }
        return Retention(self.nc, self.app, **{**given, **overrides})

    def schedule_loop(self, **overrides: Any) -> ScheduleLoop:
        """The cron schedules' loop, on the `App`'s clock."""
        return ScheduleLoop(self.app, **{"clock": self.app.clock, **overrides})

    def executor(self, *, fallback_to_none: bool = False, **overrides: Any) -> Executor:
        """An executor of the options' pool, with the process's key ring and sources.
        `fallback_to_none`: `runplane up` of an ordinary user runs jobs unisolated (with
        a warning at every start) where there is no isolation to be had; `executor`
        refuses."""
        opts = self.opts
        given: dict[str, Any] = {
            "pool": opts.pool,
            "work_dir": opts.data_dir / "work",
            "terraform": TerraformSettings(
                binary=opts.terraform_binary or None,
                provider_mirrors=opts.provider_mirrors,
                mirror_root=opts.data_dir / "providers",
                provider_cache_dir=_provider_cache(opts),
                provider_cache_bytes=opts.provider_cache_size,
                allowed_binaries=tuple(opts.terraform_binaries),
            ),
            "executor_id": opts.executor_id or default_executor_id(),
            "keyring": self.keyring,
            "repositories": self.repositories,
            "concurrency": opts.concurrency,
            "org_weights": parse_weights(opts.org_weights),
            "org_max_phases": opts.org_max_phases,
            "quotas": opts.quotas,
            "warm": WarmSettings(opts.warm_wait, opts.warm_max_bytes),
            **overrides,
        }
        if "isolation" not in given:
            given["isolation"] = self._isolation(fallback_to_none)
        return Executor(self.nc, self.app, **given)

    def _isolation(self, fallback_to_none: bool) -> Isolation:
        opts = self.opts
        caps = JobCaps(
            memory=opts.job_memory,
            processes=opts.job_processes,
            cpu_seconds=opts.job_cpu_seconds,
            disk=opts.job_disk,
            tmpfs=opts.job_tmpfs,
            files=opts.job_files,
            cpus=opts.job_cpus,
        )
        try:
            isolation = Isolation.choose(
                opts.isolation,
                fallback_to_none=fallback_to_none,
                caps=caps,
                network=opts.job_network,
            )
        except IsolationError as e:
            raise ConfigError(str(e)) from e
        log.info("job_isolation", mode=isolation.mode, network=isolation.network)
        return isolation.hiding(self.opts.data_dir)

    def subscribers(self) -> Host:
        """Every registered subscription over the process's `App` and key ring."""
        ctx = SubscriberContext(
            nc=self.nc,
            app=self.app,
            opts=self.opts,
            readmodel_path=readmodel_path(self.opts),
            keyring=self.keyring,
        )
        return Host(ctx)
