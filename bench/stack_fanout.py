"""Stack fan-out (issue 27): the time from a stack run's creation to every level-0 child
run `run.queued`, for a stack of N independent workspaces (all on level 0), with the
scheduler and the subscribers (the stack-run process in it) in their own processes, as
deployed. Also the time to every child created (`run.created`), and each process's CPU
per child over the span.

    .venv/bin/python -m bench.stack_fanout --workspaces 100 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from events import stacks as sk
from events.errors import DomainError
from events.run import CancelRun, Workspace
from events.stack_run_events import RUNNING, child_run_id
from infra.eventstore import LATEST
from services.app import stack_runs as runs_app
from services.app import stacks as stacks_app

from .common import connected, cpu_seconds, percentile, private_server
from .history import ORG, ws_name
from .rp import Watch, counted_app, gather_limited, make_repo, new_key, runplane_process

SUBS = "subscribers running"


async def fanout(workspaces: int, rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="rpbench-stack-") as tmp:
        repo = make_repo(Path(tmp))
        async with private_server("stacks") as server, connected(server.url) as nc:
            app = counted_app(nc)
            await app.create_org(ORG, "admin")
            names = [ws_name(i) for i in range(workspaces)]
            config = Workspace(repository=str(repo))
            await gather_limited(
                workspaces, 50, lambda i: app.create_workspace(ORG, names[i], config, "alice")
            )
            await stacks_app.create(app, ORG, "all", sk.Definition(workspaces=names), "alice")
            env = {"RUNPLANE_ENCRYPTION_KEY": new_key()}
            async with AsyncExitStack() as stack:
                pids = {"nats-server": server.pid or 0}
                for command, ready in (("scheduler", "scheduler running"), ("subscribers", SUBS)):
                    proc, _ = await stack.enter_async_context(
                        runplane_process(command, server.url, Path(tmp) / command, ready, env)
                    )
                    pids[command] = proc.pid
                await asyncio.sleep(1.0)  # the processes read the setup's history
                out = [await _round(nc, app, pids, workspaces) for _ in range(rounds)]
    queued = [r["all_queued_s"] for r in out]
    return {
        "workspaces": workspaces,
        "rounds": out,
        "all_queued_s_median": percentile(queued, 50),
        "machine_load": os.getloadavg(),
    }


async def _round(nc: Any, app: Any, pids: dict[str, int], n: int) -> dict[str, Any]:
    """One stack run (a plan of every node): every child queued; then every child
    canceled at once, until each end is recorded in the stack run (so that the next
    round's children are admitted at once too, and each round is measured alone)."""
    async with Watch(nc, "run.created") as created, Watch(nc, "run.queued") as queued:
        cpu = {k: cpu_seconds(p) for k, p in pids.items() if p}
        t = time.perf_counter()
        run = await runs_app.start(app, ORG, "all", runs_app.Start(run_type="plan"), "alice")
        ids = set(_child_ids(run.state.stack_run_id, n))
        ok_created = await created.until(n, ids, timeout=120)
        ok = await queued.until(n, ids, timeout=120)
        cpu = {k: cpu_seconds(pids[k]) - v for k, v in cpu.items()}
        made = max((created.seen[i] for i in ids if i in created.seen), default=t) - t
        done = max((queued.seen[i] for i in ids if i in queued.seen), default=t) - t
    sid = run.state.stack_run_id
    before = {k: cpu_seconds(p) for k, p in pids.items() if p}
    t = time.perf_counter()
    await gather_limited(n, 20, lambda i: _cancel(app, i, sid))
    ended = await _all_ended(app, sid)
    ends_s = time.perf_counter() - t
    ends_cpu = {k: cpu_seconds(pids[k]) - v for k, v in before.items()}
    return {
        "all_created": ok_created,
        "all_queued": ok,
        "all_created_s": made,
        "all_queued_s": done,
        "cpu_ms_per_child": {k: v * 1000 / n for k, v in cpu.items()},
        "all_ends_recorded": ended,
        "ends_recorded_s": ends_s,
        "cpu_ms_per_child_end": {k: v * 1000 / n for k, v in ends_cpu.items()},
    }


async def _all_ended(app: Any, sid: str, timeout: float = 120) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = (await runs_app.load(app, ORG, sid, min_seq=LATEST)).state
        if all(node.status != RUNNING for node in s.nodes.values()):
            return True
        await asyncio.sleep(0.1)
    return False


def _child_ids(stack_run_id: str, n: int) -> list[str]:
    return [child_run_id(stack_run_id, ws_name(i), 1) for i in range(n)]


async def _cancel(app: Any, i: int, stack_run_id: str) -> None:
    run_id = child_run_id(stack_run_id, ws_name(i), 1)
    try:
        await app.run_command(ORG, ws_name(i), run_id, CancelRun(actor="bench"))
    except DomainError:  # ended already: nothing to cancel
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workspaces", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    ns = p.parse_args()
    print(json.dumps(asyncio.run(fanout(ns.workspaces, ns.rounds)), indent=1))


if __name__ == "__main__":
    main()
