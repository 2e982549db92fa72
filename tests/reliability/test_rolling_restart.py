"""A rolling restart of every process, one at a time, with runs in flight: none fails
(issue 26, item 4: "no run lost to an upgrade").

The cluster suite's deployment (tests/reliability/chaos_support.py): three nats-servers,
two `runplane api`, two `runplane scheduler`, two `runplane executor`, two `runplane
subscribers` notifying a local receiver, real Terraform. A driver keeps apply runs
coming through both apis and approves them. Each NATS node, then each process, is
stopped with SIGTERM as `systemctl restart` does (an executor while a run plans or
applies on it, when one does), waited for to exit 0, started again and waited for
ready; then the next. Afterwards every run is `applied` and every notification
delivered once: an executor's SIGTERM gives its plan back to the pool
(`run.phase_released`) and lets its apply finish (before the drain, the same test failed
4 runs of 14 `executor_stopped`)."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.cluster_support import NatsCluster
from tests.helpers import eventually
from tests.notify_support import Receiver
from tests.reliability.chaos_support import (
    NOTIFY_ENV,
    ORG,
    Api,
    ClusterNats,
    Component,
    Plane,
    Witness,
    Workload,
    _subscribers,
    applies_from_terraform,
    settle,
    setup_org,
)

pytestmark = pytest.mark.terraform

RUNS = 10
TOKEN = "rolling-notify-token-1d2c3b"


async def _in_flight(api: Api, timeout: float = 20) -> str:
    """A run planning or applying (waited for up to `timeout`), or ""."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = await api.all_runs(["planning", "applying"])
        if runs:
            return str(runs[0]["id"])
        await asyncio.sleep(0.1)
    return ""


async def _restart(c: Component, api: Api, log: list[str]) -> None:
    """SIGTERM, exit 0, start, ready: `systemctl restart` of its unit."""
    run_id = await _in_flight(api) if c.role.startswith("executor") else ""
    busy = bool(run_id) and c.works_on(run_id)
    began = time.monotonic()
    code = await c.stop(timeout=300)
    stopped = time.monotonic() - began
    assert code == 0, f"{c.role} exited {code}: {c.output()[-3000:]}"
    await c.start()
    await c.ready()
    on = f" (working on {run_id})" if busy else ""
    log.append(f"{c.role}: stopped in {stopped:.1f} s{on}")


@pytest.mark.slow
@pytest.mark.timeout(1200)
async def test_a_rolling_restart_of_every_process_with_runs_in_flight_fails_no_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every run applied, none twice; the subscribers, restarted too, lose no
    notification: every run's `run:created` and `run:completed` reach the receiver, each
    under one delivery id."""
    for k, v in NOTIFY_ENV.items():  # the api's guard judges the receiver's URL too
        monkeypatch.setenv(k, v)
    rng = random.Random(26)
    nats_side = ClusterNats(NatsCluster(tmp_path / "cluster", size=3))
    plane = await Plane.start(tmp_path / "plane", nats_side, count=2)
    subs = _subscribers(tmp_path / "plane", nats_side)
    for sub in subs:
        await sub.start()
    for sub in subs:
        await sub.ready()
    api = Api(plane.bases)
    witness = await Witness().start()
    receiver = await Receiver(token=TOKEN, delay=0.2).__aenter__()
    log: list[str] = []
    try:
        workspaces = ["ws0", "ws1", "ws2"]
        await setup_org(api, tmp_path, workspaces, {}, witness)
        triggers = ["run:created", "run:completed", "run:errored"]
        body = {"name": "rolling", "url": receiver.url, "token": TOKEN, "triggers": triggers}
        await api.ok("POST", f"/api/v1/orgs/{ORG}/notifications", body)
        work = Workload(api, workspaces, RUNS, rng)
        stop = asyncio.Event()
        background = [
            asyncio.create_task(work.creator()),
            asyncio.create_task(work.approver(stop)),
        ]
        await _in_flight(api, 60)
        for node in nats_side.cluster.nodes:
            await node.stop()
            await node.start()
            await nats_side.cluster.wait_ready()
            log.append(f"nats {node.name}: restarted")
            await asyncio.sleep(1)
        for c in (*plane.executors, *plane.schedulers, *plane.apis, *subs, *plane.executors):
            await _restart(c, api, log)
            await asyncio.sleep(1)
        work.faults_done.set()
        await asyncio.wait_for(work.done.wait(), 300)
        left = await settle(api, plane, 300)
        stop.set()
        await asyncio.gather(*background)
        runs = await api.ok_runs()
        print("\nrolling restart:", *log, sep="\n  ", flush=True)
        statuses = Counter(r["status"] for r in runs)
        print("runs:", dict(statuses), flush=True)
        assert left == [], left
        assert not plane.crashes, plane.crashes
        assert len(runs) >= RUNS
        failed = {r["id"]: (r["status"], r.get("reason")) for r in runs if r["status"] != "applied"}
        assert not failed, f"runs not applied: {failed}"
        applied = applies_from_terraform(witness)
        assert all(n == 1 for n in applied.values()), f"applied twice: {applied}"
        released = 0
        for r in runs:
            page = await api.ok("GET", f"/api/v1/orgs/{ORG}/runs/{r['id']}/events")
            released += sum(e["type"] == "run.phase_released" for e in page["items"])
        print("phases given back:", released, flush=True)
        want = {(r["id"], t) for r in runs for t in ("run:created", "run:completed")}
        got: dict[tuple[str, str], set[str]] = {}

        async def every_delivery() -> bool:
            got.clear()
            for g in receiver.got:
                key = (g.json["run_id"], g.json["notifications"][0]["trigger"])
                got.setdefault(key, set()).add(g.delivery)
            assert set(got) == want, sorted(set(got) ^ want)
            return True

        await eventually(every_delivery, timeout=120, interval=0.2, what="every notification")
        assert all(len(ids) == 1 for ids in got.values()), got
    finally:
        await receiver.__aexit__(None, None, None)
        for sub in subs:
            if sub.proc and sub.returncode() is None:
                await sub.kill()
        witness.close()
        await api.close()
        await plane.kill_all()
