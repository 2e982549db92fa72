"""Issue 14's VCS webhook on a 3-node NATS JetStream cluster of real processes while
kill -9 strikes (tests/cluster_support.py, tests/reliability/chaos_support.py; the
notifications tests of test_cluster.py are the model).

Two `runplane api` processes, each talking to a node of its own, are sent every GitHub
push delivery at once, each redelivered until it answers 200 (as GitHub's "Redeliver"
or a retrying proxy would), while the node leading `RP_EVENTS` is killed -9 and
restarted; afterwards every delivery once more to both. Every matching workspace has
exactly one run per delivery under its derived id, the others none; each delivery is
recorded once, naming them all; no answer but 200, 503 or none (a fault's), and those
only until shortly after the node's return; both read models hold the stream's runs.
The summary (recovery times, duplicates, runs lost) is printed and written to
`last_cluster_webhooks.json` in the test's temporary directory.

Each delivery pushes a commit of its own, made on acme/net's master as it is sent (a
real repository the api processes' git reaches as `https://github.com/acme/net.git`,
tests/vcs_git_support.py), so a push is current when runplane looks. The workspaces plan
(`vcs_run_type: plan`): a delivery redelivered after a newer one started runs is still
on the branch and undoes nothing, so it starts its own; for workspaces that apply it
would be stale (tests/test_vcs_stale.py), which is not what this test is about.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from events import vcs
from events.run_events import RunCreated
from infra.eventstore import EventStore
from infra.ids import derived_id
from infra.streams import EVENTS
from tests.cluster_support import NatsCluster
from tests.helpers import eventually
from tests.reliability.chaos_support import (
    AFTER_FAULT_503_S,
    ORG,
    Api,
    ClusterNats,
    replicated,
)
from tests.reliability.cluster_events_support import (
    Hooks,
    Sent,
    apis_on_distinct_nodes,
    kill_components,
    kill_leader,
    push_body,
    write_summary,
)
from tests.vcs_git_support import commit, origin, redirect
from tests.vcs_support import SECRET

REPO = "https://github.com/acme/net.git"
# Workspaces on acme/net's master: a push changing net/main.tf starts net's and edge's
# runs (their directory), not db's.
WORKSPACES = {"net": "net", "edge": "net", "db": "db"}
MATCHING = ("edge", "net")
CHANGED = ["net/main.tf"]
AFTER = 2  # new deliveries sent once the last fault is over


# ---------------------------------------------------------------- webhooks


@dataclass
class HookScenario:
    deliveries: int  # at least this many, one every `pace` s until the faults are over
    pace: float
    rounds: int  # leader kills, one after the other
    down_s: float  # how long the killed node stays down


HOOKS_SHORT = HookScenario(deliveries=4, pace=0.4, rounds=1, down_s=1.0)
HOOKS_FULL = HookScenario(deliveries=30, pace=0.5, rounds=3, down_s=3.0)


@pytest.mark.slow
async def test_cluster_webhooks_short(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    await cluster_webhooks(tmp_path, HOOKS_SHORT, monkeypatch)


@pytest.mark.slow
@pytest.mark.timeout(1200)
async def test_cluster_webhooks_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    await cluster_webhooks(tmp_path, HOOKS_FULL, monkeypatch)


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
        body["vcs_run_type"] = "plan"
        await api.ok(
            "POST", f"/api/v1/orgs/{ORG}/workspaces", body | {"vcs_connection": conn["id"]}
        )
    return str(conn["id"])


async def _deliveries(
    hooks: Hooks, sc: HookScenario, bodies: dict[str, bytes], done: asyncio.Event, repo: Path
) -> list[list[Sent]]:
    """One new delivery every `pace` s, each of a new commit on `repo`'s master and to
    every api at once, until `sc.deliveries` were sent and the faults are over, and AFTER
    more since; every one redelivered until accepted."""
    sending = []
    i, after = 0, 0
    while i < sc.deliveries or after < AFTER:
        after += done.is_set()
        d = f"delivery-{i:03d}"
        sha = await asyncio.to_thread(commit, repo, {CHANGED[0]: f"# {d}\n"})
        bodies[d] = push_body(CHANGED, sha)
        sending.append(asyncio.create_task(hooks.to_all(d, bodies[d])))
        i += 1
        await asyncio.sleep(sc.pace)
    return list(await asyncio.gather(*sending))


async def cluster_webhooks(
    tmp_path: Path, sc: HookScenario, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = time.monotonic()
    repo = origin(tmp_path)
    redirect(monkeypatch, repo)  # before the api processes start: they inherit it
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
        sender = asyncio.create_task(_deliveries(hooks, sc, bodies, done, repo))
        kills = []
        for _ in range(sc.rounds):
            accepted = sum(s.status == 200 for s in hooks.sent) + 2 * 2

            async def more(n: int = accepted) -> bool:
                return sum(s.status == 200 for s in hooks.sent) >= n

            await eventually(more, timeout=120, what="more deliveries accepted")
            kills.append(await kill_leader(nats_side, sc.down_s))
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
        # a duplicate: a second run for one (workspace, delivery), whatever its id
        per_run = Counter((r.workspace, r.cause.delivery if r.cause else "") for r in created)
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
            "non_200_sent_after_node_back_s": sorted(t for t in late if t is not None),
            "slowest_non_200_s": max((round(s.at - s.sent_at, 2) for s in refused), default=0),
            "kills": [_hook_recovery(k, hooks) for k in kills],
            "total_s": round(time.monotonic() - started, 1),
        }
        write_summary(tmp_path, "webhooks", summary)

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
        # A refusal only for a request sent from a kill until shortly after the node was back.
        assert all(t is not None and t <= AFTER_FAULT_503_S for t in late), late
        assert [k["replication"] for k in kills if k["replication"]["below"]] == []
    finally:
        await api.close()
        if hooks is not None:
            await hooks.close()
        await kill_components(apis)
        await nats_side.kill_all()


def _after_back(s: Sent, kills: list[dict[str, Any]]) -> float | None:
    """Seconds from the return of the node last killed before the request `s` left to
    when it left (negative: while the node was down); None if no kill came before it.
    (By its leaving: a request sent during an election may wait seconds for its 503.)"""
    last = next((k for k in reversed(kills) if k["t_kill"] <= s.sent_at), None)
    return None if last is None else round(s.sent_at - last["t_back"], 2)


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
