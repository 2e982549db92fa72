"""notifications: event to delivery latency, and fan-out with one destination hanging.

Each part starts its own nats-server (`private_server`) and runs the notifications
subscriber as `runplane subscribers` runs it (`services/processes/notifications/subscriber.py`
`serving`: the shared consumer loop over `rp.run.>` with each run's state, configurations
read from the log, each delivery scheduled in the log, sent on its destination's lane,
its attempt recorded, tokens opened from the sealed store), with real local HTTP
receivers that check the signatures, each in a process of its own (as a receiver is):

1. **latency**: `run.created` events appended on a fixed clock (open loop) at `--rate`
   runs/s for `--seconds` s (each through `App.create_run`), one signed generic
   configuration on their organization; time from the append's acknowledgement to the
   receiver having the delivery. Target: p99 <= 1 s.
2. **fan-out**: 1,000 configurations (each its own destination URL on the receiver) and
   one more whose receiver never answers (10 s timeout, retried on the schedule)
   throughout; `--events` run events, each delivered to all of them. Deliveries per
   second from the first append to the last good delivery. Target: >= 500/s.

    python -m bench.notifications [--rate 100] [--seconds 10] [--destinations 1000] [--events 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "bench"

import aiohttp
import msgspec
from aiohttp import web

from bench.common import Result, connected, ms, percentile, private_server
from events import notification as nt
from events import run as R
from infra.crypto import KeyRing
from infra.eventstore import EventStore
from services.app.commands import App
from services.processes.notifications import outbox, signing
from services.processes.notifications.delivery import Policy
from services.processes.notifications.subscriber import serving
from services.processes.notifications.tokens import TokenStore

TOKEN = "bench-notify-token"
KEYS = KeyRing.generate()


class Receiver:
    """Counts deliveries (checking both signatures) and notes when each run's came."""

    def __init__(self, *, hang: bool = False) -> None:
        self.hang = hang
        self.first: dict[str, float] = {}  # run id: arrival (monotonic) of its first
        self.lag: dict[str, float] = {}  # run id: arrival (wall) - run_created_at
        self.count = 0
        self.requests = 0  # received, answered or not
        self.bad = 0
        self.ids: set[str] = set()
        self.last = 0.0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.requests += 1
        if self.hang:
            await asyncio.Event().wait()
        now = time.monotonic()
        h = request.headers
        ok = signing.check_tfe(TOKEN, body, h.get(signing.TFE_HEADER, "")) and signing.check_rp(
            TOKEN, body, h.get(signing.RP_HEADER, ""), time.time()
        )
        self.bad += not ok
        self.count += 1
        self.ids.add(h.get(signing.DELIVERY_HEADER, ""))
        payload = msgspec.json.decode(body)
        run_id = payload["run_id"]
        if run_id not in self.first:
            self.first[run_id] = now
            created = datetime.fromisoformat(payload["run_created_at"])
            self.lag[run_id] = time.time() - created.timestamp()
        self.last = now
        return web.Response(text="ok")

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "count": self.count,
                "bad": self.bad,
                "ids": len(self.ids),
                "runs": len(self.first),
                "lag": list(self.lag.values()),
                "last": self.last,
                "requests": self.requests,
            }
        )

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[Receiver]:
        app = web.Application()
        app.router.add_get("/stats", self._stats)
        app.router.add_post("/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        try:
            yield self
        finally:
            await self._runner.cleanup()


class Remote:
    """A `Receiver` in a process of its own (as a real receiver is: its CPU is not the
    subscriber's), asked for its counts over HTTP."""

    def __init__(self, *, hang: bool = False) -> None:
        self.hang = hang
        self.url = ""
        self.stats: dict[str, Any] = {}
        self._proc: asyncio.subprocess.Process | None = None
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Remote:
        args = [sys.executable, "-m", "bench.notifications", "--receiver"]
        self._proc = await asyncio.create_subprocess_exec(
            *args, *(["--hang"] if self.hang else []), stdout=asyncio.subprocess.PIPE
        )
        assert self._proc.stdout is not None
        self.url = (await asyncio.wait_for(self._proc.stdout.readline(), 30)).decode().strip()
        self._http = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._http is not None:
            await self._http.close()
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()
            await self._proc.wait()

    async def poll(self) -> dict[str, Any]:
        assert self._http is not None
        async with self._http.get(f"{self.url}/stats") as resp:
            self.stats = await resp.json()
        return self.stats


async def _serve_receiver(hang: bool) -> None:
    async with Receiver(hang=hang).serving() as rx:
        print(rx.url, flush=True)
        await asyncio.Event().wait()


async def _org(
    app: App, store: EventStore, tokens: TokenStore, urls: list[str], workspaces: int = 1
) -> None:
    await app.create_org("bench", "b")
    for i in range(workspaces):
        await app.create_workspace("bench", f"ws-{i}", R.Workspace(repository="/nowhere"), "b")

    async def one(url: str) -> None:
        cmd = nt.SaveConfig(
            actor="b",
            config_id=app.ids(),
            org="bench",
            create=True,
            name="bench",
            destination="generic",
            url=url,
            triggers=["run:created"],
            has_token=True,
        )
        await tokens.put("bench", cmd.config_id, TOKEN)
        await outbox.command(app, "bench", cmd)

    for i in range(0, len(urls), 100):
        await asyncio.gather(*(one(u) for u in urls[i : i + 100]))


async def _until(probe: Callable[[], Awaitable[bool]], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not await probe():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def latency(rate: float, seconds: float, workspaces: int = 20) -> dict[str, Any]:
    """Open loop: run i created at t0 + i / rate, on workspace i % workspaces; latency
    from the run's `run_created_at` (the App's clock, just before its append) to the
    receiver having its delivery."""
    policy = Policy(allow=frozenset({"loopback"}))
    async with private_server("notify-lat") as server, connected(server.url) as nc:
        store = EventStore(nc)
        app = App(store)
        async with Remote() as rx:
            await _org(app, store, TokenStore(nc, KEYS), [f"{rx.url}/hook"], workspaces)
            async with serving(nc, app, KEYS, policy=policy):
                n = int(rate * seconds)
                t0 = time.monotonic()
                cpu0 = time.process_time()

                async def create(i: int) -> None:
                    await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
                    await app.create_run("bench", f"ws-{i % workspaces}", "plan", "b")

                await asyncio.gather(*(create(i) for i in range(n)))
                await _until(lambda: _at_least(rx, "runs", n), 30)
                cpu = time.process_time() - cpu0
        lat = list(rx.stats["lag"])
        return {
            "rate": rate,
            "seconds": seconds,
            "events": n,
            "delivered": len(lat),
            "bad_signatures": rx.stats["bad"],
            "p50_ms": ms(percentile(lat, 50)),
            "p99_ms": ms(percentile(lat, 99)),
            "max_ms": ms(max(lat, default=0.0)),
            "cpu_s": round(cpu, 2),
        }


async def fanout(destinations: int, events: int) -> dict[str, Any]:
    policy = Policy(allow=frozenset({"loopback"}), timeout=10.0)
    async with private_server("notify-fan") as server, connected(server.url) as nc:
        store = EventStore(nc)
        app = App(store)
        async with Remote() as rx, Remote(hang=True) as hung:
            urls = [f"{rx.url}/d/{i}" for i in range(destinations)] + [f"{hung.url}/hang"]
            await _org(app, store, TokenStore(nc, KEYS), urls)
            async with serving(nc, app, KEYS, policy=policy):
                t0 = time.monotonic()
                cpu0 = time.process_time()
                for _ in range(events):
                    await app.create_run("bench", "ws-0", "plan", "b")
                want = destinations * events
                done = await _until(lambda: _at_least(rx, "count", want), 120)
                elapsed = rx.stats["last"] - t0
                cpu = time.process_time() - cpu0
                await hung.poll()
        count = rx.stats["count"]
        return {
            "destinations": destinations,
            "hanging_destinations": 1,
            "events": events,
            "deliveries": count,
            "distinct_ids": rx.stats["ids"],
            "bad_signatures": rx.stats["bad"],
            "complete": done,
            "seconds": round(elapsed, 3),
            "deliveries_per_s": round(count / elapsed, 1) if elapsed > 0 else None,
            "hanging_receiver_requests": hung.stats["requests"],
            "cpu_s": round(cpu, 2),
            "cpu_ms_per_delivery": round(1000 * cpu / max(count, 1), 3),
        }


async def _at_least(rx: Remote, key: str, n: int) -> bool:
    return bool((await rx.poll())[key] >= n)


def rows(lat: dict[str, Any], fan: dict[str, Any]) -> list[Result]:
    return [
        Result(
            name=f"notify latency p99 @ {lat['rate']:g}/s",
            figure=lat["p99_ms"],
            unit="ms",
            target="<= 1000 ms",
            passed=lat["p99_ms"] <= 1000 and lat["delivered"] == lat["events"],
            note=f"p50 {lat['p50_ms']} ms, {lat['delivered']}/{lat['events']} delivered",
        ),
        Result(
            name=f"notify fan-out to {fan['destinations']} (+1 hanging)",
            figure=fan["deliveries_per_s"],
            unit="deliveries/s",
            target=">= 500/s",
            passed=bool(fan["complete"]) and (fan["deliveries_per_s"] or 0) >= 500,
            note=f"{fan['deliveries']} in {fan['seconds']} s",
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.notifications", description=__doc__.split("\n")[0])
    p.add_argument("--rate", type=float, default=100.0)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--destinations", type=int, default=1000)
    p.add_argument("--events", type=int, default=3)
    p.add_argument("--receiver", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--hang", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.receiver:  # the receiver's own process (Remote)
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_serve_receiver(args.hang))
        return 0
    from bench.run import table
    from infra import logs

    logs.configure("console", "error")
    load = os.getloadavg()
    lat = asyncio.run(latency(args.rate, args.seconds))
    fan = asyncio.run(fanout(args.destinations, args.events))
    print(table(rows(lat, fan)))
    machine = {"cores": os.cpu_count(), "load_average_at_start": load}
    print(json.dumps({"latency": lat, "fanout": fan, "machine": machine}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
