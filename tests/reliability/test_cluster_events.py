"""Issue 14's new ways to start a run, on a 3-node NATS JetStream cluster of real
processes while kill -9 strikes (tests/cluster_support.py, tests/reliability/
chaos_support.py; the notifications tests of test_cluster.py are the model).

`test_cluster_webhooks_*`: two `runplane api` processes, each talking to a node of its
own, are sent every GitHub push delivery at once, each redelivered until it answers 200
(as GitHub's "Redeliver" or a retrying proxy would), while the node leading `RP_EVENTS`
is killed -9 and restarted; afterwards every delivery once more to both. Every matching
workspace has exactly one run per delivery under its derived id, the others none; each
delivery is recorded once, naming them all; no answer but 200, 503 or none (a fault's),
and a 503 only within seconds of the node's return; both read models hold the stream's
runs.

The summary of each test (figures: recovery times, duplicates, runs lost) is printed
and written to `last_cluster_<name>.json` in its temporary directory.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats.errors
import pytest

from events import run as R
from events import vcs
from events.run_events import RunCreated
from services.commands import derived_id
from services.infra import replicas as rep
from services.infra.directget import InfraError
from services.infra.eventstore import LATEST, Envelope, EventStore
from services.infra.streams import EVENTS, subscriber_consumer
from services.triggers import subscriber as run_triggers
from tests.cluster_support import NatsCluster
from tests.helpers import eventually
from tests.reliability.chaos_support import (
    ORG,
    TERMINAL,
    Api,
    ClusterNats,
    Component,
    Plane,
    setup_org,
)
from tests.reliability.cluster_events_support import (
    Hooks,
    Sent,
    apis_on_distinct_nodes,
    push_body,
    sha,
)
from tests.reliability.test_cluster import AFTER_FAULT_503_S, _maybe, _subscribers, replicated
from tests.test_vcs_support import SECRET

REPO = "https://github.com/acme/net.git"
# Workspaces on acme/net's master: a push changing net/main.tf starts net's and edge's
# runs (their directory), not db's.
WORKSPACES = {"net": "net", "edge": "net", "db": "db"}
MATCHING = ("edge", "net")
CHANGED = ["net/main.tf"]


def _summary(tmp_path: Path, name: str, summary: dict[str, Any]) -> None:
    out = tmp_path / f"last_cluster_{name}.json"
    out.write_text(json.dumps(summary, indent=2))
    print(f"cluster {name}:", json.dumps(summary), flush=True)


async def _kill_leader(nats_side: ClusterNats, down_s: float) -> dict[str, Any]:
    """kill -9 the node leading RP_EVENTS; restart it after `down_s` on its store."""
    t_kill = time.monotonic()
    await nats_side.kill()
    await asyncio.sleep(down_s)
    await nats_side.start()
    return {
        "killed": nats_side.killed[-1],
        "t_kill": t_kill,
        "t_back": time.monotonic(),
        "back_s": round(time.monotonic() - t_kill, 2),
    }


async def _stop(components: list[Component]) -> None:
    for c in components:
        if c.proc and c.proc.proc and c.returncode() is None:
            await c.kill()


# ---------------------------------------------------------------- webhooks


@dataclass
class HookScenario:
    deliveries: int  # at least this many, one every `pace` s until the faults are over
    pace: float
    rounds: int  # leader kills, one after the other
    down_s: float  # how long the killed node stays down


HOOKS_SHORT = HookScenario(deliveries=4, pace=0.4, rounds=1, down_s=1.0)
HOOKS_FULL = HookScenario(deliveries=30, pace=0.5, rounds=3, down_s=3.0)


async def test_cluster_webhooks_short(tmp_path: Path) -> None:
    await cluster_webhooks(tmp_path, HOOKS_SHORT)


@pytest.mark.slow
@pytest.mark.timeout(1200)
async def test_cluster_webhooks_full(tmp_path: Path) -> None:
    await cluster_webhooks(tmp_path, HOOKS_FULL)


async def _setup_vcs(api: Api) -> str:
    """The organization, its GitHub connection, the workspaces bound to it: its id."""
    await api.ok("POST", "/api/v1/orgs", {"name": ORG})
    conn = await api.ok(
        "POST",
        f"/api/v1/orgs/{ORG}/vcs-connections",
        {"name": "github", "provider": "github", "webhook_secret": SECRET},
    )
    for name, directory in WORKSPACES.items():
        body = {"name": name, "repository": REPO, "branch": "master", "directory": directory}
        await api.ok(
            "POST", f"/api/v1/orgs/{ORG}/workspaces", body | {"vcs_connection": conn["id"]}
        )
    return str(conn["id"])


async def _deliveries(
    hooks: Hooks, sc: HookScenario, bodies: dict[str, bytes], done: asyncio.Event
) -> list[list[Sent]]:
    """One new delivery every `pace` s, each to every api at once, until `sc.deliveries`
    were sent and the faults are over; every one redelivered until accepted."""
    sending = []
    i = 0
    while i < sc.deliveries or not done.is_set():
        d = f"delivery-{i:03d}"
        bodies[d] = push_body(CHANGED, sha(i + 1))
        sending.append(asyncio.create_task(hooks.to_all(d, bodies[d])))
        i += 1
        await asyncio.sleep(sc.pace)
    return list(await asyncio.gather(*sending))


async def cluster_webhooks(tmp_path: Path, sc: HookScenario) -> None:
    started = time.monotonic()
    nats_side = ClusterNats(NatsCluster(tmp_path / "cluster", size=3))
    await nats_side.start()
    apis, bases, nodes = await apis_on_distinct_nodes(tmp_path / "plane", nats_side)
    api = Api(bases)
    hooks: Hooks | None = None
    summary: dict[str, Any] = {"api_nodes": [sorted(n) for n in nodes]}
    summary["startup_s"] = round(time.monotonic() - started, 1)
    try:
        conn = await _setup_vcs(api)
        hooks = Hooks(bases, conn)
        bodies: dict[str, bytes] = {}
        done = asyncio.Event()
        sender = asyncio.create_task(_deliveries(hooks, sc, bodies, done))
        kills = []
        for _ in range(sc.rounds):
            accepted = sum(s.status == 200 for s in hooks.sent) + 2 * 2

            async def more(n: int = accepted) -> bool:
                return sum(s.status == 200 for s in hooks.sent) >= n

            await eventually(more, timeout=120, what="more deliveries accepted")
            kills.append(await _kill_leader(nats_side, sc.down_s))
            if len(kills) < sc.rounds:
                kills[-1]["replication"] = await replicated(nats_side)
        done.set()
        first = await asyncio.wait_for(sender, 300)
        kills[-1]["replication"] = await replicated(nats_side)
        deliveries = sorted(bodies)
        # Every delivery again to both replicas, once the cluster is whole: a replay.
        replays = await asyncio.gather(*(hooks.to_all(d, bodies[d]) for d in deliveries))

        nc = await nats_side.connect()
        try:
            store = EventStore(nc)
            envs = await store.read(f"rp.run.{ORG}.>")
            recorded = {
                d: [e.event for e in await store.read(vcs.delivery_subject(ORG, conn, d))]
                for d in deliveries
            }
            last_seq = int((await nc.jetstream().stream_info(EVENTS)).state.last_seq)
        finally:
            await nc.close()
        created = [e.event for e in envs if isinstance(e.event, RunCreated)]
        per_run = Counter(r.run_id for r in created)
        want = {derived_id("vcs", ORG, conn, d, ws): (ws, d) for d in deliveries for ws in MATCHING}
        got = {r.run_id: (r.workspace, r.cause.delivery if r.cause else "") for r in created}
        models = []
        for replica in range(len(bases)):
            code, page = await api.call(
                "GET", f"/api/v1/orgs/{ORG}/runs?limit=1000", min_seq=last_seq, replica=replica
            )
            assert code == 200, page
            models.append({r["id"] for r in page["items"]})

        odd = [s for s in hooks.sent if s.status not in (0, 200, 503)]
        refused = [s for s in hooks.sent if s.status in (0, 503)]
        late = [_after_back(s, kills) for s in refused]
        summary |= {
            "deliveries": len(deliveries),
            "posts": len(hooks.sent),
            "answers": dict(Counter(s.status for s in hooks.sent)),
            "redelivered": sum(len([s for s in hooks.sent if s.delivery == d]) > 4 for d in bodies),
            "runs": len(created),
            "runs_expected": len(want),
            "duplicates": sum(n - 1 for n in per_run.values()),
            "runs_lost": len(set(want) - set(got)),
            "runs_unexpected": len(set(got) - set(want)),
            "recorded_twice": sum(len(v) > 1 for v in recorded.values()),
            "not_recorded": sum(not v for v in recorded.values()),
            "non_200_after_node_back_s": sorted(t for t in late if t is not None),
            "kills": [_hook_recovery(k, hooks) for k in kills],
            "total_s": round(time.monotonic() - started, 1),
        }
        _summary(tmp_path, "webhooks", summary)

        assert [c.role for c in apis if c.returncode() is not None] == []
        assert odd == [], [(s.status, s.body) for s in odd]
        assert all(s.status == 200 for ss in first for s in ss), first  # redelivery works
        assert all(s.status == 200 for ss in replays for s in ss), replays
        assert all(s.body["ignored"] == "replay" for ss in replays for s in ss), replays
        assert summary["duplicates"] == 0, per_run
        assert got == want, (set(got) ^ set(want), [v for k, v in got.items() if want.get(k) != v])
        for d, events in recorded.items():  # each once, naming all its runs
            assert len(events) == 1, (d, events)
            assert isinstance(events[0], vcs.DeliveryAccepted)
            mine = sorted(f"{ws}/{r}" for r, (ws, dd) in want.items() if dd == d)
            assert sorted(events[0].runs) == mine, (d, events[0].runs)
        assert models == [set(want)] * len(bases), [len(m) for m in models]
        # A refusal only from a kill until shortly after the node was back.
        assert all(t is not None and t <= AFTER_FAULT_503_S for t in late), late
        assert [k["replication"] for k in kills if k["replication"]["below"]] == []
    finally:
        await api.close()
        if hooks is not None:
            await hooks.close()
        await _stop(apis)
        await nats_side.kill_all()


def _after_back(s: Sent, kills: list[dict[str, Any]]) -> float | None:
    """Seconds from the return of the node last killed before the answer `s` (negative:
    while it was down); None if no kill came before it."""
    last = next((k for k in reversed(kills) if k["t_kill"] <= s.at), None)
    return None if last is None else round(s.at - last["t_back"], 2)


def _hook_recovery(kill: dict[str, Any], hooks: Hooks) -> dict[str, Any]:
    """Around one kill: the refusals, and the seconds from the kill to the first 200
    (any delivery) and to the first 200 of a delivery first sent after the kill."""
    t0, t1 = kill["t_kill"], kill["t_back"]
    firsts: dict[str, float] = {}
    for s in sorted(hooks.sent, key=lambda s: s.at):
        firsts.setdefault(s.delivery, s.at)
    after = [s for s in hooks.sent if s.at > t0]
    ok = [s.at for s in after if s.status == 200]
    new = [s.at for s in after if s.status == 200 and firsts[s.delivery] > t0]
    return {
        "killed": kill["killed"],
        "back_s": kill["back_s"],
        "replication_back_s": kill["replication"]["after_s"],
        "refused_while_down": sum(s.status != 200 for s in after if s.at <= t1),
        "refused_after_back": sum(s.status != 200 for s in after if s.at > t1),
        "first_200_s": round(min(ok) - t0, 2) if ok else None,
        "first_new_delivery_200_s": round(min(new) - t0, 2) if new else None,
    }


# ---------------------------------------------------------------- run triggers

# b follows a. Every apply of a replaces its resource (tests/reliability/chaos_support.py's
# configuration: a timestamp trigger), so each changes something and starts one run of b.
# Faults, each struck the moment an apply of a ends (its ending event is the one the
# run-triggers subscriber follows): a `runplane subscribers` replica killed -9 (either
# of the two: which one holds the event is the broker's choice; the logs say) and, at
# the next apply's end, the node leading RP_EVENTS; each restarted.


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
    return str(R.fold([e.event for e in envs]).status) if envs else ""


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
    kills = [victim.kill()] if victim else []
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
    try:
        await setup_org(api, tmp_path, ["a", "b"], {})
        await api.ok(
            "PATCH", f"/api/v1/orgs/{ORG}/workspaces/a/settings", {"require_approval": False}
        )
        await api.ok("POST", f"/api/v1/orgs/{ORG}/workspaces/b/run-triggers", {"source": "a"})
        # Every apply of a at once: a's queue runs them one after the other.
        a_runs = []
        for _ in sc.plan:
            made = await api.ok("POST", f"/api/v1/orgs/{ORG}/workspaces/a/runs", {"type": "apply"})
            a_runs.append(str(made["id"]))
        faults = []
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
        created = [e for e in b_envs if isinstance(e.event, RunCreated)]
        per_run = Counter(e.event.run_id for e in created)
        got = {e.event.run_id: e for e in created}
        handled = {s.role: _triggered(s) for s in subs}
        for f in faults:
            b_run = got.get(derived_id("run-trigger", f["a_run"], "b"))
            f["b_run_after_a_end_s"] = b_run and round(_at(b_run) - _at(a_ends[f["a_run"]]), 2)
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
        _summary(tmp_path, "run_triggers", summary)

        assert [s.role for s in subs if s.returncode() is not None] == []
        assert summary["duplicates"] == 0, per_run
        assert set(got) == set(want), (set(want) - set(got), set(got) - set(want))
        for run_id, env in got.items():  # each caused by its a run, none otherwise
            cause = env.event.cause
            assert cause is not None and cause.kind == "run_trigger", (run_id, cause)
            assert (cause.source_workspace, cause.source_run) == ("a", want[run_id])
        assert settled, "the run-triggers consumer still holds events"
        assert [f for f in faults if f["back_s"] is None] == []
    finally:
        await nc.close()
        await api.close()
        await _stop(subs)
        await plane.kill_all()


def _at(env: Envelope) -> float:
    assert env.time is not None
    return env.time.timestamp()
