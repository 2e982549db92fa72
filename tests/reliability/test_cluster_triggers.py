"""Issue 14's run triggers on a 3-node NATS JetStream cluster of real processes while
kill -9 strikes (tests/cluster_support.py, tests/reliability/chaos_support.py; the
notifications tests of test_cluster.py are the model): an api, a scheduler and an
executor (real Terraform, the null provider) and two `runplane subscribers` replicas.

b follows a, and every apply of a changes something. The moment each apply of a ends
(its ending event is the one the run-triggers subscriber follows) a subscribers replica,
the node leading RP_EVENTS, or both are killed -9, then restarted: b has exactly one run
per apply of a (its derived id), caused by it, and the consumer is left holding nothing.
The summary (b's run after a's end, which replica handled, duplicates, runs lost) is
printed and written to `last_cluster_run_triggers.json` in the test's temporary directory.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import nats.errors
import pytest

from events import run as R
from events.run_events import RunCreated, RunEvent
from infra import replicas as rep
from infra.directget import InfraError
from infra.eventstore import LATEST, Envelope, EventStore
from infra.ids import derived_id
from infra.streams import EVENTS, subscriber_consumer
from services.processes.triggers import subscriber as run_triggers
from tests.cluster_support import NatsCluster
from tests.helpers import eventually
from tests.reliability.chaos_support import (
    ORG,
    TERMINAL,
    Api,
    ClusterNats,
    Component,
    Plane,
    Witness,
    _maybe,
    _subscribers,
    replicated,
    setup_org,
)
from tests.reliability.cluster_events_support import (
    kill_components,
    write_summary,
)

# b follows a. Every apply of a replaces its resource (tests/reliability/chaos_support.py's
# configuration: a timestamp trigger), so each changes something and starts one run of b.
# Faults, each struck the moment an apply of a ends (its ending event is the one the
# run-triggers subscriber follows): a `runplane subscribers` replica killed -9 (either
# of the two: which one holds the event is the broker's choice; the logs say) and, at
# the next apply's end, the node leading RP_EVENTS; each restarted.

RUN_EVENTS = get_args(RunEvent)


@dataclass
class TriggerScenario:
    # One apply of a per entry, each ending under its fault: "subscriber" (a replica),
    # "leader" (RP_EVENTS's node) or "both" at once.
    plan: list[str]
    down_s: float
    settle: float  # seconds for a's applies and b's runs once the faults are over


TRIGGERS_SHORT = TriggerScenario(plan=["both"], down_s=0.5, settle=120)
TRIGGERS_FULL = TriggerScenario(
    plan=["subscriber", "leader", "both"] * 2 + ["subscriber"], down_s=3.0, settle=300
)


@pytest.mark.slow
@pytest.mark.terraform
async def test_cluster_run_triggers_short(tmp_path: Path) -> None:
    await cluster_triggers(tmp_path, TRIGGERS_SHORT)


@pytest.mark.slow
@pytest.mark.terraform
@pytest.mark.timeout(1800)
async def test_cluster_run_triggers_full(tmp_path: Path) -> None:
    await cluster_triggers(tmp_path, TRIGGERS_FULL)


async def _events(store: EventStore, ws: str, run_id: str) -> list[Envelope]:
    """The run's events (by direct gets, any replica); [] while NATS does not answer."""
    try:
        return await store.read(f"rp.run.{ORG}.{ws}.{run_id}")
    except (InfraError, nats.errors.Error):
        return []


def _status(envs: list[Envelope]) -> str:
    events = [e.event for e in envs if isinstance(e.event, RUN_EVENTS)]
    return str(R.fold(events).status) if events else ""


async def _ended(store: EventStore, run_id: str, timeout: float) -> Envelope:
    """Poll a's run until it ends (every 10 ms: a fault strikes within moments of its
    ending event); that event. It must end applied."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        envs = await _events(store, "a", run_id)
        status = _status(envs)
        if status in TERMINAL:
            assert status == "applied", (run_id, status, [e.event for e in envs][-3:])
            return envs[-1]
        await asyncio.sleep(0.01)
    raise AssertionError(f"a's run {run_id} did not end in {timeout}s")


async def _strike(
    kind: str,
    subs: list[Component],
    nats_side: ClusterNats,
    rng: random.Random,
    down_s: float,
    end: Envelope,
) -> dict[str, Any]:
    """kill -9 what `kind` says the moment a's apply has ended; restart it after
    `down_s`; how long it was away and how long replication took to be whole again."""
    t_kill = time.monotonic()
    out: dict[str, Any] = {}
    victim = rng.choice(subs) if kind in ("subscriber", "both") else None
    kills: list[Awaitable[object]] = [victim.kill()] if victim else []
    kills += [nats_side.kill()] if kind in ("leader", "both") else []
    await asyncio.gather(*kills)
    out["after_end_s"] = round(time.time() - _at(end), 3)
    out["killed"] = [victim.role] if victim else []
    out["killed"] += nats_side.killed[-1:] if kind != "subscriber" else []
    await asyncio.sleep(down_s)
    if kind != "subscriber":
        await nats_side.start()
    if victim:
        await victim.start()
        await victim.ready()
    out["back_s"] = round(time.monotonic() - t_kill, 2)
    out["replication"] = await replicated(nats_side)
    return out


def _triggered(c: Component) -> list[dict[str, Any]]:
    """The run_triggered lines of a subscribers replica's whole log (every start)."""
    out = []
    for line in c.log.read_text(errors="replace").splitlines():
        if '"run_triggered"' in line:
            out.append(json.loads(line))
    return out


async def _consumer_settled(nats_side: ClusterNats) -> bool:
    """The run-triggers consumer holds nothing: none pending, none unacknowledged."""
    nc = await nats_side.connect()
    try:
        info = await rep.api(
            nc, f"$JS.API.CONSUMER.INFO.{EVENTS}.{subscriber_consumer(run_triggers.NAME)}"
        )
    finally:
        await nc.close()
    return info.get("num_pending") == 0 and info.get("num_ack_pending") == 0


async def cluster_triggers(tmp_path: Path, sc: TriggerScenario) -> None:
    started = time.monotonic()
    nats_side = ClusterNats(NatsCluster(tmp_path / "cluster", size=3))
    plane = await Plane.start(tmp_path / "plane", nats_side, count=1)
    subs = _subscribers(tmp_path / "plane", nats_side)
    for s in subs:
        await s.start()
    for s in subs:
        await s.ready()
    api = Api(plane.bases)
    nc = await nats_side.connect()
    store = EventStore(nc)
    rng = random.Random()
    summary: dict[str, Any] = {"startup_s": round(time.monotonic() - started, 1)}
    witness = await Witness().start()  # the applies report to it (not counted here)
    try:
        await setup_org(api, tmp_path, ["a", "b"], {}, witness)
        await api.ok(
            "PATCH", f"/api/v1/orgs/{ORG}/workspaces/a/settings", {"require_approval": False}
        )
        await api.ok("POST", f"/api/v1/orgs/{ORG}/workspaces/b/run-triggers", {"source": "a"})
        # Every apply of a at once: a's queue runs them one after the other.
        a_runs = []
        for _ in sc.plan:
            made = await api.ok("POST", f"/api/v1/orgs/{ORG}/workspaces/a/runs", {"type": "apply"})
            a_runs.append(str(made["id"]))
        faults: list[dict[str, Any]] = []
        for kind, run_id in zip(sc.plan, a_runs, strict=True):
            end = await _ended(store, run_id, sc.settle)
            fault = await _strike(kind, subs, nats_side, rng, sc.down_s, end)
            faults.append({"kind": kind, "a_run": run_id, "event": end.seq} | fault)

        want = {derived_id("run-trigger", a, "b"): a for a in a_runs}

        async def b_has_all() -> bool:
            try:
                envs = await store.read(f"rp.run.{ORG}.b.>")
            except (InfraError, nats.errors.Error):
                return False
            return set(want) <= {e.subject.rsplit(".", 1)[1] for e in envs}

        await _maybe(eventually(b_has_all, timeout=sc.settle, interval=0.2, what="b's runs"))
        settled = await _maybe(
            eventually(lambda: _consumer_settled(nats_side), timeout=60, what="the consumer")
        )
        b_envs = await store.read(f"rp.run.{ORG}.b.>", min_seq=LATEST)
        a_ends = {a: await _ended(store, a, 10) for a in a_runs}
        created = [(e, e.event) for e in b_envs if isinstance(e.event, RunCreated)]
        # a duplicate: a second run of b for one run of a, whatever its id
        per_run = Counter(r.cause.source_run if r.cause else "" for _, r in created)
        got = {r.run_id: (e, r) for e, r in created}
        handled = {s.role: _triggered(s) for s in subs}
        for f in faults:
            b_run = got.get(derived_id("run-trigger", f["a_run"], "b"))
            a_end = a_ends[f["a_run"]]
            f["b_run_after_a_end_s"] = b_run and round(_at(b_run[0]) - _at(a_end), 2)
            f["handled_by"] = sorted(
                (role, bool(line["existed"]))
                for role, lines in handled.items()
                for line in lines
                if line["source_run"] == f["a_run"]
            )
            f["replication"] = f["replication"]["after_s"]
        summary |= {
            "a_applies": len(a_runs),
            "b_runs": len(created),
            "duplicates": sum(n - 1 for n in per_run.values()),
            "runs_lost": len(set(want) - set(got)),
            "runs_unexpected": len(set(got) - set(want)),
            "consumer_settled": settled,
            "faults": faults,
            "total_s": round(time.monotonic() - started, 1),
        }
        write_summary(tmp_path, "run_triggers", summary)

        assert [s.role for s in subs if s.returncode() is not None] == []
        assert summary["duplicates"] == 0, per_run
        assert set(got) == set(want), (set(want) - set(got), set(got) - set(want))
        for run_id, (_, run) in got.items():  # each caused by its a run, none otherwise
            cause = run.cause
            assert cause is not None and cause.kind == "run_trigger", (run_id, cause)
            assert (cause.source_workspace, cause.source_run) == ("a", want[run_id])
        assert settled, "the run-triggers consumer still holds events"
        assert [f for f in faults if f["back_s"] is None] == []
    finally:
        witness.close()
        await nc.close()
        await api.close()
        await kill_components(subs)
        await plane.kill_all()


def _at(env: Envelope) -> float:
    assert env.time is not None
    return env.time.timestamp()
