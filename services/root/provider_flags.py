"""The executor's provider flags: the operator's mirrors and the host's provider cache
(executor/providers.py)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from infra.sizes import parse_size

CACHE_SIZE = "10GiB"


def add(p: argparse.ArgumentParser) -> None:
    """`--provider-mirror`, `--provider-cache`, `--provider-cache-size` (and their
    RUNPLANE_* variables)."""
    mirrors = [m for m in os.environ.get("RUNPLANE_PROVIDER_MIRRORS", "").split(":") if m]
    p.add_argument(
        "--provider-mirror",
        dest="provider_mirrors",
        action="append",
        type=Path,
        default=[Path(m) for m in mirrors],
        help="extra filesystem mirror of providers (repeatable)",
    )
    p.add_argument(
        "--provider-cache",
        default=os.environ.get("RUNPLANE_PROVIDER_CACHE", ""),
        help="the host's provider cache: each package a lock file names unpacked once from "
        "the mirrors, checked against its hashes, read-only to jobs (default: beside the "
        "jobs directory; none: off)",
    )
    p.add_argument(
        "--provider-cache-size",
        type=parse_size,
        default=parse_size(os.environ.get("RUNPLANE_PROVIDER_CACHE_SIZE", CACHE_SIZE)),
        help=f"bytes the provider cache may hold (default {CACHE_SIZE}); the least "
        "recently used entries no phase holds go first",
    )


def options(ns: argparse.Namespace) -> dict[str, Any]:
    """The `Options` fields these flags set."""
    return {
        "provider_mirrors": list(getattr(ns, "provider_mirrors", []) or []),
        "provider_cache": getattr(ns, "provider_cache", ""),
        "provider_cache_size": getattr(ns, "provider_cache_size", parse_size(CACHE_SIZE)),
    }
