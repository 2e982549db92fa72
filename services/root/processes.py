"""The processes `runplane` runs, each one built from its options in one place."""

from __future__ import annotations

import os
import shutil
import ssl
import sys
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path

import structlog
from nats.aio.client import Client as NATS

from executor.errors import IsolationError
from executor.isolation import Isolation
from executor.worker import Executor, TerraformSettings, default_executor_id
from infra import options, tracing
from infra.options import ConfigError, Options, admin_token, prepare_data_dir
from projections.projector import Projector
from projections.replay import replay as do_replay
from services.app.repositories import deployment_sources
from services.processes.runwatch import RunWatch
from services.processes.scheduler.reaper import Reaper
from services.processes.scheduler.scheduler import Scheduler
from services.processes.schedules.loop import ScheduleLoop
from services.processes.subscribers.context import SubscriberContext
from services.processes.subscribers.host import Host
from services.root import trust
from services.root.demo import DEMO_ORG, DEMO_WS, ensure_demo
from services.root.runtime import http_site, make_app, nats_for, wait_for_signal
from services.surfaces.api.app import build_app
from services.surfaces.tfe import tls

log = structlog.get_logger(__name__)

METRICS_TOKEN_ENV = "RUNPLANE_METRICS_TOKEN"


def _traced(stack: AsyncExitStack, service: str) -> None:
    """This process's tracer provider (infra/tracing.py), flushed at its end."""
    tracing.setup(service)
    stack.callback(tracing.shutdown)


def _readmodel_path(opts: Options) -> Path:
    prepare_data_dir(opts.data_dir)  # 0700: the read model holds every organization's data
    return opts.data_dir / "readmodel.sqlite"


async def _start_api(
    opts: Options, stack: AsyncExitStack, nc: NATS, ready: Callable[[], bool]
) -> str:
    app = make_app(nc)
    projector = await stack.enter_async_context(Projector(nc, _readmodel_path(opts)))
    web_app = build_app(
        app=app,
        projector=projector,
        admin_token=admin_token(opts),
        ready=ready,
        secret_store=trust.secret_store(nc, opts),
        repositories=deployment_sources(opts.allowed_repos, opts.data_dir),
        # the scraper's credential for /metrics alone (environment only: never argv)
        metrics_token=os.environ.get(METRICS_TOKEN_ENV, ""),
        behind_tls_proxy=opts.behind_tls_proxy,
        browser_login=opts.terraform_login != "token",
    )
    return await stack.enter_async_context(http_site(web_app, opts.listen, _tls(opts)))


def _tls(opts: Options) -> ssl.SSLContext | None:
    """The API's TLS (services/surfaces/tfe/tls.py): the given pair, or with `--tls` alone a local
    CA's certificate made in the data directory; None: plain HTTP."""
    try:
        if opts.tls_cert or opts.tls_key:
            return tls.given(opts.tls_cert, opts.tls_key).context()
        if opts.tls:
            return tls.local(opts.data_dir, opts.tls_names).context()
    except tls.TlsError as e:
        raise ConfigError(str(e)) from e
    return None


def local_ca(opts: Options) -> Path | None:
    """The CA to trust when `up` made its own certificate (printed in the banner)."""
    if opts.tls and not opts.tls_cert:
        return opts.data_dir.resolve() / "tls" / "ca.pem"
    return None


async def _start_executor(
    opts: Options, stack: AsyncExitStack, nc: NATS, *, fallback_to_none: bool = False
) -> None:
    """`fallback_to_none`: `runplane up` of an ordinary user runs jobs unisolated (with a
    warning at every start) where there is no isolation to be had; `executor` refuses."""
    try:
        isolation = Isolation.choose(opts.isolation, fallback_to_none=fallback_to_none)
    except IsolationError as e:
        raise ConfigError(str(e)) from e
    log.info("job_isolation", mode=isolation.mode)

    ex = Executor(
        nc,
        make_app(nc),
        pool=opts.pool,
        work_dir=opts.data_dir / "work",
        terraform=TerraformSettings(
            binary=opts.terraform_binary or None,
            provider_mirrors=opts.provider_mirrors,
            mirror_root=opts.data_dir / "providers",
        ),
        executor_id=opts.executor_id or default_executor_id(),
        keyring=options.keyring(opts),
        repositories=deployment_sources(opts.allowed_repos, opts.data_dir),
        isolation=isolation.hiding(opts.data_dir),
    )
    await stack.enter_async_context(ex)


async def _start_subscribers(opts: Options, stack: AsyncExitStack, nc: NATS) -> list[str]:
    """Every registered subscription (services/processes/subscribers/); their names."""
    ctx = SubscriberContext(
        nc=nc, app=make_app(nc), opts=opts, readmodel_path=_readmodel_path(opts)
    )
    host = await stack.enter_async_context(Host(ctx))
    return host.names


async def start_all(opts: Options, stack: AsyncExitStack) -> str:
    """Start every component on one machine; return the API's base URL once all are ready."""
    options.keyring(opts, create=True)  # made once in the data directory; all below share it
    nc = await stack.enter_async_context(nats_for(opts, stack))
    components_ready = {"v": False}
    base = await _start_api(opts, stack, nc, lambda: components_ready["v"])
    await stack.enter_async_context(Scheduler(nc, trust.scheduler_app(nc, opts), pool=opts.pool))
    await trust.start_secrets_responder(opts, stack, nc, make_app(nc))
    await stack.enter_async_context(Reaper(nc, make_app(nc)))
    await stack.enter_async_context(ScheduleLoop(make_app(nc)))
    await _start_executor(opts, stack, nc, fallback_to_none=opts.isolation == "auto")
    await _start_subscribers(opts, stack, nc)
    await stack.enter_async_context(RunWatch(nc))  # a line per run transition
    if opts.demo:
        await ensure_demo(make_app(nc), opts.data_dir)
    components_ready["v"] = True
    return base


async def up(opts: Options, stack: AsyncExitStack) -> None:
    """Everything on one machine: embedded NATS, api+projector, scheduler, one executor,
    the subscribers."""
    _traced(stack, "runplane")
    # One machine: its own receivers (a local chat bridge, a test hook) may be notified.
    os.environ.setdefault("RUNPLANE_NOTIFY_ALLOW", "loopback")
    base = await start_all(opts, stack)
    _banner(base, admin_token(opts), DEMO_ORG, DEMO_WS if opts.demo else "")
    ca = local_ca(opts)
    if ca is not None:  # loudly: without it no client trusts this server
        print(f"TLS: trust this runplane's local CA: {ca}", flush=True)
        print(f"  Terraform: export SSL_CERT_FILE={ca}", flush=True)
        print(f"  curl: --cacert {ca}", flush=True)
    await wait_for_signal()
    log.info("shutting_down")


def _banner(base: str, token: str, org: str, ws: str) -> None:
    print("\n".join(banner(base, token, org, ws, runplane=runplane_command())), flush=True)


DEFAULT_URL = "http://127.0.0.1:8080"  # `runplane logs`'s default --url


def banner(base: str, token: str, org: str, ws: str, *, runplane: str) -> list[str]:
    """What `up` prints: where it is, to open it in a browser and sign in with the token
    (the web UI, services/surfaces/ui), the token, and the quick start's commands, which
    work pasted into another shell (curl and jq are the README's prerequisites). They
    are the README's "Run it" commands, which tests/test_readme.py runs, but for the
    token's value, this server's address and how to run `runplane` from here."""
    where = f"organization {org}" if ws else "an organization's name"
    lines = [
        f"runplane is up at {base}",
        f"Open {base}/ in a browser and sign in with the admin token below ({where}).",
        f"API reference: {base}/api/docs/",
        f"admin token: {token}",
        "",
    ]
    if ws:
        lines += [
            "Start a run on the demo workspace, approve it and follow it, in another shell:",
            *(f"  {line}" for line in quickstart(base, token, org, ws, runplane=runplane)),
            "",
        ]
    lines.append("Press Ctrl-C to stop.")
    return lines


def quickstart(base: str, token: str, org: str, ws: str, *, runplane: str) -> list[str]:
    host = base.removeprefix("http://")
    runs = f"{host}/api/v1/orgs/{org}/runs"
    url = "" if base == DEFAULT_URL else f" --url {base}"
    return [
        f"TOKEN={token}",
        'H="Authorization: Bearer $TOKEN"',
        f'RUN=$(curl -s -H "$H" -X POST {host}/api/v1/orgs/{org}/workspaces/{ws}/runs'
        """ -d '{"type": "apply"}' | jq -r .id)""",
        f'until [ "$(curl -s -H "$H" {runs}/$RUN | jq -r .status)" = awaiting_approval ];'
        " do sleep 1; done",
        f"""curl -s -H "$H" {runs}/$RUN | jq '{{status, plan_summary, steps}}'""",
        f"""curl -s -H "$H" -X POST {runs}/$RUN/approve -d '{{"acknowledged": []}}'""",
        f"{runplane} logs -f $RUN --org {org} --token $TOKEN{url}",
        f"""curl -s -H "$H" {runs}/$RUN/events | jq -r '.items[].type'""",
    ]


def runplane_command() -> str:
    """How another shell runs this runplane: `./dev runplane` in the clone (the console
    script is in .venv/bin, which is not on the PATH), else the script's own path."""
    root = Path(__file__).resolve().parents[2]
    if (root / "dev").is_file() and (root / "pyproject.toml").is_file():
        return "./dev runplane" if Path.cwd().resolve() == root else f"{root}/dev runplane"
    script = Path(shutil.which(sys.argv[0]) or sys.argv[0]).resolve()
    on_path = shutil.which("runplane")
    if script.name == "runplane" and (on_path is None or Path(on_path).resolve() != script):
        return str(script)
    return "runplane"


async def api(opts: Options, stack: AsyncExitStack) -> None:
    if not opts.nats_url:
        raise ConfigError("runplane api needs --nats-url (or RUNPLANE_NATS_URL)")
    _traced(stack, "runplane-api")
    options.keyring(opts)  # no key: a config error now, before connecting
    nc = await stack.enter_async_context(nats_for(opts, stack))
    base = await _start_api(opts, stack, nc, lambda: True)
    print(f"runplane api listening at {base}", flush=True)
    await wait_for_signal()


async def scheduler(opts: Options, stack: AsyncExitStack) -> None:
    if not opts.nats_url:
        raise ConfigError("runplane scheduler needs --nats-url (or RUNPLANE_NATS_URL)")
    _traced(stack, "runplane-scheduler")
    options.keyring(opts)  # no key: a config error now, before connecting
    nc = await stack.enter_async_context(nats_for(opts, stack))
    await stack.enter_async_context(Scheduler(nc, trust.scheduler_app(nc, opts), pool=opts.pool))
    await trust.start_secrets_responder(opts, stack, nc, make_app(nc))
    await stack.enter_async_context(Reaper(nc, make_app(nc)))
    await stack.enter_async_context(ScheduleLoop(make_app(nc)))  # cron schedules
    print("runplane scheduler running", flush=True)
    await wait_for_signal()


async def subscribers(opts: Options, stack: AsyncExitStack) -> None:
    """Every registered subscriber (run as many replicas as you like)."""
    if not opts.nats_url:
        raise ConfigError("runplane subscribers needs --nats-url (or RUNPLANE_NATS_URL)")
    _traced(stack, "runplane-subscribers")
    options.keyring(opts)  # no key: a config error now, before connecting
    nc = await stack.enter_async_context(nats_for(opts, stack))
    names = await _start_subscribers(opts, stack, nc)
    print(f"runplane subscribers running ({', '.join(names) or 'none registered'})", flush=True)
    await wait_for_signal()


async def executor(opts: Options, stack: AsyncExitStack) -> None:
    if not opts.nats_url:
        raise ConfigError("runplane executor needs --nats-url (or RUNPLANE_NATS_URL)")
    _traced(stack, "runplane-executor")
    options.keyring(opts)  # no key: a config error now, before connecting
    nc = await stack.enter_async_context(nats_for(opts, stack))
    await _start_executor(opts, stack, nc)
    print(f"runplane executor running (pool {opts.pool})", flush=True)
    await wait_for_signal()


async def replay(opts: Options, stack: AsyncExitStack) -> None:
    """Rebuild the read model from sequence 1 (the embedded server is started if needed)."""
    nc = await stack.enter_async_context(nats_for(opts, stack))
    count = await do_replay(nc, _readmodel_path(opts))
    print(f"replayed {count} events into {_readmodel_path(opts)}", flush=True)
