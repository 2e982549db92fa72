"""tracing: what the request span costs the api when no exporter is configured.

One process, one nats-server, one read model; the api served twice, with and without the
tracing middleware (services/surfaces/api/middleware.py `trace_requests`), tracing set up as
`runplane api` sets it up (no collector named). `GET /api/v1/orgs/{org}/runs/{run}` with
the admin token in chunks of 200, alternating which goes first, so that both see the same
noise of a shared machine. Prints one JSON line: p50, p99 and mean of each.

    python -m bench.tracing [--rounds 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "bench"

import aiohttp
import structlog
from aiohttp import web

import services.surfaces.api.app as api_app
from events.run import Workspace
from infra import streams, tracing
from infra.eventstore import EventStore
from infra.natsserver import EmbeddedNats
from projections.projector import Projector
from services.app.commands import App
from services.surfaces.api.middleware import MIDDLEWARES, trace_requests

CHUNK = 200
TOKEN = "bench-tracing-token"


async def _site(web_app: web.Application, stack: list[web.AppRunner]) -> str:
    runner = web.AppRunner(web_app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    stack.append(runner)
    host, port = runner.addresses[0][:2]
    return f"http://{host}:{port}"


def _figures(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {
        "n": len(xs),
        "p50_ms": xs[len(xs) // 2] * 1000,
        "p99_ms": xs[int(len(xs) * 0.99)] * 1000,
        "mean_ms": statistics.mean(xs) * 1000,
    }


async def measure(rounds: int) -> dict[str, Any]:
    tracing.setup("bench-tracing")
    runners: list[web.AppRunner] = []
    with tempfile.TemporaryDirectory(prefix="rpbench-tracing-") as tmp:
        async with EmbeddedNats(Path(tmp) / "nats") as server:
            nc = await server.connect()
            try:
                await streams.declare(nc, nc.jetstream())
                app = App(EventStore(nc))
                await app.create_org("bench", "admin")
                ws = Workspace(repository="https://example.com/infra.git")
                await app.create_workspace("bench", "net", ws, "admin")
                run = (await app.create_run("bench", "net", "plan", "admin")).state.run_id
                async with Projector(nc, Path(tmp) / "rm.sqlite") as projector:
                    assert await projector.wait_for(await app.store.last_seq(), timeout=10)
                    urls = {}
                    untraced = tuple(m for m in MIDDLEWARES if m is not trace_requests)
                    for name, middlewares in (("traced", MIDDLEWARES), ("untraced", untraced)):
                        # build_app reads the module's MIDDLEWARES: patched on purpose
                        api_app.MIDDLEWARES = middlewares  # type: ignore[attr-defined,assignment]
                        web_app = api_app.build_app(app=app, projector=projector, admin_token=TOKEN)
                        base = await _site(web_app, runners)
                        urls[name] = f"{base}/api/v1/orgs/bench/runs/{run}"
                    api_app.MIDDLEWARES = MIDDLEWARES  # type: ignore[attr-defined]  # restored
                    lat: dict[str, list[float]] = {name: [] for name in urls}
                    cpu = dict.fromkeys(urls, 0.0)
                    auth = {"Authorization": f"Bearer {TOKEN}"}
                    async with aiohttp.ClientSession(headers=auth) as s:
                        for rnd in range(rounds + 1):  # round 0 warms up
                            order = list(urls.items())
                            for name, url in order if rnd % 2 else order[::-1]:
                                started = time.process_time()
                                for _ in range(CHUNK):
                                    t = time.perf_counter()
                                    async with s.get(url) as r:
                                        await r.read()
                                        assert r.status == 200, r.status
                                    if rnd:
                                        lat[name].append(time.perf_counter() - t)
                                if rnd:
                                    cpu[name] += time.process_time() - started
                    for runner in runners:
                        await runner.cleanup()
            finally:
                await nc.close()
    return {name: _figures(xs) | {"cpu_us": cpu[name] / len(xs) * 1e6} for name, xs in lat.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.tracing", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    print(json.dumps(asyncio.run(measure(args.rounds))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
