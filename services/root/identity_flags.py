"""The flags of workload identity (docs/workload-identity.md): the issuer's public URL and
how often its signing key rotates. Part of the `runplane` console script
(services/root/cli.py); every process takes them (the api publishes the keys, the
scheduler's secrets responder signs with them)."""

from __future__ import annotations

import argparse
import os

from infra.options import WORKLOAD_KEY_ROTATION

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def duration(text: str) -> int:
    """Seconds of `604800`, `7d`, `12h`, `30m` or `90s`."""
    text = text.strip().lower()
    unit = _UNITS.get(text[-1:], 0)
    number = text[:-1] if unit else text
    if not number.isascii() or not number.isdigit() or len(number) > 12:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (7d, 12h, 3600)")
    return int(number) * (unit or 1)


def identity_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--public-url",
        default=os.environ.get("RUNPLANE_PUBLIC_URL", ""),
        metavar="URL",
        help="the deployment's URL as people and clouds reach it (also RUNPLANE_PUBLIC_URL): "
        "run links, and the issuer of workload identity tokens (clouds fetch "
        "URL/.well-known/openid-configuration); default http://<listen>",
    )
    p.add_argument(
        "--workload-key-rotation",
        type=duration,
        default=os.environ.get("RUNPLANE_WORKLOAD_KEY_ROTATION", str(WORKLOAD_KEY_ROTATION)),
        metavar="DURATION",
        help="how often a new workload identity signing key is made (also "
        "RUNPLANE_WORKLOAD_KEY_ROTATION; 1h to 90d, default 7d); the old one stays published "
        "until every token it signed has expired",
    )
