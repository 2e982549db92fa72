"""Schedules on a 3-node NATS cluster (streams at R3): two schedule loops, each connected
to a node of its own (so their direct gets may be answered by followers), over a
simulated clock. Each minute fires exactly once; a schedule disabled through a third
node between two minutes is not fired by either loop, however its index lags; enabled
again, it fires from then on, never the minutes it was off."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from datetime import timedelta
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NATS

from events import run as R
from events import schedule as sc
from infra import streams
from services.processes.schedules import store
from services.processes.schedules.loop import ScheduleLoop, run_id_for
from tests.bootstrap_support import built
from tests.cluster_support import NatsCluster
from tests.schedule_support import Clock, fires_of, make_schedule, minute_at, runs_of


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[NatsCluster]:
    async with NatsCluster(tmp_path / "cluster", size=3) as c:
        yield c


async def _on(cluster: NatsCluster, i: int) -> NATS:
    """A connection to node `i` alone."""
    node = cluster.nodes[i]
    return await nats.connect(node.url, **cluster.auth.connect_options())


async def test_two_loops_on_two_nodes_fire_each_minute_once_and_never_a_disabled_schedule(
    cluster: NatsCluster, tmp_path: Path
) -> None:
    conns = [await _on(cluster, i) for i in range(3)]
    stack = AsyncExitStack()  # the planes are built, none of their parts started
    try:
        await streams.declare(conns[0], conns[0].jetstream(), replicas=3)
        clock = Clock()
        admin, *replicas = (built(c, stack, tmp_path, clock=clock).app for c in conns)
        await admin.create_org("acme", "alice")
        await admin.create_workspace("acme", "net", R.Workspace(repository="/x"), "alice")
        s = await make_schedule(admin, clock)
        loops = [ScheduleLoop(a, clock=clock) for a in replicas]

        async def minute(m: int) -> list[Any]:
            clock.now = minute_at(m) + timedelta(seconds=1)
            done = await asyncio.gather(*(lp.tick(clock.now) for lp in loops))
            return [e for d in done for e in d]

        def edit(**kw: Any) -> sc.SaveSchedule:
            return sc.SaveSchedule(
                actor="alice", schedule_id=s.id, org="acme", workspace="net", **kw
            )

        for m in range(1, 6):
            (fired,) = await minute(m)
            await admin.run_command("acme", "net", fired.run_id, R.CancelRun(actor="alice"))
        clock.now = minute_at(5) + timedelta(seconds=30)
        await store.command(admin, "acme", "net", edit(enabled=False))
        for lp in loops:  # indexes that never catch up: the leader's read decides
            lp.refresh = _stale  # type: ignore[method-assign]
        for m in range(6, 9):
            assert await minute(m) == []
        clock.now = minute_at(8) + timedelta(seconds=30)
        await store.command(admin, "acme", "net", edit(enabled=True))
        for lp in loops:
            del lp.refresh  # caught up again
        for m in range(9, 12):
            (fired,) = await minute(m)
            assert fired.missed == 0  # the minutes it was off are not counted, nor fired
            await admin.run_command("acme", "net", fired.run_id, R.CancelRun(actor="alice"))
        expected = [minute_at(m) for m in (*range(1, 6), *range(9, 12))]
        fires = await fires_of(admin, s.id)
        assert [f.fire_time for f in fires] == expected
        assert all(isinstance(f, sc.ScheduleFired) for f in fires)
        assert sorted(await runs_of(admin)) == sorted(run_id_for(s.id, t) for t in expected)
    finally:
        await stack.aclose()
        for c in conns:
            await c.close()


async def _stale() -> None:
    return None
