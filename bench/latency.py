"""4. latency: the time from a create request to its run's `run.queued`, with the
subscribers process (and the auditor in it) running beside the scheduler, as deployed,
and without it, back to back: the difference is what the audit log and the other
subscribers cost the create path (issue 25's figure).

Open loop: creates on a fixed clock at `latency_rate` per second, each on its own
workspace; the scheduler in its own process with its real admission snapshot (`git
ls-remote` of a local repository). Before the clock starts, every process has read the
setup's history (the workspaces' creation): the auditor has recorded it, so what is
measured is the steady state, not a start's catching up. CPU per create of each process
is taken over the measured span (the auditor's recording of the creates included).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS

from events.run import Workspace
from infra import streams

from .common import Sizes, connected, cpu_seconds, last_seq, percentile, private_server
from .history import ORG, ws_name
from .rp import Watch, counted_app, gather_limited, make_repo, new_key, runplane_process

SUBS = "subscribers running"
APPLY = "apply"


async def latency(sizes: Sizes) -> dict[str, Any]:
    """As deployed (the headline), then without the subscribers process; `RP_BENCH_LATENCY`
    `=with` or `=without` measures one of them alone."""
    only = os.environ.get("RP_BENCH_LATENCY", "")
    if only == "without":
        return await create_to_queued(sizes, subscribers=False)
    out = await create_to_queued(sizes, subscribers=True)
    if only != "with":
        alone = await create_to_queued(sizes, subscribers=False)
        out["without_subscribers"] = alone
        out["subscribers_cost_p50_ms"] = out["p50_ms"] - alone["p50_ms"]
        out["subscribers_cost_p99_ms"] = out["p99_ms"] - alone["p99_ms"]
    return out


async def create_to_queued(sizes: Sizes, *, subscribers: bool) -> dict[str, Any]:
    """One open-loop run of creates; see the module's docstring."""
    n = max(2, int(sizes.latency_rate * sizes.latency_seconds))
    with tempfile.TemporaryDirectory(prefix="rpbench-lat-") as tmp:
        repo = make_repo(Path(tmp))
        async with private_server("latency") as server, connected(server.url) as nc:
            app = counted_app(nc)
            await app.create_org(ORG, "admin")
            config = Workspace(repository=str(repo))
            await gather_limited(
                n, 50, lambda i: app.create_workspace(ORG, ws_name(i), config, "alice")
            )
            setup_records = n + 1  # the organization's and each workspace's creation
            env = {"RUNPLANE_ENCRYPTION_KEY": new_key()}
            async with AsyncExitStack() as stack:
                pids = {"nats-server": server.pid or 0, "bench": os.getpid()}
                sched, _ = await stack.enter_async_context(
                    runplane_process(
                        "scheduler", server.url, Path(tmp) / "sched", "scheduler running", env
                    )
                )
                pids["scheduler"] = sched.pid
                if subscribers:
                    subs, _ = await stack.enter_async_context(
                        runplane_process("subscribers", server.url, Path(tmp) / "subs", SUBS, env)
                    )
                    pids["subscribers"] = subs.pid
                watch = await stack.enter_async_context(Watch(nc, "run.queued"))
                pins = await stack.enter_async_context(Watch(nc, "run.pinned"))
                t = time.perf_counter()
                await asyncio.sleep(1.0)  # the scheduler reads the workspaces' history
                if subscribers:  # and the auditor records it
                    await audit_records(nc, setup_records, timeout=120)
                catch_up_s = time.perf_counter() - t
                cpu = {k: cpu_seconds(p) for k, p in pids.items() if p}
                starts, create_lat = await open_loop(
                    n, sizes.latency_rate, lambda i: app.create_run(ORG, ws_name(i), APPLY, "alice")
                )
                ok = await watch.until(n, set(starts), timeout=60)
                await pins.until(n, set(starts), timeout=60)
                audited = await audit_records(nc, setup_records + n) if subscribers else 0
                cpu = {k: cpu_seconds(pids[k]) - v for k, v in cpu.items()}
            lat = [watch.seen[r] - t for r, t in starts.items() if r in watch.seen]
            pin = [pins.seen[r] - t for r, t in starts.items() if r in pins.seen]
    return {
        "subscribers": subscribers,
        "runs": n,
        "rate_per_s": sizes.latency_rate,
        "queued": len(lat),
        "all_queued": ok,
        "p50_ms": percentile(lat, 50) * 1000,
        "p99_ms": percentile(lat, 99) * 1000,
        "max_ms": max(lat, default=0.0) * 1000,
        "pinned_p50_ms": percentile(pin, 50) * 1000,
        "pinned_p99_ms": percentile(pin, 99) * 1000,
        "create_call_p50_ms": percentile(create_lat, 50) * 1000,
        "create_call_p99_ms": percentile(create_lat, 99) * 1000,
        # each process's CPU per create over the span (the auditor's records included)
        "cpu_ms_per_create": {k: v * 1000 / n for k, v in cpu.items()},
        "audit_stream_messages": audited,
        # from the processes' start to the auditor's recording of the setup (>= 1 s):
        # what the creates once met when they began a second after the start
        "catch_up_s": catch_up_s,  # records (setup's and creates') and checkpoints
    }


async def open_loop(
    n: int, rate: float, create: Callable[[int], Awaitable[Any]]
) -> tuple[dict[str, float], list[float]]:
    """Create i at t0 + i / rate whatever the answers: each run's start, and each call's time."""
    starts: dict[str, float] = {}
    create_lat: list[float] = []
    loop = asyncio.get_running_loop()
    t0 = loop.time() + 0.1

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, t0 + i / rate - loop.time()))
        t = time.perf_counter()
        r = await create(i)
        create_lat.append(time.perf_counter() - t)
        starts[str(r.state.run_id)] = t

    await asyncio.gather(*(one(i) for i in range(n)))
    return starts, create_lat


async def audit_records(nc: NATS, records: int, timeout: float = 30) -> int:
    """The audit stream's records once it holds `records` at least (or the time is up);
    checkpoints count too, so this waits for the records, not for their signing."""
    deadline = time.monotonic() + timeout
    while True:
        last = await last_seq(nc, streams.AUDIT)
        if last >= records or time.monotonic() > deadline:
            return last
        await asyncio.sleep(0.05)
