"""The flags of the audit log's streaming to its destinations (services/processes/
audit_stream.py). Part of the `runplane` console script (services/root/cli.py): every
process takes them (the api judges a destination's URL when it is saved, the
subscribers send)."""

from __future__ import annotations

import argparse
import os
from typing import Any

_ALLOW_HTTP = ("1", "true", "yes")


def _seconds(raw: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in raw.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not seconds, comma separated: {raw!r}") from e


def opts(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the audit stream (each also RUNPLANE_<FLAG>)")
    g.add_argument(
        "--audit-stream-retry",
        type=_seconds,
        default=_seconds(os.environ.get("RUNPLANE_AUDIT_STREAM_RETRY", "") or "2,10,60,300"),
        metavar="S[,S...]",
        help="seconds before each new try of a destination that failed, the last repeating "
        "for as long as it fails (default 2,10,60,300); a record is never given up",
    )
    g.add_argument(
        "--audit-stream-timeout",
        type=float,
        default=float(os.environ.get("RUNPLANE_AUDIT_STREAM_TIMEOUT", "") or 10),
        help="seconds one request to a destination may take, answer read included (default 10)",
    )
    g.add_argument(
        "--audit-stream-batch",
        type=int,
        default=int(os.environ.get("RUNPLANE_AUDIT_STREAM_BATCH", "") or 100),
        help="audit records one request carries at most (1 to 1000, default 100)",
    )
    g.add_argument(
        "--audit-stream-allow-http",
        action="store_true",
        default=os.environ.get("RUNPLANE_AUDIT_STREAM_ALLOW_HTTP", "") in _ALLOW_HTTP,
        help="take http:// destinations too (a collector on this host, tests); without it "
        "only https://",
    )


def values(ns: argparse.Namespace) -> dict[str, Any]:
    """The flags given, as Options' fields."""
    names = ("retry", "timeout", "batch", "allow_http")
    return {
        f"audit_stream_{n}": getattr(ns, f"audit_stream_{n}")
        for n in names
        if hasattr(ns, f"audit_stream_{n}")
    }
