"""notifications: event to delivery latency, and fan-out with one destination hanging.

Each part starts its own nats-server (`private_server`) and runs the notifications
subscriber (`services/notifications/subscriber.py`: configurations read from the log,
each delivery scheduled in the log, sent on its destination's lane, its attempt
recorded) fed by a consumer of `rp.run.>`, with real local HTTP receivers that check
the signatures:

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
import json
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "bench"

import msgspec
from aiohttp import web
from nats.aio.client import Client as NATS
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from bench.common import Result, connected, ms, percentile, private_server
from events import notification as nt
from events import run as R
from events.codec import decode
from services.commands import App
from services.infra.eventstore import EventStore
from services.notifications import outbox, signing
from services.notifications.delivery import Dispatcher, Policy
from services.notifications.subscriber import Notifier

TOKEN = "bench-notify-token"


class Receiver:
    """Counts deliveries (checking both signatures) and notes when each run's came."""

    def __init__(self, *, hang: bool = False) -> None:
        self.hang = hang
        self.first: dict[str, float] = {}  # run id: arrival (monotonic) of its first
        self.count = 0
        self.bad = 0
        self.ids: set[str] = set()
        self.last = 0.0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
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
        run_id = msgspec.json.decode(body)["run_id"]
        self.first.setdefault(run_id, now)
        self.last = now
        return web.Response(text="ok")

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[Receiver]:
        app = web.Application()
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


@asynccontextmanager
async def subscriber(nc: NATS, store: EventStore, policy: Policy) -> AsyncIterator[Notifier]:
    """The notifications subscriber on a durable pull consumer of rp.run.> (one lane per
    run, acked once its deliveries are in the log), and its recovery at start."""

    async def token_of(org: str, config_id: str) -> str:
        return TOKEN

    async with Dispatcher(policy, token_of, outbox.recorder(store)) as dispatcher:
        notifier = Notifier(store, dispatcher)
        js = nc.jetstream()
        config = ConsumerConfig(
            durable_name="rp-sub-notifications",
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.NEW,
            max_ack_pending=10_000,
            ack_wait=30,
        )
        psub = await js.pull_subscribe("rp.run.>", durable="rp-sub-notifications", config=config)

        async def loop() -> None:
            while True:
                try:
                    msgs = await psub.fetch(256, timeout=1)
                except TimeoutError:
                    continue
                await asyncio.gather(*(one(m) for m in msgs))

        async def one(m: Any) -> None:
            await notifier.on_event(m.metadata.sequence.stream, m.subject, decode(m.data), None)
            await m.ack()

        task = asyncio.create_task(loop())
        try:
            yield notifier
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _org(app: App, store: EventStore, urls: list[str], timeout: float = 10) -> None:
    await app.create_org("bench", "b")
    await app.create_workspace("bench", "net", R.Workspace(repository="/nowhere"), "b")

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
        await outbox.command(store, "bench", cmd, clock=app.clock, new_id=app.ids)

    for i in range(0, len(urls), 100):
        await asyncio.gather(*(one(u) for u in urls[i : i + 100]))


async def _until(probe: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def latency(rate: float, seconds: float) -> dict[str, Any]:
    policy = Policy(allow=frozenset({"loopback"}))
    async with private_server("notify-lat") as server, connected(server.url) as nc:
        store = EventStore(nc)
        app = App(store)
        rx = Receiver()
        async with rx.serving():
            await _org(app, store, [f"{rx.url}/hook"])
            async with subscriber(nc, store, policy):
                sent: dict[str, float] = {}
                n = int(rate * seconds)
                t0 = time.monotonic()

                async def create(i: int) -> None:
                    await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
                    r = await app.create_run("bench", "net", "plan", "b")
                    sent[r.state.run_id] = time.monotonic()

                await asyncio.gather(*(create(i) for i in range(n)))
                await _until(lambda: len(rx.first) >= n, 30)
        lat = [rx.first[k] - v for k, v in sent.items() if k in rx.first]
        return {
            "rate": rate,
            "seconds": seconds,
            "events": n,
            "delivered": len(lat),
            "bad_signatures": rx.bad,
            "p50_ms": ms(percentile(lat, 50)),
            "p99_ms": ms(percentile(lat, 99)),
            "max_ms": ms(max(lat, default=0.0)),
        }


async def fanout(destinations: int, events: int) -> dict[str, Any]:
    policy = Policy(allow=frozenset({"loopback"}), timeout=10.0)
    async with private_server("notify-fan") as server, connected(server.url) as nc:
        store = EventStore(nc)
        app = App(store)
        rx, hung = Receiver(), Receiver(hang=True)
        async with rx.serving(), hung.serving():
            urls = [f"{rx.url}/d/{i}" for i in range(destinations)] + [f"{hung.url}/hang"]
            await _org(app, store, urls)
            async with subscriber(nc, store, policy) as notifier:
                t0 = time.monotonic()
                for _ in range(events):
                    await app.create_run("bench", "net", "plan", "b")
                want = destinations * events
                done = await _until(lambda: rx.count >= want, 120)
                elapsed = rx.last - t0
                hung_attempts = notifier.dispatcher.sent - rx.count
        return {
            "destinations": destinations,
            "hanging_destinations": 1,
            "events": events,
            "deliveries": rx.count,
            "distinct_ids": len(rx.ids),
            "bad_signatures": rx.bad,
            "complete": done,
            "seconds": round(elapsed, 3),
            "deliveries_per_s": round(rx.count / elapsed, 1) if elapsed > 0 else None,
            "attempts_to_the_hanging_one": hung_attempts,
        }


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
    args = p.parse_args(argv)
    from bench.run import table
    from services import logs

    logs.configure("console", "error")
    lat = asyncio.run(latency(args.rate, args.seconds))
    fan = asyncio.run(fanout(args.destinations, args.events))
    print(table(rows(lat, fan)))
    print(json.dumps({"latency": lat, "fanout": fan}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
