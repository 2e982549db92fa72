"""`runplane audit verify`: its flags and its run (services/surfaces/audit_verify.py)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from infra.options import Options


def add_parser(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    audit_cmd = sub.add_parser("audit", help="the organizations' audit chains")
    audit_sub = audit_cmd.add_subparsers(dest="audit_command", required=True)
    verify = audit_sub.add_parser(
        "verify", help="recompute every audit chain and check every checkpoint (exit 1: broken)"
    )
    common(verify)
    verify.add_argument("--org", default="", help="one organization's chain only")
    verify.add_argument(
        "--from", dest="from_seq", type=int, default=1, help="start at this stream sequence"
    )
    verify.add_argument(
        "--pubkey",
        type=Path,
        default=None,
        help="the checkpoints' public keys, pinned (GET /api/v1/audit/keys saved)",
    )


async def run(ns: argparse.Namespace, opts: Options) -> int:
    from services.root import natsstatus
    from services.surfaces import audit_verify

    keys = audit_verify.pinned(ns.pubkey) if ns.pubkey is not None else None
    async with AsyncExitStack() as stack:
        nc = await natsstatus.connect(opts, stack)
        return await audit_verify.verify(
            nc, sys.stdout, org=ns.org, from_seq=max(1, ns.from_seq), keys=keys
        )
