"""runplane on a 3-node NATS JetStream cluster, two processes of each role, while kill -9
strikes the node leading `RP_EVENTS`, a scheduler, an executor in the middle of an apply
(the process alone: its Terraform must die with it) and an api replica, each restarted.

Everything real, as deploy/README.md sets it up: three nats-servers on loopback with
routes and client credentials (tests/cluster_support.py), 2 `runplane api` (each its own
`--listen` and data directory, one admin token and encryption key), 2 `runplane
scheduler` and 2 `runplane executor`, each given all three URLs; Terraform with the null
provider. A driver pushes apply runs through both apis (each request to the next
replica; a GET that gets no answer goes to the other, as a load balancer would) and
approves them. No organization or workspace sets a timeout: nothing but the processes
themselves ends a run.

Afterwards: every run terminal; none lost, none applied twice (tests/reliability/
chaos_support.py: `check_runs`); no 5xx but a 503, and each within seconds of a fault
(counted and reported by kind and time after the fault); both api replicas answer every
run's GET identically once caught up (`RP-Min-Seq`), and their read models equal each
other and a replay; every stream, bucket and durable consumer still has 3 replicas
after every restart, and `runplane nats status` exits 0 at the end. The summary (runs,
faults, recovery times, 5xx) is printed and written to `last_cluster.json`.

`test_cluster_notifications_*`: issue 12's event path on the same cluster, 2 `runplane
subscribers` replicas and a local receiver, while a replica and the `RP_EVENTS` leader's
node are killed -9 (see the section below).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shlex
import signal
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from events import notification as nt
from infra import replicas as rep
from infra.eventstore import EventStore
from infra.kv import BUCKETS
from infra.streams import (
    EVENTS,
    OBJECT_BUCKETS,
    SCHEDULER_CONSUMER,
    subscriber_consumer,
)
from services.processes.chat import subscriber as chat
from services.processes.notifications import subscriber as notifications
from services.root import natsstatus
from services.root.cli import options, parser
from tests.cluster_support import NatsCluster
from tests.helpers import eventually
from tests.notify_support import Receiver
from tests.procs import Proc, free_port
from tests.reliability.chaos_support import (
    AFTER_FAULT_503_S,
    NOTIFY_ENV,
    ORG,
    Api,
    ClusterNats,
    Component,
    Fault,
    Plane,
    StreamView,
    Witness,
    Workload,
    _maybe,
    _subscribers,
    applies_from_terraform,
    check_runs,
    diff_dumps,
    inject_faults,
    read_stream,
    replay_identity,
    replicated,
    settle,
    setup_org,
    state_versions_by_run,
    watch_crashes,
)

pytestmark = pytest.mark.terraform

KINDS = ["nats", "scheduler", "executor", "api"]

ORPHAN_LIMIT_S = 25.0  # see the assertion that uses it


@dataclass
class Scenario:
    runs: int
    workspaces: int
    faults_per_kind: int
    gap: tuple[float, float]  # seconds between faults
    settle: float  # seconds allowed, after the last fault, for every run to end


SHORT = Scenario(runs=6, workspaces=3, faults_per_kind=1, gap=(1.0, 3.0), settle=120)
FULL = Scenario(runs=40, workspaces=4, faults_per_kind=4, gap=(3.0, 8.0), settle=300)


def seed() -> int:
    return int(os.environ.get("RUNPLANE_CHAOS_SEED") or random.SystemRandom().randrange(10**6))


@pytest.mark.slow  # ~50 s; cluster_full and the cluster tests of each surface stay
async def test_cluster_short(tmp_path: Path) -> None:
    await cluster_chaos(tmp_path, SHORT, seed())


@pytest.mark.slow
@pytest.mark.timeout(2400)
async def test_cluster_full(tmp_path: Path) -> None:
    await cluster_chaos(tmp_path, FULL, seed())


async def cluster_chaos(tmp_path: Path, sc: Scenario, seed: int) -> None:
    print(f"\ncluster seed {seed} (RUNPLANE_CHAOS_SEED={seed} replays the schedule)", flush=True)
    rng = random.Random(seed)
    started = time.monotonic()
    nats_side = ClusterNats(NatsCluster(tmp_path / "cluster", size=3))
    plane = await Plane.start(tmp_path / "plane", nats_side, count=2)
    api = Api(plane.bases)
    witness = await Witness().start()
    summary: dict[str, Any] = {"seed": seed, "startup_s": round(time.monotonic() - started, 1)}
    try:
        workspaces = [f"ws{i}" for i in range(sc.workspaces)]
        await setup_org(api, tmp_path, workspaces, {}, witness)
        plan = KINDS * sc.faults_per_kind
        rng.shuffle(plan)
        work = Workload(api, workspaces, sc.runs, rng)
        stop = asyncio.Event()
        background = [
            asyncio.create_task(work.creator()),
            asyncio.create_task(work.approver(stop)),
            asyncio.create_task(watch_crashes(plane, stop)),
        ]
        replication: list[dict[str, Any]] = []  # after each fault: what is not at 3

        async def after(fault: Fault) -> None:
            replication.append({"fault": len(plane.faults)} | await replicated(nats_side))

        await inject_faults(
            plane, api, work, rng, plan, sc.gap, after, aim={"executor": "applying"}, alone=True
        )
        work.faults_done.set()
        chaos_s = time.monotonic() - started
        await asyncio.wait_for(work.done.wait(), sc.settle)
        left = await settle(api, plane, sc.settle)
        stop.set()
        await asyncio.gather(*background)
        settle_s = time.monotonic() - started - chaos_s

        # The writers stop; both apis' projectors reach the end of the stream.
        for c in (*plane.executors, *plane.schedulers):
            code = await c.stop()
            assert code == 0, f"{c.role} exited {code}: {c.output()[-3000:]}"
        stream = await read_stream(nats_side)
        runs = await api.ok_runs()
        differ = await compare_replicas(api, stream)
        state_versions = await state_versions_by_run(api, workspaces)
        status_code, status_text = await nats_status(plane, tmp_path)
        (live1, live2), replayed = await replay_identity(plane, tmp_path)
        strays = plane.strays()
        orphan_lifetimes = [t.result() if t.done() else None for t in plane.orphans]
        for t in plane.orphans:
            t.cancel()
        applies_tf = applies_from_terraform(witness)
        summary["isolation"] = plane.isolation()
        fault_log = recovery(plane.faults, api, stream)
        errors = server_errors(plane.faults, api)
        summary |= {
            "runs": len(runs),
            "runs_created_2xx": len(work.created),
            "create_unanswered": work.create_unanswered,
            "create_refused": dict(work.create_refused),
            "approvals": work.approvals,
            "approve_errors": dict(work.approve_errors),
            "requests": len(api.answers),
            "statuses": dict(Counter(r["status"] for r in runs)),
            "failure_reasons": dict(
                Counter(str(r.get("reason")) for r in runs if r["status"] == "failed")
            ),
            "faults": dict(Counter(f.kind for f in plane.faults)),
            "crashes": plane.crashes,
            "5xx": {k: len(v) for k, v in errors.items()},
            "5xx_after_fault_s": errors,
            "replication_below_3": [r for r in replication if r["below"]],
            "replication_back_s": [r["after_s"] for r in replication],
            "nats_status_exit": status_code,
            "replicas_differ": differ[:5],
            "terraform_outlived_executor_s": orphan_lifetimes,
            "strays_at_end": strays,
            "applies_terraform": sum(applies_tf.values()),
            "state_versions": sum(stream.state_versions.values()),
            "not_terminal": left,
            "chaos_s": round(chaos_s, 1),
            "settle_s": round(settle_s, 1),
            "total_s": round(time.monotonic() - started, 1),
            "fault_log": fault_log,
        }
        out = tmp_path / "last_cluster.json"
        out.write_text(json.dumps(summary, indent=2))
        brief = {k: v for k, v in summary.items() if k != "fault_log"}
        print("cluster summary:", json.dumps(brief), f"(full log: {out})", flush=True)
        for f in fault_log:
            print("  fault", json.dumps(f), flush=True)

        assert not plane.crashes, plane.crashes
        assert left == [], f"runs not terminal {sc.settle}s after the faults: {left}"
        check_runs(runs, work.created, stream, state_versions, applies_tf, sc.runs)
        bad = {
            k: v
            for k, v in errors.items()
            if not k.startswith("503 ") or any(t is None or t > AFTER_FAULT_503_S for t in v)
        }
        assert not bad, f"5xx other than a 503 shortly after a fault: {bad}"
        assert not differ, f"the api replicas answer differently: {differ[:5]}"
        assert diff_dumps(live1, live2) == []
        assert diff_dumps(live1, replayed) == []
        assert not summary["replication_below_3"], summary["replication_below_3"]
        assert status_code == 0, status_text
        # Terraform ends on its executor's death, but gracefully: its dead state backend is
        # tried for 6 s, then it writes errored.tfstate (recorded at the restart) and gives
        # up the unlock after 6 s more (executor/statebackend.py, executor/spawn.py).
        assert all(t is not None and t < ORPHAN_LIMIT_S for t in orphan_lifetimes), orphan_lifetimes
        assert not strays, strays
        assert len(plane.faults) == len(plan)
        assert len(nats_side.killed) == sc.faults_per_kind
    finally:
        witness.close()
        await api.close()
        await plane.kill_all()


async def nats_status(plane: Plane, tmp_path: Path) -> tuple[int, str]:
    """`runplane nats status` against the cluster: (exit code, output)."""
    args = ["nats", "status", "--nats-url", plane.nats.url, "--data-dir", str(tmp_path / "st")]
    proc = await Proc(args, tmp_path / "nats-status.log", env=plane.nats.env()).start()
    code = await proc.stop(signal.SIGCONT, timeout=60)
    return code, proc.output()


async def compare_replicas(api: Api, stream: StreamView) -> list[str]:
    """Each run's GET, and its events, from both replicas once each has projected the
    stream's last event (RP-Min-Seq): where they differ."""
    differ = []
    paths = [f"/api/v1/orgs/{ORG}/runs/{r}" for r in sorted(stream.runs)]
    paths += [p + "/events" for p in paths]
    for path in paths:
        got = []
        for replica in (0, 1):
            code, body = await api.call("GET", path, min_seq=stream.last_seq, replica=replica)
            got.append((code, body))
        if got[0] != got[1] or got[0][0] != 200:
            differ.append(f"{path}: {str(got[0])[:200]} / {str(got[1])[:200]}")
    return differ


def recovery(faults: list[Fault], api: Api, stream: StreamView) -> list[dict[str, Any]]:
    """Per fault, seconds from the kill to: the first 2xx answer (an api fault: from the
    replica killed), the first 2xx write, the first run or workspace event appended,
    and (an executor fault) the next event of the run it was applying."""
    out = []
    for f in faults:
        replica = int(f.target[-1]) - 1 if f.kind == "api" else None
        answers = [a for a in api.answers if a.at > f.at]
        ok = [a for a in answers if 200 <= a.status < 300]
        first = next((a.at for a in ok if replica is None or a.replica == replica), None)
        write = next((a.at for a in ok if a.method != "GET"), None)
        event = next((t for t, _, _ in stream.timeline if t > f.wall), None)
        row: dict[str, Any] = {
            "kind": f.kind,
            "target": f.target,
            "down_s": f.down_s,
            "back_s": f.recovered_s,
            "note": f.note,
            "first_2xx_s": _since(first, f.at),
            "first_write_2xx_s": _since(write, f.at),
            "first_event_s": _since(event, f.wall),
            "unanswered": sum(a.status == 0 for a in answers if a.at < f.at + f.recovered_s),
        }
        if f.kind == "executor" and f.run_id:
            moved = next(
                ((t, tag) for t, who, tag in stream.timeline if who == f.run_id and t > f.wall),
                None,
            )
            row["run"] = f.run_id
            row["run_next_event"] = moved and (_since(moved[0], f.wall), moved[1])
        out.append(row)
    return out


def _since(t: float | None, t0: float) -> float | None:
    return None if t is None else round(t - t0, 2)


def server_errors(faults: list[Fault], api: Api) -> dict[str, list[float | None]]:
    """Every 5xx answer by `<status> <type> <fault kind>`, with the seconds from the end
    of the fault it came after (negative: during the fault; None: before any fault)."""
    found: dict[str, list[float | None]] = {}
    for a in api.answers:
        if a.status < 500:
            continue
        last = next((f for f in reversed(faults) if f.at <= a.at), None)
        key = f"{a.status} {a.kind} after {last.kind if last else 'no fault'}"
        since = None if last is None else round(a.at - (last.at + last.recovered_s), 2)
        found.setdefault(key, []).append(since)
    return found


# ---------------------------------------------------------------- the deploy docs

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def exec_start(unit: Path, instance: str) -> list[str]:
    """The unit's ExecStart as systemd runs it for `instance`: `%i` replaced, `${VAR}`
    from the unit's `Environment=` lines (unset: empty, as systemd does)."""
    lines = unit.read_text().splitlines()
    env = dict(
        line.removeprefix("Environment=").split("=", 1)
        for line in lines
        if line.startswith("Environment=")
    )
    line = next(x for x in lines if x.startswith("ExecStart="))
    words = shlex.split(line.removeprefix("ExecStart=").replace("%i", instance))
    return [re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), ""), w) for w in words]


@pytest.mark.parametrize("role", ["api", "scheduler", "executor", "subscribers"])
def test_each_unit_runs_a_command_the_cli_takes_and_instances_do_not_collide(role: str) -> None:
    unit = DEPLOY / "systemd" / f"runplane-{role}@.service"
    assert "EnvironmentFile=/etc/runplane/env" in unit.read_text()
    seen = []
    for instance in ("8081", "8082") if role == "api" else ("1", "2"):
        argv = exec_start(unit, instance)
        assert argv[:2] == ["/opt/runplane/.venv/bin/runplane", role], argv
        opts = options(parser().parse_args(argv[1:]))  # an unknown flag exits here
        assert "--nats-url" not in argv  # RUNPLANE_NATS_URL, from the environment file
        seen.append((opts.data_dir, opts.host_port() if role == "api" else None))
    assert seen[0][0] != seen[1][0], seen
    if role == "api":
        assert seen[0][1] != seen[1][1] and seen[0][1] == ("127.0.0.1", 8081), seen


def test_the_deploy_readme_names_everything_runplane_declares_and_reads() -> None:
    readme = (DEPLOY / "README.md").read_text()
    names = [stream for _, stream in natsstatus.declared()]
    names += [*BUCKETS, *OBJECT_BUCKETS, SCHEDULER_CONSUMER]
    subscribers = (notifications.NAME, chat.REQUESTS_NAME, chat.UPDATES_NAME)
    names += [subscriber_consumer(n) for n in subscribers]
    assert "`runplane-subscribers@<n>`" in readme  # without one, no notification is sent
    assert [n for n in names if f"`{n}`" not in readme and f"> {n}`" not in readme] == []
    # Every variable the environment file of the README sets is one runplane reads.
    product = ("services", "infra", "executor", "projections", "events")
    source = "\n".join(p.read_text() for d in product for p in (DEPLOY.parent / d).rglob("*.py"))
    env_file = re.findall(r"^\s+(RUNPLANE_\w+)=", readme, re.M)
    assert {"RUNPLANE_ADMIN_TOKEN", "RUNPLANE_ENCRYPTION_KEY", "RUNPLANE_NATS_URL"} <= set(env_file)
    assert [v for v in env_file if v not in source] == []
    assert "FAILURES_TABLE" not in readme


# ---------------------------------------------------------------- notifications

# Issue 12's event path on the cluster: 2 `runplane subscribers` replicas (one durable,
# `rp-sub-notifications`) deliver to a receiver in this process while (a) a replica is
# killed -9 mid-stream and restarted, (b) the node leading RP_EVENTS is killed -9 and
# restarted. Every run's notifications arrive, each under one RP-Delivery per (config,
# run, trigger); the log holds no other delivery, and each is recorded delivered.

NOTIFY_TOKEN = "cluster-notify-token-7f6e5d"
ENDED = {"planned": "run:completed", "no_changes": "run:completed", "failed": "run:errored"}


@dataclass
class NotifyScenario:
    runs: int  # created through the api, one every `pace` seconds, faults meanwhile
    plans: bool  # a scheduler and an executor too: the plan runs end (run:completed)
    pace: float
    down_s: float  # how long each killed process or node stays down
    settle: float  # seconds allowed, after the faults, for every delivery to arrive
    rounds: int = 1  # of the two faults, one after the other


NOTIFY_SHORT = NotifyScenario(runs=10, plans=False, pace=0.3, down_s=1.0, settle=90)
NOTIFY_FULL = NotifyScenario(runs=40, plans=True, pace=1.0, down_s=3.0, settle=300, rounds=3)


@pytest.mark.slow
async def test_cluster_notifications_short(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    await cluster_notifications(tmp_path, monkeypatch, NOTIFY_SHORT)


@pytest.mark.slow
@pytest.mark.timeout(1800)
async def test_cluster_notifications_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    await cluster_notifications(tmp_path, monkeypatch, NOTIFY_FULL)


async def _notify_plane(root: Path, nats_side: ClusterNats, plans: bool) -> Plane:
    """One api (with `plans`, a scheduler and an executor too) on the cluster."""
    if plans:
        return await Plane.start(root, nats_side, count=1)
    root.mkdir(parents=True, exist_ok=True)
    await nats_side.start()
    port = free_port()
    args = ["api", "--nats-url", nats_side.url, "--log-format", "json"]
    args += ["--data-dir", str(root / "api"), "--listen", f"127.0.0.1:{port}"]
    api = Component("api", args, root / "api.log", "runplane api listening", nats_side.env())
    await api.start()
    await api.ready()
    return Plane(root, nats_side, [api], [], [], [f"http://127.0.0.1:{port}"])


async def cluster_notifications(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sc: NotifyScenario
) -> None:
    for k, v in NOTIFY_ENV.items():  # the api's guard judges the receiver's URL too
        monkeypatch.setenv(k, v)
    started = time.monotonic()
    nats_side = ClusterNats(NatsCluster(tmp_path / "cluster", size=3))
    plane = await _notify_plane(tmp_path / "plane", nats_side, sc.plans)
    subs = _subscribers(tmp_path / "plane", nats_side)
    for s in subs:
        await s.start()
    for s in subs:
        await s.ready()
    api = Api(plane.bases)
    summary: dict[str, Any] = {"plans": sc.plans, "startup_s": round(time.monotonic() - started, 1)}
    wall = time.time() - time.monotonic()  # Got.at (monotonic) to wall clock
    witness = await Witness().start()  # the applies report to it (not counted here)
    try:
        async with Receiver(token=NOTIFY_TOKEN, delay=0.2) as receiver:
            workspaces = ["ws0", "ws1", "ws2"]
            await setup_org(api, tmp_path, workspaces, {}, witness)
            triggers = ["run:created", "run:completed", "run:errored"]
            body = {"name": "cluster", "url": receiver.url, "token": NOTIFY_TOKEN}
            cfg = await api.ok(
                "POST", f"/api/v1/orgs/{ORG}/notifications", body | {"triggers": triggers}
            )
            created: list[str] = []

            faults_done = asyncio.Event()
            creator = asyncio.create_task(_create_runs(api, workspaces, sc, created, faults_done))

            # Each round: (a) the subscriber replica delivering killed -9 while a
            # delivery is in flight, (b) the node leading RP_EVENTS killed -9, runs
            # coming all along; each restarted.
            sub_faults, leader_faults = [], []
            for _ in range(sc.rounds):
                sub_faults.append(await _kill_a_subscriber(subs, receiver, sc.down_s))
                sub_faults[-1]["replication"] = await replicated(nats_side)
                leader_faults.append(await _kill_the_leader(nats_side, receiver, sc.down_s))
                leader_faults[-1]["replication"] = await replicated(nats_side)
            summary |= {"subscriber_faults": sub_faults, "leader_faults": leader_faults}
            faults_done.set()
            await asyncio.wait_for(creator, sc.settle)

            stream, runs = await _settled(api, plane, sc)
            want = _expected(stream.runs, runs, sc.plans)
            missing: set[tuple[str, str]] = set()

            async def every_delivery() -> bool:
                missing.clear()
                missing.update(want - set(_by_key(receiver)))
                return not missing

            try:
                await eventually(
                    every_delivery, timeout=sc.settle, interval=0.2, what="every delivery"
                )
            except AssertionError:
                raise AssertionError(f"never delivered: {sorted(missing)}") from None
            logged: dict[str, str] = {}

            async def all_recorded() -> bool:  # an attempt is recorded after its answer
                logged.clear()
                logged.update(await _logged_deliveries(nats_side, cfg["id"]))
                done = {d for d, outcome in logged.items() if outcome == nt.DELIVERED}
                return done == set(logged) == receiver.deliveries()

            recorded = await _maybe(eventually(all_recorded, timeout=60, what="every attempt"))
            by_key = _by_key(receiver)
            distinct = {k: ids for k, ids in by_key.items() if len(ids) > 1}
            for f in leader_faults:
                f |= _after_kill(receiver, wall, f.pop("t_kill"), f.pop("t_back"))
            summary |= {
                "runs": len(stream.runs),
                "runs_created_2xx": len(created),
                "statuses": dict(Counter(r["status"] for r in runs)),
                "expected_deliveries": len(want),
                "received_posts": len(receiver.got),
                "same_id_copies": len(receiver.got) - len(receiver.deliveries()),
                "distinct_second_ids": len(distinct),
                "logged_deliveries": len(logged),
                "total_s": round(time.monotonic() - started, 1),
            }
            status_code, status_text = await nats_status(plane, tmp_path)
            summary["nats_status_exit"] = status_code
            out = tmp_path / "last_cluster_notify.json"
            out.write_text(json.dumps(summary, indent=2))
            print("cluster notifications:", json.dumps(summary), flush=True)

            assert not plane.crashes, plane.crashes
            assert [s.role for s in subs if s.returncode() is not None] == []
            assert set(created) <= set(stream.runs)
            assert len(stream.runs) >= sc.runs
            assert set(by_key) == want, set(by_key) ^ want  # none lost, none extra
            assert distinct == {}, distinct  # one RP-Delivery per (config, run, trigger)
            assert all(g.tfe_ok and g.rp_ok for g in receiver.got)
            # The log holds exactly the deliveries received, each recorded delivered.
            assert set(logged) == receiver.deliveries(), set(logged) ^ receiver.deliveries()
            assert [d for d, outcome in logged.items() if outcome != nt.DELIVERED] == []
            assert recorded
            below = [f["replication"] for f in sub_faults + leader_faults]
            assert [r for r in below if r["below"]] == [], below
            assert status_code == 0, status_text
            assert f"RP_EVENTS > {subscriber_consumer(notifications.NAME)}" in status_text
            # A leader election is an expected fault: no error traceback per fetch.
            failed = [s.role for s in subs if "consumer_fetch_failed" in s.log.read_text()]
            assert failed == [], failed
    finally:
        witness.close()
        await api.close()
        for s in subs:
            if s.proc and s.proc.proc and s.returncode() is None:
                await s.kill()
        await plane.kill_all()


async def _create_runs(
    api: Api, workspaces: list[str], sc: NotifyScenario, created: list[str], done: asyncio.Event
) -> None:
    """Plan runs through the api, one every `pace` s in turn over the workspaces, until
    `sc.runs` got a 2xx and the faults are over (a create left unanswered is not sent
    again: the run may exist, and the stream says)."""
    i = 0
    while len(created) < sc.runs or not done.is_set():
        ws = workspaces[i % len(workspaces)]
        code, body = await api.call(
            "POST", f"/api/v1/orgs/{ORG}/workspaces/{ws}/runs", {"type": "plan"}
        )
        if 200 <= code < 300:
            created.append(body["id"])
        i += 1
        await asyncio.sleep(sc.pace)


async def _at_least(receiver: Receiver, n: int) -> bool:
    return len(receiver.got) >= n


async def _kill_a_subscriber(
    subs: list[Component], receiver: Receiver, down_s: float
) -> dict[str, Any]:
    """kill -9 the replica delivering, once a delivery is in flight; restart it."""
    more = len(receiver.got) + 2
    await eventually(lambda: _at_least(receiver, more), timeout=120, what="more deliveries")
    await eventually(lambda: _in_flight(receiver), timeout=60, interval=0.01, what="one in flight")
    victim = _delivering(subs)
    t0, got_before, in_flight = time.monotonic(), len(receiver.got), await _in_flight(receiver)
    await victim.kill()
    await asyncio.sleep(down_s)
    await victim.start()
    await victim.ready()
    return {
        "killed": victim.role,
        "got_before": got_before,
        "in_flight_at_kill": in_flight,
        "back_s": round(time.monotonic() - t0, 2),
    }


async def _kill_the_leader(
    nats_side: ClusterNats, receiver: Receiver, down_s: float
) -> dict[str, Any]:
    """kill -9 the node leading RP_EVENTS (once deliveries flow); restart it."""
    more = len(receiver.got) + 2
    await eventually(lambda: _at_least(receiver, more), timeout=120, what="more deliveries")
    leader = await nats_side.cluster.stream_leader(EVENTS)
    consumer_leader = await _consumer_leader(nats_side)
    t_kill = time.monotonic()
    await nats_side.kill()
    await asyncio.sleep(down_s)
    await nats_side.start()
    return {
        "killed": leader.name,
        "consumer_leader": consumer_leader,
        "back_s": round(time.monotonic() - t_kill, 2),
        "t_kill": t_kill,
        "t_back": time.monotonic(),
    }


def _after_kill(receiver: Receiver, wall: float, t_kill: float, t_back: float) -> dict[str, Any]:
    """Deliveries around a leader's kill: how many came while the node was away, the
    first of an event appended after the kill (seconds from the kill), and the time
    from event to delivery of events from 1 s before the kill until the node was back."""
    new = [g.at - t_kill for g in receiver.got if g.at > t_kill and _event_at(g) > wall + t_kill]
    return {
        "got_while_down": sum(t_kill < g.at <= t_back for g in receiver.got),
        "first_new_event_delivered_s": round(min(new), 2) if new else None,
        "event_to_delivery_s": _latencies(receiver, wall, t_kill, t_back),
    }


def _event_at(g: Any) -> float:
    """The wall time of the event a delivery is for (its payload says)."""
    return datetime.fromisoformat(g.json["notifications"][0]["run_updated_at"]).timestamp()


def _delivering(subs: list[Component]) -> Component:
    """The replica that made the latest delivery attempt (its log says): the one that
    holds deliveries now, rather than one that may hold none."""

    def last_attempt(c: Component) -> str:
        lines = [ln for ln in c.output().splitlines() if '"notify_attempt"' in ln]
        return str(json.loads(lines[-1])["timestamp"]) if lines else ""

    return max(subs, key=last_attempt)


async def _in_flight(receiver: Receiver) -> int:
    """Posts received and not yet answered (the receiver answers `delay` s after)."""
    return sum(g.at > time.monotonic() - receiver.delay for g in receiver.got)


async def _consumer_leader(nats_side: ClusterNats) -> str:
    nc = await nats_side.connect()
    try:
        name = subscriber_consumer(notifications.NAME)
        info = await rep.api(nc, f"$JS.API.CONSUMER.INFO.{EVENTS}.{name}")
    finally:
        await nc.close()
    return str((info.get("cluster") or {}).get("leader", "-"))


async def _settled(
    api: Api, plane: Plane, sc: NotifyScenario
) -> tuple[StreamView, list[dict[str, Any]]]:
    """The stream's runs and the api's, once (with plans) every run ended."""
    if sc.plans:
        left = await settle(api, plane, sc.settle)
        assert left == [], f"runs not terminal {sc.settle}s after the faults: {left}"
    return await read_stream(plane.nats), await api.ok_runs()


def _expected(
    stream_runs: dict[str, str], runs: list[dict[str, Any]], plans: bool
) -> set[tuple[str, str]]:
    """(run, trigger) of every notification due: run:created of every run the stream
    has (a create left unanswered included), and with plans how each ended."""
    want = {(r, "run:created") for r in stream_runs}
    if plans:
        odd = [(r["id"], r["status"]) for r in runs if r["status"] not in ENDED]
        assert odd == [], f"a plan run ended otherwise: {odd}"
        want |= {(r["id"], ENDED[r["status"]]) for r in runs}
    return want


def _by_key(receiver: Receiver) -> dict[tuple[str, str], set[str]]:
    """The RP-Delivery ids received per (run, trigger) (one configuration)."""
    out: dict[tuple[str, str], set[str]] = {}
    for g in receiver.got:
        key = (g.json["run_id"], g.json["notifications"][0]["trigger"])
        out.setdefault(key, set()).add(g.delivery)
    return out


async def _logged_deliveries(nats_side: ClusterNats, config_id: str) -> dict[str, str]:
    """Every delivery of the configuration in the log, with its last outcome."""
    nc = await nats_side.connect()
    try:
        envs = await EventStore(nc).read(nt.delivery_subject(ORG, config_id, "*"))
    finally:
        await nc.close()
    by_delivery: dict[str, list[Any]] = {}
    for env in envs:
        by_delivery.setdefault(env.subject.rsplit(".", 1)[1], []).append(env.event)
    return {d: str(nt.delivery_fold(evs).outcome) for d, evs in by_delivery.items()}


def _latencies(receiver: Receiver, wall: float, t0: float, t1: float) -> dict[str, Any]:
    """Seconds from each event to its first delivery, for events from 1 s before the
    leader's kill (`t0`, monotonic) until the node was back (`t1`)."""
    first: dict[str, float] = {}
    for g in receiver.got:
        first.setdefault(g.delivery, wall + g.at)
    delays = []
    for g in receiver.got:
        if first.get(g.delivery) != wall + g.at:
            continue
        at = _event_at(g)
        if wall + t0 - 1 <= at <= wall + t1:
            delays.append(first[g.delivery] - at)
    delays.sort()
    if not delays:
        return {"events": 0}
    return {
        "events": len(delays),
        "p50": round(delays[len(delays) // 2], 2),
        "max": round(delays[-1], 2),
    }
