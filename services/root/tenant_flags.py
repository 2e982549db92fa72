"""The flags that keep tenants apart on shared executors and a shared control plane:
fair share of an executor's slots (executor/turns.py) and the open-runs quota
(services/app/openruns.py). Part of the `runplane` console script (services/root/cli.py)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from services.root import audit_flags


def open_runs_opts(p: argparse.ArgumentParser) -> None:
    """The open-runs quota (services/app/openruns.py): every process that starts runs."""
    for flag, default, what in (
        ("--org-max-open-runs", 500, "an organization"),
        ("--workspace-max-open-runs", 100, "a workspace"),
    ):
        env = "RUNPLANE_" + flag.removeprefix("--").upper().replace("-", "_")
        p.add_argument(
            flag,
            type=int,
            default=int(os.environ.get(env, str(default)) or default),
            help=f"runs {what} may have open at once (also {env}; default {default}); "
            "one more is refused, 429 quota-exceeded",
        )


def share_opts(p: argparse.ArgumentParser) -> None:
    """How an executor shares its slots between organizations (executor/turns.py)."""
    g = p.add_argument_group("fair share (each also RUNPLANE_<FLAG>)")
    g.add_argument(
        "--concurrency",
        type=int,
        default=int(os.environ.get("RUNPLANE_CONCURRENCY", "1") or 1),
        help="phases this executor runs at once (default 1)",
    )
    g.add_argument(
        "--org-weights",
        default=os.environ.get("RUNPLANE_ORG_WEIGHTS", ""),
        metavar="ORG=N[,...]",
        help="an organization's turns per round when several wait (default 1 each)",
    )
    g.add_argument(
        "--org-max-phases",
        type=int,
        default=int(os.environ.get("RUNPLANE_ORG_MAX_PHASES", "0") or 0),
        help="the most of this executor's slots one organization holds at once; 0 (the "
        "default): all but one while another organization has had a phase waiting in "
        "the last 10 minutes, all of them otherwise",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=float(os.environ.get("RUNPLANE_DRAIN_TIMEOUT", "1800") or 1800),
        help="on SIGTERM the executor drains: it takes no more work, gives its plans back "
        "to the pool and lets a running apply finish; after this many seconds (0: no "
        "bound) or a second SIGTERM it stops hard (default 1800)",
    )
    p.add_argument(
        "--warm-wait",
        type=float,
        default=float(os.environ.get("RUNPLANE_WARM_WAIT", "2") or 2),
        help="seconds an executor leaves an apply to the executor that planned it, which "
        "kept the plan's checkout and .terraform for it (no second clone and init); "
        "0: no checkout is kept, every apply starts cold (default 2)",
    )
    p.add_argument(
        "--warm-max-bytes",
        type=int,
        default=int(os.environ.get("RUNPLANE_WARM_MAX_BYTES", "") or 1 << 30),
        help="the most disk the plans' checkouts kept for their applies take on this "
        "executor, in all; the oldest go first (default 1073741824, 1 GiB)",
    )


def retention_opts(p: argparse.ArgumentParser) -> None:
    """Retention (services/processes/retention.py): the deployment's defaults; and the
    audit stream's flags (services/root/audit_flags.py)."""
    g = p.add_argument_group("retention (each also RUNPLANE_<FLAG>)")
    g.add_argument(
        "--log-retention-days",
        type=int,
        default=int(os.environ.get("RUNPLANE_LOG_RETENTION_DAYS", "90") or 90),
        help="days after a run ended that its stored logs are kept, for every organization "
        "that does not set log_retention_days itself (default 90)",
    )
    g.add_argument(
        "--record-retention-days",
        type=int,
        default=int(os.environ.get("RUNPLANE_RECORD_RETENTION_DAYS", "0") or 0),
        help="days after a run ended that its whole record (rows, logs, plan; its events "
        "stay) is kept, for every organization that does not set record_retention_days "
        "itself; 0 (the default): for ever",
    )
    g.add_argument(
        "--retention-interval",
        type=float,
        default=float(os.environ.get("RUNPLANE_RETENTION_INTERVAL", "3600") or 3600),
        help="seconds between two retention passes of a scheduler (default 3600)",
    )
    audit_flags.opts(p)  # the audit log's other way out: its stream to destinations


def retention(ns: argparse.Namespace) -> dict[str, Any]:
    """The retention and audit stream flags given (and the executor's drain timeout), as
    Options' fields."""
    names = (
        "log_retention_days",
        "record_retention_days",
        "retention_interval",
        "drain_timeout",
        "warm_wait",
        "warm_max_bytes",
    )
    given = {name: getattr(ns, name) for name in names if hasattr(ns, name)}
    return {**given, **audit_flags.values(ns)}
