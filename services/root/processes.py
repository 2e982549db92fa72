"""The processes `runplane` runs, each one built from its options in one place."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path

import structlog

from executor import Executor
from infra import options, tracing
from infra.options import ConfigError, Options, admin_token
from projections import asof
from projections.replay import replay as do_replay
from services.root import bootstrap
from services.root.bootstrap import Plane
from services.root.demo import DEMO_ORG, DEMO_WS, ensure_demo
from services.root.runtime import nats_for, wait_for_signal

log = structlog.get_logger(__name__)


def _traced(stack: AsyncExitStack, service: str) -> None:
    """This process's tracer provider (infra/tracing.py), flushed at its end."""
    tracing.setup(service)
    stack.callback(tracing.shutdown)


async def _plane(opts: Options, stack: AsyncExitStack, *, create_key: bool = False) -> Plane:
    """The key first (none: a config error now, before connecting; `create_key`: made
    once in the data directory, `runplane up`), then NATS, then the process's graph."""
    keyring = options.keyring(opts, create=create_key)
    nc = await stack.enter_async_context(nats_for(opts, stack))
    return bootstrap.build(opts, nc, stack, keyring=keyring)


def local_ca(opts: Options) -> Path | None:
    """The CA to trust when `up` made its own certificate (printed in the banner)."""
    if opts.tls and not opts.tls_cert:
        return opts.data_dir.resolve() / "tls" / "ca.pem"
    return None


async def _run(
    opts: Options,
    stack: AsyncExitStack,
    service: str,
    start: Callable[[Plane], Awaitable[str]],
    *,
    create_key: bool = False,
    drain: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Every process's one path: traced as `service`, its graph built (bootstrap.py),
    `start`ed (which says what runs, printed), until SIGINT or SIGTERM; then `drain`
    (the executor's), if given, before its resources close."""
    _traced(stack, service)
    plane = await _plane(opts, stack, create_key=create_key)
    print(await start(plane), flush=True)
    await wait_for_signal()
    if drain is not None:
        await drain()


async def start_all(plane: Plane) -> str:
    """Start every component on one machine; return the API's base URL once all are ready."""
    components_ready = {"v": False}
    base = await plane.start_api(lambda: components_ready["v"])
    await plane.start_scheduler()
    await plane.start_executor(fallback_to_none=plane.opts.isolation == "auto")
    await plane.start_subscribers()
    await plane.start_runwatch()
    if plane.opts.demo:
        await ensure_demo(plane.app, plane.opts.data_dir)
    components_ready["v"] = True
    return base


async def up(opts: Options, stack: AsyncExitStack) -> None:
    """Everything on one machine: embedded NATS, api+projector, scheduler, one executor,
    the subscribers."""
    # One machine: its own receivers (a local chat bridge, a test hook) may be notified.
    os.environ.setdefault("RUNPLANE_NOTIFY_ALLOW", "loopback")
    await _run(opts, stack, "runplane", _up, create_key=True)
    log.info("shutting_down")


async def _up(plane: Plane) -> str:
    opts = plane.opts
    base = await start_all(plane)
    ws = DEMO_WS if opts.demo else ""
    lines = banner(base, admin_token(opts), DEMO_ORG, ws, runplane=runplane_command())
    ca = local_ca(opts)
    if ca is not None:  # loudly: without it no client trusts this server
        lines += [
            f"TLS: trust this runplane's local CA: {ca}",
            f"  Terraform: export SSL_CERT_FILE={ca}",
            f"  curl: --cacert {ca}",
        ]
    return "\n".join(lines)


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


async def _serve(
    opts: Options,
    stack: AsyncExitStack,
    process: str,
    start: Callable[[Plane], Awaitable[str]],
    drain: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """One process of a deployment, against the given NATS servers (`_run`)."""
    if not opts.nats_url:
        raise ConfigError(f"runplane {process} needs --nats-url (or RUNPLANE_NATS_URL)")
    await _run(opts, stack, f"runplane-{process}", start, drain=drain)


async def _api(plane: Plane) -> str:
    return f"runplane api listening at {await plane.start_api()}"


async def _scheduler(plane: Plane) -> str:
    await plane.start_scheduler()  # with the secrets responder, the reaper, cron schedules
    return "runplane scheduler running"


async def _subscribers(plane: Plane) -> str:
    names = (await plane.start_subscribers()).names
    return f"runplane subscribers running ({', '.join(names) or 'none registered'})"


async def api(opts: Options, stack: AsyncExitStack) -> None:
    await _serve(opts, stack, "api", _api)


async def scheduler(opts: Options, stack: AsyncExitStack) -> None:
    await _serve(opts, stack, "scheduler", _scheduler)


async def subscribers(opts: Options, stack: AsyncExitStack) -> None:
    """Every registered subscriber (run as many replicas as you like)."""
    await _serve(opts, stack, "subscribers", _subscribers)


async def executor(opts: Options, stack: AsyncExitStack) -> None:
    """An executor until SIGTERM, then its drain (`Executor.drained`): no new work, plans
    given back to the pool, a running apply finished; a second SIGTERM stops it hard."""
    started: list[Executor] = []

    async def start(plane: Plane) -> str:
        started.append(await plane.start_executor())
        return f"runplane executor running (pool {plane.opts.pool})"

    async def drain() -> None:
        await started[0].drained(opts.drain_timeout)

    await _serve(opts, stack, "executor", start, drain)


async def replay(opts: Options, stack: AsyncExitStack) -> None:
    """Rebuild the read model from sequence 1 (the embedded server is started if needed)."""
    nc = await stack.enter_async_context(nats_for(opts, stack))
    path = Path(opts.replay_output) if opts.replay_output else bootstrap.readmodel_path(opts)
    until = None
    if opts.replay_until:
        try:
            until = await asof.resolve(nc, opts.replay_until)
        except asof.AsOfError as e:
            raise ConfigError(f"--until: {e}") from None
    count = await do_replay(nc, path, until=until)
    upto = f" up to sequence {until}" if until is not None else ""
    print(f"replayed {count} events{upto} into {path}", flush=True)
