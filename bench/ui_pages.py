"""Server time of the UI's run page and organization page over a large read model:
100,000 runs in one organization, 1,000 of them active (one per workspace, 1,000
workspaces), targets p99 <= 50 ms (run page) and <= 100 ms (organization page).

    PYTHONPATH=$PWD python bench/ui_pages.py [--runs 100000] [--active 1000] [-n 200]

The rows are written straight into the read model's tables (the projector's checkpoint
untouched), as a replay would have left them; the pages are then asked through the real
app (session, middlewares, templates) over loopback HTTP, one request at a time. Prints
one JSON line. Not a test: it is run by hand (the machine is shared)."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from aiohttp.test_utils import TestClient, TestServer

from events.run import RunState
from infra import streams
from infra.eventstore import EventStore
from infra.natsserver import EmbeddedNats
from projections.projector import Projector
from services.app.commands import App
from services.surfaces.api.app import build_app

ADMIN = "bench-admin-token"
STATE = msgspec.json.encode(RunState(org="bench", run_type="apply")).decode()
ORG = "bench"


def fill(db: Path, runs: int, active: int) -> str:
    """`runs` runs over `active` workspaces, the newest of each active; returns a run id."""
    con = sqlite3.connect(db)
    ws_rows = [
        (
            ORG,
            f"ws-{i}",
            "https://example.com/r.git",
            "main",
            ".",
            "{}",
            "2026-01-01T00:00:00Z",
            "bench",
            None,
            600,
            0,
            1,
            None,
            f"folder-{i % 10}",
        )
        for i in range(active)
    ]
    con.executemany(f"INSERT OR REPLACE INTO workspaces VALUES ({','.join('?' * 14)})", ws_rows)
    rows = []
    for n in range(runs):
        ws = n % active
        newest = n >= runs - active
        status = ("awaiting_approval" if ws % 10 == 0 else "planning") if newest else "applied"
        at = f"2026-01-01T00:00:00.{n:06d}Z" if n < 1_000_000 else "2026-01-02T00:00:00Z"
        rows.append(
            (
                f"r{n:025d}",
                ORG,
                f"ws-{ws}",
                "apply",
                status,
                "bench",
                at,
                at,
                f"run {n}",
                "abc",
                1,
                1,
                0,
                0,
                1,
                0,
                0,
                "",
                "",
                "[]",
                "",
                "",
                "plan",
                "",
                "",
                n,
                STATE,
            )
        )
    con.executemany(f"INSERT OR REPLACE INTO runs VALUES ({','.join('?' * 27)})", rows)
    con.executemany(
        "UPDATE workspaces SET active_run = ? WHERE org = ? AND name = ?",
        [(f"r{n:025d}", ORG, f"ws-{n % active}") for n in range(runs - active, runs)],
    )
    con.commit()
    con.close()
    return f"r{runs - 1:025d}"


async def timed(session: aiohttp.ClientSession, url: str, n: int) -> dict[str, float]:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        async with session.get(url) as r:
            await r.read()
            assert r.status == 200, (url, r.status)
        times.append((time.perf_counter() - t) * 1000)
    times.sort()
    return {
        "p50_ms": round(statistics.median(times), 2),
        "p99_ms": round(times[min(len(times) - 1, int(len(times) * 0.99))], 2),
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        async with EmbeddedNats(root / "nats") as server:
            nc = await server.connect()
            await streams.declare(nc, nc.jetstream())
            app = App(EventStore(nc))
            async with Projector(nc, root / "rm.sqlite") as projector:
                made = await app.create_org(ORG, "bench")
                assert await projector.wait_for(made.seq)
                t = time.perf_counter()
                run_id = fill(root / "rm.sqlite", args.runs, args.active)
                fill_s = time.perf_counter() - t
                web_app = build_app(app=app, projector=projector, admin_token=ADMIN)
                async with TestClient(TestServer(web_app)) as client:
                    session = client.session
                    form = await (await client.get("/")).text()
                    csrf = re.search(r'name="csrf" value="([^"]*)"', form)
                    assert csrf
                    signed = await client.post(
                        "/signin", data={"token": ADMIN, "org": ORG, "csrf": csrf.group(1)}
                    )
                    assert signed.status == 200, await signed.text()
                    base = str(client.make_url(""))
                    await timed(session, f"{base}/orgs/{ORG}", 3)  # warm
                    org = await timed(session, f"{base}/orgs/{ORG}", args.n)
                    run = await timed(session, f"{base}/orgs/{ORG}/runs/{run_id}", args.n)
            await nc.close()
    return {
        "runs": args.runs,
        "active": args.active,
        "requests": args.n,
        "fill_s": round(fill_s, 1),
        "org_page": org,
        "run_page": run,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=100_000)
    parser.add_argument("--active", type=int, default=1_000)
    parser.add_argument("-n", type=int, default=200)
    print(json.dumps(asyncio.run(main(parser.parse_args()))))
    sys.exit(0)
