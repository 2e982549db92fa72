"""The flags of identity. Workload identity (docs/workload-identity.md): the issuer's
public URL and how often its signing key rotates; every process takes them (the api
publishes the keys, the scheduler's secrets responder signs with them). Single sign-on:
what addresses an organization's identity provider may have (the api). Part of the
`runplane` console script (services/root/cli.py)."""

from __future__ import annotations

import argparse
import os

from infra.options import WORKLOAD_KEY_ROTATION, ConfigError

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


def sso_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sso-allow",
        default=os.environ.get("RUNPLANE_SSO_ALLOW"),
        metavar="KINDS",
        help="address kinds an identity provider may have besides public ones: loopback, "
        "private (comma separated; also RUNPLANE_SSO_ALLOW; default RUNPLANE_NOTIFY_ALLOW's)",
    )


def kinds(raw: str | None) -> frozenset[str] | None:
    """`--sso-allow`'s address kinds (None: not given)."""
    if raw is None:
        return None
    found = frozenset(k.strip() for k in raw.split(",") if k.strip())
    if found - {"loopback", "private"}:
        raise ConfigError(f"--sso-allow: {raw!r}: only loopback and private")
    return found
