"""kill -9, at random points, of the api, the scheduler, the executor and nats-server,
while apply runs go through the HTTP API with real Terraform (null provider).

Afterwards: every run is terminal (and while the faults went on, every open run had a
live owner or a deadline); no run whose create was answered 2xx is missing from the
event stream or the read model; no apply ran twice, counted from the state versions
and from Terraform's own output; `runplane replay` into a fresh file rebuilds the very
rows the live api's projector wrote.

The seed is printed (`pytest -s`); `RUNPLANE_CHAOS_SEED=<n>` replays a schedule.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.reliability.chaos_support import (
    OPEN,
    ORG,
    TERMINAL,
    Api,
    Fault,
    Plane,
    Witness,
    Workload,
    applies_from_terraform,
    check_runs,
    diff_dumps,
    inject_faults,
    read_stream,
    replay_identity,
    settle,
    setup_org,
    state_versions_by_run,
    watch_crashes,
)

pytestmark = pytest.mark.terraform

KINDS = ["api", "scheduler", "executor", "nats"]


@dataclass
class Scenario:
    runs: int
    workspaces: int
    faults_per_kind: int
    gap: tuple[float, float]  # seconds between faults
    settle: float  # seconds allowed, after the last fault, for every run to end
    run_timeout: int
    heartbeat_timeout: int = 4
    approval_timeout: int = 60


SHORT = Scenario(
    runs=8, workspaces=3, faults_per_kind=2, gap=(0.5, 2.5), settle=60, run_timeout=240
)
FULL = Scenario(
    runs=60, workspaces=5, faults_per_kind=8, gap=(3.0, 9.0), settle=180, run_timeout=900
)


def seed() -> int:
    return int(os.environ.get("RUNPLANE_CHAOS_SEED") or random.SystemRandom().randrange(10**6))


@pytest.mark.slow
async def test_chaos_short(tmp_path: Path) -> None:
    await chaos(tmp_path, SHORT, seed())


@pytest.mark.slow
@pytest.mark.timeout(1800)
async def test_chaos_full(tmp_path: Path) -> None:
    await chaos(tmp_path, FULL, seed())


async def chaos(tmp_path: Path, sc: Scenario, seed: int) -> None:
    print(f"\nchaos seed {seed} (RUNPLANE_CHAOS_SEED={seed} replays the schedule)", flush=True)
    rng = random.Random(seed)
    started = time.monotonic()
    plane = await Plane.start(tmp_path / "plane")
    api = Api(plane.base)
    witness = await Witness().start()
    summary: dict[str, Any] = {"seed": seed}
    try:
        workspaces = [f"ws{i}" for i in range(sc.workspaces)]
        limits = {"run_timeout": sc.run_timeout, "approval_timeout": sc.approval_timeout}
        await setup_org(api, tmp_path, workspaces, limits, witness)
        for ws in workspaces:
            await api.ok(
                "PATCH",
                f"/api/v1/orgs/{ORG}/workspaces/{ws}/settings",
                {"heartbeat_timeout": sc.heartbeat_timeout},
            )
        plan = KINDS * sc.faults_per_kind
        rng.shuffle(plan)
        work = Workload(api, workspaces, sc.runs, rng)
        stop = asyncio.Event()
        background = [
            asyncio.create_task(work.creator()),
            asyncio.create_task(work.approver(stop)),
            asyncio.create_task(watch_crashes(plane, stop)),
        ]
        orphans: list[dict[str, Any]] = []  # open, no owner, no deadline, and stuck so
        glimpses: list[dict[str, Any]] = []  # seen so once, moving on or covered after
        stalls: list[dict[str, Any]] = []  # still so 10 s later, not 40 s later
        rechecks: list[asyncio.Task[None]] = []

        async def recheck(seen: dict[str, Any]) -> None:
            # The scheduler writes a deadline a moment after `run.created`, or once it has
            # the event again: events a killed scheduler had fetched but not acknowledged
            # come back after the consumer's ack_wait (30 s). Stuck for 40 s is orphaned.
            for wait, record in ((10, stalls), (30, orphans)):
                await asyncio.sleep(wait)
                code, now = await api.call("GET", f"/api/v1/orgs/{ORG}/runs/{seen['id']}")
                stuck = code == 200 and now["status"] == seen["status"]
                if not stuck or now["owner"] or now["deadline"]:
                    then = now["status"] if code == 200 else code
                    glimpses.append(seen | {"then": then, "after_s": wait})
                    return
                record.append(seen)

        async def after(fault: Fault) -> None:
            # Once a fault is over: every open run has a live owner or a deadline.
            await asyncio.sleep(rng.uniform(0, 2))
            for seen in await open_runs_without_owner_or_deadline(api):
                seen["after_fault"] = len(plane.faults)
                rechecks.append(asyncio.create_task(recheck(seen)))

        await inject_faults(plane, api, work, rng, plan, sc.gap, after)
        work.faults_done.set()
        chaos_s = time.monotonic() - started
        await asyncio.wait_for(work.done.wait(), sc.settle)
        left = await settle(api, plane, sc.settle)
        await asyncio.gather(*rechecks)
        stop.set()
        await asyncio.gather(*background)
        settle_s = time.monotonic() - started - chaos_s

        # The writers stop; the api's projector reaches the end of the stream.
        for c in (plane.executor, plane.scheduler):
            code = await c.stop()
            assert code == 0, f"{c.role} exited {code}: {c.output()[-3000:]}"
        stream = await read_stream(plane.nats.url)
        await api.ok("GET", f"/api/v1/orgs/{ORG}/runs?limit=1", min_seq=stream.last_seq)
        runs = await api.all_runs()
        assert runs is not None
        state_versions = await state_versions_by_run(api, workspaces)
        (live,), replayed = await replay_identity(plane, tmp_path)
        strays = [_cmd(p) for p in plane.strays()]  # every component has stopped
        # How long what a lone executor kill left running lived on (None: still running).
        orphan_lifetimes = [t.result() if t.done() else None for t in plane.orphans]
        for t in plane.orphans:
            t.cancel()
        applies_tf = applies_from_terraform(witness)
        summary["isolation"] = plane.isolation()
        statuses = Counter(r["status"] for r in runs)
        summary |= {
            "runs": len(runs),
            "runs_created_2xx": len(work.created),
            "runs_in_stream": len(stream.runs),
            "create_unanswered": work.create_unanswered,
            "create_refused": dict(work.create_refused),
            "approvals": work.approvals,
            "approve_errors": dict(work.approve_errors),
            "faults": dict(Counter(f.kind for f in plane.faults)),
            "crashes": plane.crashes,
            "executor_killed_alone": len(orphan_lifetimes),
            "its_children_lived_s": orphan_lifetimes,
            "strays_at_end": strays,
            "statuses": dict(statuses),
            "failure_reasons": dict(
                Counter(str(r.get("reason")) for r in runs if r["status"] == "failed")
            ),
            "applies_terraform": sum(applies_tf.values()),
            "state_versions": sum(stream.state_versions.values()),
            "open_without_owner_or_deadline": orphans,
            "glimpsed_without_owner_or_deadline": glimpses,
            "without_owner_or_deadline_10s_later": stalls,
            "not_terminal": left,
            "chaos_s": round(chaos_s, 1),
            "settle_s": round(settle_s, 1),
            "total_s": round(time.monotonic() - started, 1),
            "fault_log": [
                {"kind": f.kind, "down_s": f.down_s, "back_s": f.recovered_s, "note": f.note}
                for f in plane.faults
            ],
        }
        out = tmp_path / "last_chaos.json"
        out.write_text(json.dumps(summary, indent=2))
        brief = {k: v for k, v in summary.items() if k != "fault_log"}
        print("chaos summary:", json.dumps(brief), f"(full log: {out})", flush=True)

        assert not plane.crashes, plane.crashes
        assert not orphans, f"open runs with neither a live owner nor a deadline: {orphans}"
        assert left == [], f"runs not terminal {sc.settle}s after the faults: {left}"
        # No run lost; no apply twice (state versions in the stream and the API,
        # Terraform's own output).
        check_runs(runs, work.created, stream, state_versions, applies_tf, sc.runs)
        # Replay identity.
        assert diff_dumps(live, replayed) == []
    finally:
        witness.close()
        await api.close()
        await plane.kill_all()


def _cmd(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return str(pid)


async def open_runs_without_owner_or_deadline(api: Api) -> list[dict[str, Any]]:
    """Open runs whose GET shows neither `owner` nor `deadline` (run_timeout gives every
    open run a deadline once the scheduler has seen it: none may be left without)."""
    out = []
    for r in await api.ok_runs(OPEN):
        code, got = await api.call("GET", f"/api/v1/orgs/{ORG}/runs/{r['id']}")
        if code == 200 and got["status"] not in TERMINAL and not (got["owner"] or got["deadline"]):
            out.append({"id": r["id"], "status": got["status"]})
    return out
