"""Issue 14's schedules on a 3-node NATS JetStream cluster (streams at R3) while kill -9
strikes: two scheduler replicas on different nodes, a schedule every minute; each
minute fires once, whatever dies mid-decision.

The fire time comes from the clock, and a `runplane scheduler` process reads the real
one (there is no way to give several processes one simulated clock), so the replicas
here are what a scheduler process runs, `ScheduleLoop`s over an `App` each, in this
process, each on its own connection whose first server is a node of its own (node 2
and node 3; the admin's on all). The claim is decided there: the run id derived from
the schedule and the fire time (`create_run` of a time made before finds it) and the
fire recorded by an append checked against the fire state it read. Both replicas tick
each simulated minute at once; at some minutes the node leading RP_EVENTS is killed -9
a few milliseconds into the ticks (and restarted after `down_s`), at others one replica
is killed at a random point of its tick (its task cancelled wherever it is, its
connection dropped, a new replica started on the same node with nothing remembered).
Each replica ticks again, as its loop would, until the minute is recorded; each fired
run is canceled so the next minute fires rather than waits.

Afterwards, read from the leader: one record per minute, in order, each a fire; one
run per minute under its derived id and no other; none created twice. The summary
(ticks and seconds to record each faulted minute, records per replica, duplicates,
runs lost) is printed and written to `last_cluster_schedules.json`.

(tests/test_schedules_cluster.py holds the same claim on a whole cluster without
faults, and tests/test_schedules_procs.py two real scheduler processes on the real
clock, one killed -9, on one server.)
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NATS

from events import run as R
from events import schedule as sc
from events.run_events import RunCreated
from infra import streams
from infra.eventstore import LATEST
from infra.streams import EVENTS
from services.app.commands import App
from services.processes.schedules.loop import ScheduleLoop, run_id_for
from tests.bootstrap_support import built
from tests.cluster_support import NatsCluster
from tests.reliability.chaos_support import ClusterNats, replicated
from tests.reliability.cluster_events_support import write_summary
from tests.schedule_support import Clock, make_schedule, minute_at

RECORDS = (sc.ScheduleFired, sc.ScheduleSkipped)
RECORD_WAIT_S = 90.0  # the longest a minute may take to be recorded, a fault in it


@dataclass
class ScheduleScenario:
    minutes: int
    leader_kills: set[int]  # minutes whose ticks the RP_EVENTS leader's node dies in
    replica_kills: set[int]  # minutes whose ticks a replica dies in
    down_s: float


SCHEDULES_SHORT = ScheduleScenario(minutes=6, leader_kills={2}, replica_kills={4}, down_s=0.5)
SCHEDULES_FULL = ScheduleScenario(
    minutes=30, leader_kills={3, 11, 19, 27}, replica_kills={6, 11, 15, 23, 24}, down_s=3.0
)


@pytest.mark.slow
async def test_cluster_schedules_short(tmp_path: Path) -> None:
    await cluster_schedules(tmp_path, SCHEDULES_SHORT)


@pytest.mark.slow
@pytest.mark.timeout(1200)
async def test_cluster_schedules_full(tmp_path: Path) -> None:
    await cluster_schedules(tmp_path, SCHEDULES_FULL)


@dataclass
class Replica:
    """A scheduler replica: its connection (its node first), App and loop."""

    name: str
    node: int
    nc: NATS
    loop: ScheduleLoop
    recorded: list[Any] = field(default_factory=list)  # what its ticks recorded


async def _connect(cluster: NatsCluster, first: int) -> NATS:
    urls = [cluster.nodes[first].url] + [n.url for i, n in enumerate(cluster.nodes) if i != first]
    return await nats.connect(
        servers=urls,
        dont_randomize=True,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.2,
        **cluster.auth.connect_options(),
    )


async def _replica(cluster: NatsCluster, name: str, node: int, clock: Clock, root: Path) -> Replica:
    """A scheduler replica on `node`: its graph, of which the test ticks the schedules'
    loop by hand (nothing started)."""
    nc = await _connect(cluster, node)
    return Replica(name, node, nc, built(nc, AsyncExitStack(), root, clock=clock).schedule_loop())


async def _tick(r: Replica, now: Any) -> None:
    """One tick, as the loop's task runs it: a failure is the next tick's to retry."""
    try:
        r.recorded += await r.loop.tick(now)
    except Exception:  # noqa: BLE001 - NATS away mid-tick: the loop ticks again
        pass


async def _record_of(admin: App, sid: str, m: int) -> Any:
    """The minute's record, as the stream's leader has it (None: none yet)."""
    try:
        envs = await admin.store.read(sc.fires_subject("acme", "net", sid), min_seq=LATEST)
    except Exception:  # noqa: BLE001 - NATS away: not yet
        return None
    records = [e.event for e in envs if isinstance(e.event, RECORDS)]
    return next((r for r in records if r.fire_time == minute_at(m)), None)


async def _cancel(admin: App, run_id: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            await admin.run_command("acme", "net", run_id, R.CancelRun(actor="alice"))
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def cluster_schedules(tmp_path: Path, sc_: ScheduleScenario) -> None:
    started = time.monotonic()
    rng = random.Random()
    async with NatsCluster(tmp_path / "cluster", size=3) as cluster:
        admin_nc = await cluster.connect()
        replicas: list[Replica] = []
        try:
            await streams.declare(admin_nc, admin_nc.jetstream(), replicas=3)
            clock = Clock()
            admin = built(admin_nc, AsyncExitStack(), tmp_path, clock=clock).app
            await admin.create_org("acme", "alice")
            await admin.create_workspace("acme", "net", R.Workspace(repository="/x"), "alice")
            s = await make_schedule(admin, clock)
            replicas = [await _replica(cluster, f"sched{i}", i, clock, tmp_path) for i in (1, 2)]
            faulted = []
            for m in range(1, sc_.minutes + 1):
                row = await _minute(cluster, admin, replicas, s.id, m, sc_, rng, clock, tmp_path)
                if row["faults"]:
                    faulted.append(row)
                record = await _record_of(admin, s.id, m)
                if isinstance(record, sc.ScheduleFired):
                    await _cancel(admin, record.run_id)
            recorded = await admin.store.read(sc.fires_subject("acme", "net", s.id), min_seq=LATEST)
            fires = [e.event for e in recorded if isinstance(e.event, RECORDS)]
            envs = await admin.store.read("rp.run.acme.net.*", min_seq=LATEST)
        finally:
            for r in replicas:
                await r.nc.close()
            await admin_nc.close()
    made = [e.event for e in envs if isinstance(e.event, RunCreated)]
    created = Counter(r.run_id for r in made)
    # a duplicate: a second run for one fire time, whatever its id
    per_time = Counter(r.cause.fire_time if r.cause else None for r in made)
    minutes = [minute_at(m) for m in range(1, sc_.minutes + 1)]
    want = {run_id_for(s.id, t) for t in minutes}
    summary = {
        "minutes": sc_.minutes,
        "records": len(fires),
        "fires": sum(isinstance(f, sc.ScheduleFired) for f in fires),
        "runs": len(created),
        "duplicates": sum(n - 1 for n in per_time.values()),
        "runs_lost": len(want - set(created)),
        "runs_unexpected": len(set(created) - want),
        "recorded_by": {r.name: len(r.recorded) for r in replicas},
        "faulted_minutes": faulted,
        "total_s": round(time.monotonic() - started, 1),
    }
    write_summary(tmp_path, "schedules", summary)

    assert [f.fire_time for f in fires] == minutes  # each minute once, in order
    assert all(isinstance(f, sc.ScheduleFired) for f in fires), fires
    assert [f.run_id for f in fires] == [run_id_for(s.id, t) for t in minutes]  # type: ignore[union-attr]
    assert summary["duplicates"] == 0, per_time
    assert set(created) == want, (want - set(created), set(created) - want)


async def _minute(
    cluster: NatsCluster,
    admin: App,
    replicas: list[Replica],
    sid: str,
    m: int,
    sc_: ScheduleScenario,
    rng: random.Random,
    clock: Clock,
    root: Path,
) -> dict[str, Any]:
    """Both replicas tick minute `m` at once, the minute's faults striking a few ms in;
    each ticks again (a second later, within the minute) until the minute is recorded."""
    t0 = time.monotonic()
    now = minute_at(m) + timedelta(seconds=1)
    clock.now = now
    ticks = [asyncio.create_task(_tick(r, now)) for r in replicas]
    faults: list[str] = []
    if m in sc_.replica_kills:
        i = rng.randrange(len(replicas))
        await asyncio.sleep(rng.uniform(0, 0.04))
        ticks[i].cancel()  # killed wherever its tick is
        old = replicas[i]
        await old.nc.close()
        replicas[i] = await _replica(cluster, old.name, old.node, clock, root)
        replicas[i].recorded = old.recorded
        faults.append(f"{old.name} killed")
    if m in sc_.leader_kills:
        await asyncio.sleep(rng.uniform(0, 0.03))
        leader = await cluster.stream_leader(EVENTS)
        await leader.kill()
        faults.append(f"{leader.name} (leader) killed")
        await asyncio.sleep(sc_.down_s)
        await leader.start()
        await cluster.wait_ready()
    rounds = 1
    while True:
        await asyncio.gather(*ticks, return_exceptions=True)
        if await _record_of(admin, sid, m) is not None:
            break
        assert time.monotonic() - t0 < RECORD_WAIT_S, f"minute {m} not recorded"
        await asyncio.sleep(0.05)  # the loop's shortest pause between ticks
        now = min(now + timedelta(seconds=1), minute_at(m) + timedelta(seconds=50))
        clock.now = now
        ticks = [asyncio.create_task(_tick(r, now)) for r in replicas]
        rounds += 1
    row: dict[str, Any] = {"minute": m, "faults": faults, "ticks": rounds}
    row["recorded_s"] = round(time.monotonic() - t0, 2)
    if any("leader" in f for f in faults):
        row["replication_s"] = (await replicated(ClusterNats(cluster)))["after_s"]
    return row
