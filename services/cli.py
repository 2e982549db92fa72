"""The `runplane` console script: `up`, `api`, `scheduler`, `executor`, `replay`, `logs`."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from contextlib import AsyncExitStack
from pathlib import Path

import structlog

from services import logs, logs_cli
from services.runtime import ConfigError, Options

log = structlog.get_logger(__name__)


def _common(p: argparse.ArgumentParser, *, listen: bool = False) -> None:
    p.add_argument(
        "--data-dir", type=Path, default=Path(os.environ.get("RUNPLANE_DATA_DIR", ".runplane"))
    )
    p.add_argument(
        "--nats-url",
        default=os.environ.get("RUNPLANE_NATS_URL", ""),
        help="use this NATS server or cluster instead of starting one",
    )
    p.add_argument("--log-format", choices=("auto", "json", "console"), default="auto")
    if listen:
        p.add_argument("--listen", default=os.environ.get("RUNPLANE_LISTEN", "127.0.0.1:8080"))


def _executor_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pool", default=os.environ.get("RUNPLANE_POOL", "default"))
    p.add_argument(
        "--terraform-binary",
        default=os.environ.get("RUNPLANE_TERRAFORM_BINARY", ""),
        help="terraform or tofu binary (default: the bundled Terraform 1.0.3)",
    )
    mirrors = [m for m in os.environ.get("RUNPLANE_PROVIDER_MIRRORS", "").split(":") if m]
    p.add_argument(
        "--provider-mirror",
        dest="provider_mirrors",
        action="append",
        type=Path,
        default=[Path(m) for m in mirrors],
        help="extra filesystem mirror of providers (repeatable)",
    )


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="runplane", description=__doc__)
    sub = root.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="run everything on this machine (embedded NATS by default)")
    _common(up, listen=True)
    _executor_opts(up)
    up.add_argument("--no-demo", dest="demo", action="store_false", help="skip the demo workspace")
    api = sub.add_parser("api", help="run the HTTP API and its projector")
    _common(api, listen=True)
    sched = sub.add_parser("scheduler", help="run admission and dispatch")
    _common(sched)
    ex = sub.add_parser("executor", help="run an executor")
    _common(ex)
    _executor_opts(ex)
    rp = sub.add_parser("replay", help="rebuild the read model from sequence 1")
    _common(rp)
    logs_cli.add_parser(sub)
    return root


def options(ns: argparse.Namespace) -> Options:
    return Options(
        data_dir=ns.data_dir,
        nats_url=ns.nats_url,
        listen=getattr(ns, "listen", "127.0.0.1:8080"),
        admin_token=os.environ.get("RUNPLANE_ADMIN_TOKEN", ""),
        encryption_key=os.environ.get("RUNPLANE_ENCRYPTION_KEY", ""),
        pool=getattr(ns, "pool", "default"),
        terraform_binary=getattr(ns, "terraform_binary", ""),
        provider_mirrors=list(getattr(ns, "provider_mirrors", []) or []),
        demo=getattr(ns, "demo", True),
    )


async def _dispatch(command: str, opts: Options) -> None:
    from services import processes

    runners = {
        "up": processes.up,
        "api": processes.api,
        "scheduler": processes.scheduler,
        "executor": processes.executor,
        "replay": processes.replay,
    }
    async with AsyncExitStack() as stack:
        await runners[command](opts, stack)


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    if ns.command == "logs":  # an API client: no NATS, no structlog
        return logs_cli.main(ns)
    logs.configure(ns.log_format)
    try:
        opts = options(ns)
        opts.host_port()
        asyncio.run(_dispatch(ns.command, opts))
    except ConfigError as e:
        print(f"runplane: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except OSError as e:
        print(
            f"runplane: {e.strerror or e}: {getattr(e, 'filename', '') or ''}".rstrip(": "),
            file=sys.stderr,
        )
        return 1
    except Exception as e:  # one line for the user, the details in the log
        log.exception("fatal")
        print(f"runplane: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
