"""The processes `runplane` runs, each one built from its options in one place."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path

import structlog
from nats.aio.client import Client as NATS

from services import trust
from services.repositories import deployment_sources
from services.runtime import (
    ConfigError,
    Options,
    admin_token,
    http_site,
    make_app,
    nats_for,
    prepare_data_dir,
    wait_for_signal,
)

log = structlog.get_logger(__name__)


def _readmodel_path(opts: Options) -> Path:
    prepare_data_dir(opts.data_dir)  # 0700: the read model holds every organization's data
    return opts.data_dir / "readmodel.sqlite"


async def _start_api(
    opts: Options, stack: AsyncExitStack, nc: NATS, ready: Callable[[], bool]
) -> str:
    from projections.projector import Projector
    from services.api.app import build_app

    app = make_app(nc)
    projector = await stack.enter_async_context(Projector(nc, _readmodel_path(opts)))
    web_app = build_app(
        app=app,
        projector=projector,
        admin_token=admin_token(opts),
        ready=ready,
        secret_store=trust.secret_store(nc, opts),
        repositories=deployment_sources(opts.allowed_repos, opts.data_dir),
    )
    return await stack.enter_async_context(http_site(web_app, opts.listen))


async def _start_executor(
    opts: Options, stack: AsyncExitStack, nc: NATS, *, fallback_to_none: bool = False
) -> None:
    """`fallback_to_none`: `runplane up` of an ordinary user runs jobs unisolated (with a
    warning at every start) where there is no isolation to be had; `executor` refuses."""
    from executor.isolation import Isolation, IsolationError
    from executor.worker import Executor, TerraformSettings, default_executor_id

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
        keyring=trust.keyring(opts),
        repositories=deployment_sources(opts.allowed_repos, opts.data_dir),
        isolation=isolation.hiding(opts.data_dir),
    )
    await stack.enter_async_context(ex)


async def _start_subscribers(opts: Options, stack: AsyncExitStack, nc: NATS) -> list[str]:
    """Every registered subscription (services/subscribers/); their names."""
    from services.subscribers.host import Host
    from services.subscribers.registry import SubscriberContext

    ctx = SubscriberContext(
        nc=nc, app=make_app(nc), opts=opts, readmodel_path=_readmodel_path(opts)
    )
    host = await stack.enter_async_context(Host(ctx))
    return host.names


async def start_all(opts: Options, stack: AsyncExitStack) -> str:
    """Start every component on one machine; return the API's base URL once all are ready."""
    from services.demo import ensure_demo
    from services.scheduler.reaper import Reaper
    from services.scheduler.scheduler import Scheduler

    trust.keyring(opts, create=True)  # made once in the data directory; all below share it
    nc = await stack.enter_async_context(nats_for(opts, stack))
    components_ready = {"v": False}
    base = await _start_api(opts, stack, nc, lambda: components_ready["v"])
    await stack.enter_async_context(Scheduler(nc, trust.scheduler_app(nc, opts), pool=opts.pool))
    await trust.start_secrets_responder(opts, stack, nc, make_app(nc))
    await stack.enter_async_context(Reaper(nc, make_app(nc)))
    await _start_executor(opts, stack, nc, fallback_to_none=opts.isolation == "auto")
    await _start_subscribers(opts, stack, nc)
    if opts.demo:
        await ensure_demo(make_app(nc), opts.data_dir)
    components_ready["v"] = True
    return base


async def up(opts: Options, stack: AsyncExitStack) -> None:
    """Everything on one machine: embedded NATS, api+projector, scheduler, one executor,
    the subscribers."""
    from services.demo import DEMO_ORG, DEMO_WS

    base = await start_all(opts, stack)
    _banner(base, admin_token(opts), DEMO_ORG, DEMO_WS if opts.demo else "")
    await wait_for_signal()
    log.info("shutting_down")


def _banner(base: str, token: str, org: str, ws: str) -> None:
    h = f'-H "Authorization: Bearer {token}"'
    lines = [
        f"runplane is up at {base}",
        f"admin token: {token}",
        "",
    ]
    if ws:
        lines += [
            "Start a run on the demo workspace, then approve it and follow it:",
            f"  curl -s {h} -X POST {base}/api/v1/orgs/{org}/workspaces/{ws}/runs"
            ' -d \'{"type": "apply"}\'',
            f"  curl -s {h} {base}/api/v1/orgs/{org}/runs/RUN_ID",
            f"  curl -s {h} -X POST {base}/api/v1/orgs/{org}/runs/RUN_ID/approve"
            " -d '{\"acknowledged\": []}'",
            f"  curl -s {h} {base}/api/v1/orgs/{org}/runs/RUN_ID/events",
            f"  runplane logs -f RUN_ID --org {org} --url {base} --token {token}",
            "",
        ]
    lines.append("Press Ctrl-C to stop.")
    print("\n".join(lines), flush=True)


async def api(opts: Options, stack: AsyncExitStack) -> None:
    if not opts.nats_url:
        raise ConfigError("runplane api needs --nats-url (or RUNPLANE_NATS_URL)")
    trust.keyring(opts)  # no key: a config error now, before connecting
    nc = await stack.enter_async_context(nats_for(opts, stack))
    base = await _start_api(opts, stack, nc, lambda: True)
    print(f"runplane api listening at {base}", flush=True)
    await wait_for_signal()


async def scheduler(opts: Options, stack: AsyncExitStack) -> None:
    from services.scheduler.reaper import Reaper
    from services.scheduler.scheduler import Scheduler

    if not opts.nats_url:
        raise ConfigError("runplane scheduler needs --nats-url (or RUNPLANE_NATS_URL)")
    trust.keyring(opts)  # no key: a config error now, before connecting
    nc = await stack.enter_async_context(nats_for(opts, stack))
    await stack.enter_async_context(Scheduler(nc, trust.scheduler_app(nc, opts), pool=opts.pool))
    await trust.start_secrets_responder(opts, stack, nc, make_app(nc))
    await stack.enter_async_context(Reaper(nc, make_app(nc)))
    print("runplane scheduler running", flush=True)
    await wait_for_signal()


async def subscribers(opts: Options, stack: AsyncExitStack) -> None:
    """Every registered subscriber (run as many replicas as you like)."""
    if not opts.nats_url:
        raise ConfigError("runplane subscribers needs --nats-url (or RUNPLANE_NATS_URL)")
    trust.keyring(opts)  # no key: a config error now, before connecting
    nc = await stack.enter_async_context(nats_for(opts, stack))
    names = await _start_subscribers(opts, stack, nc)
    print(f"runplane subscribers running ({', '.join(names) or 'none registered'})", flush=True)
    await wait_for_signal()


async def executor(opts: Options, stack: AsyncExitStack) -> None:
    if not opts.nats_url:
        raise ConfigError("runplane executor needs --nats-url (or RUNPLANE_NATS_URL)")
    trust.keyring(opts)  # no key: a config error now, before connecting
    nc = await stack.enter_async_context(nats_for(opts, stack))
    await _start_executor(opts, stack, nc)
    print(f"runplane executor running (pool {opts.pool})", flush=True)
    await wait_for_signal()


async def replay(opts: Options, stack: AsyncExitStack) -> None:
    """Rebuild the read model from sequence 1 (the embedded server is started if needed)."""
    from projections.replay import replay as do_replay

    nc = await stack.enter_async_context(nats_for(opts, stack))
    count = await do_replay(nc, _readmodel_path(opts))
    print(f"replayed {count} events into {_readmodel_path(opts)}", flush=True)
