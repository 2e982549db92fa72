"""The flags of the past: the api's bounds on `?as_of=` answers (projections/asof.py),
and `runplane replay [--until SEQ|TIME] [--output FILE]` (the run is
services/root/processes.py `replay`, the rebuild projections/replay.py)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any


def add_parser(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    rp = sub.add_parser("replay", help="rebuild the read model from sequence 1")
    common(rp)
    rp.add_argument(
        "--until",
        default="",
        metavar="SEQ|TIME",
        help="stop at this stream sequence, or at the last one stored at or before this "
        "RFC 3339 time: the read model as it was then",
    )
    rp.add_argument(
        "--output",
        default="",
        metavar="FILE",
        help="write the read model here instead of replacing the data directory's",
    )


def as_of_opts(p: argparse.ArgumentParser) -> None:
    """`?as_of=`'s scratch read models (projections/asof.py): the api's bounds on them."""
    g = p.add_argument_group("as_of answers (each also RUNPLANE_<FLAG>)")
    for flag, default, what in (
        ("--as-of-models", 16, "scratch read models kept cached, least recently used out"),
        (
            "--as-of-max-events",
            20_000,
            "events one ?as_of= request may fold; past it 503 as-of-too-costly, the next "
            "request going on from there",
        ),
        (
            "--as-of-events-per-minute",
            100_000,
            "events one organization's ?as_of= requests may fold a minute, all together; "
            "past it 503 as-of-too-costly until the minute is over (0: no bound)",
        ),
    ):
        env = "RUNPLANE_" + flag.removeprefix("--").upper().replace("-", "_")
        g.add_argument(
            flag,
            type=int,
            default=int(os.environ.get(env, str(default)) or default),
            help=f"{what} (default {default})",
        )


def snapshot_opts(p: argparse.ArgumentParser) -> None:
    """Read-model snapshots (projections/snapshots.py): how often this api writes one."""
    g = p.add_argument_group("read-model snapshots (each also RUNPLANE_<FLAG>)")
    g.add_argument(
        "--snapshot-interval",
        type=float,
        default=float(os.environ.get("RUNPLANE_SNAPSHOT_INTERVAL", "600") or 600),
        help="seconds between two snapshots of the read model into rp-snapshots, written "
        "by whichever api replica's turn comes first (default 600; 0: this one never "
        "writes). A new replica restores the newest and tails from there",
    )
    g.add_argument(
        "--snapshot-keep",
        type=int,
        default=int(os.environ.get("RUNPLANE_SNAPSHOT_KEEP", "3") or 3),
        help="snapshots kept, the newest (default 3)",
    )


def options(ns: argparse.Namespace) -> dict[str, Any]:
    """The as_of, snapshot and replay flags given, as Options' fields."""
    names: tuple[str, ...] = ("as_of_models", "as_of_max_events", "as_of_events_per_minute")
    names += ("snapshot_interval", "snapshot_keep")
    given = {name: getattr(ns, name) for name in names if hasattr(ns, name)}
    if ns.command == "replay":
        given |= {"replay_until": ns.until, "replay_output": ns.output}
    return given
