"""Record retention (issue 25, item 4): after an organization's `record_retention_days`, a
pass removes a terminal, unreferenced run's whole record: `run.removed` first (the objects
with their buckets and SHA-256), then its read-model rows (the projection, on that event)
and its stored logs and plan. Its events stay. A replay rebuilds the same read model; a
kill between the event and the deletes is finished by the next pass; two passes racing
remove each run once; a referenced run (the workspace's state head) stays; one
organization's setting never reaches another's runs; reads answer 410 `run-removed`.

Real nats-server, the App the composition root builds, logs and plans stored in their
buckets as the executor names them; the pass's clock two days ahead of the runs'."""

from __future__ import annotations

import asyncio
import hashlib
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client as NATS

from events import folder as fo
from events.errors import IllegalTransition
from events.run import CancelRun, LogPruned, RemoveRun, RunRemoved, RunState
from executor.statestore import Head, ws_key
from infra.eventstore import EventStore
from infra.ids import utcnow
from infra.kv import STATE_HEAD_BUCKET
from infra.streams import LOGS_BUCKET, PLANS_BUCKET
from projections import Projector, replay
from projections.readmodel import ReadModel
from services.app.commands import App
from services.processes.removal import listed
from services.processes.retention import Retention, stored_logs
from services.root.bootstrap import Plane
from services.surfaces.tfe import ids
from tests.api_support import ADMIN_TOKEN, Http, http_fixture  # noqa: F401  # `http`
from tests.audit_support import recorded, verify
from tests.helpers import eventually
from tests.projection_support import ORG, settle, varied_history
from tests.tfe_support import Tfe, tfe_fixture  # noqa: F401  # `tfe`
from tests.ui.support import Ui, ui_fixture  # noqa: F401  # `ui`

V1 = "/api/v1/orgs"
RUN_TABLES = ("runs", "steps", "changes", "resource_states")


def ahead(app: App, days: float = 2) -> None:
    """The App's clock `days` ahead of now (the runs ended "days ago")."""
    app.clock = lambda: utcnow() + timedelta(days=days)  # type: ignore[method-assign]  # a test's clock


def body(name: str) -> bytes:
    return f'{{"stream":"stdout","line":1,"text":"{name}"}}\n'.encode()


async def store_objects(nc: NATS, run_ids: list[str]) -> None:
    """Two step logs and a saved plan per run, named as the executor names them."""
    js = nc.jetstream()
    logs, plans = await js.object_store(LOGS_BUCKET), await js.object_store(PLANS_BUCKET)
    for run_id in run_ids:
        for step in ("checkout", "init"):
            await logs.put(f"{run_id}/plan/{step}.log", body(f"{run_id} {step}"))
        await plans.put(f"{run_id}.tfplan", body(f"{run_id} plan"))


async def objects_of(nc: NATS, run_id: str) -> list[str]:
    """The run's objects still stored (not deleted), as `bucket/name`."""
    out = []
    for bucket in (LOGS_BUCKET, PLANS_BUCKET):
        out += [f"{bucket}/{i.name}" for i in await listed(nc, bucket) if i.name.startswith(run_id)]
    return sorted(out)


async def set_org(app: App, org: str, **changes: Any) -> None:
    await app.org_command(org, fo.SetOrgSettings(actor="admin", changes=changes))


async def state(app: App, run_id: str) -> RunState:
    return (await app.load_run("*", None, run_id)).state


async def events_of(store: EventStore, app: App, run_id: str) -> list[Any]:
    subject = (await app.load_run("*", None, run_id)).subject
    return [env.event for env in await store.read(subject)]


async def canceled(app: App, org: str, ws: str, count: int) -> list[str]:
    from events.values import Workspace

    if not (await app.load_org(org)).state.exists:
        await app.create_org(org, "admin")
    await app.create_workspace(org, ws, Workspace(repository="/repo"), "alice")
    out = []
    for _ in range(count):
        run_id = str((await app.create_run(org, ws, "plan", "alice")).state.run_id)
        await app.run_command(org, ws, run_id, CancelRun(actor="alice"))
        out.append(run_id)
    return out


async def put_head(nc: NATS, ws: str, run_id: str) -> None:
    """The workspace's current state version, written by `run_id` (its state head)."""
    kv = await nc.jetstream().key_value(STATE_HEAD_BUCKET)
    head = Head(object=f"{ORG}/{ws}/1", serial=1, digest="0" * 64, run_id=run_id)
    await kv.put(ws_key(ORG, ws), msgspec.json.encode(head))


async def test_a_pass_removes_whole_records_after_a_log_prune_and_replay_rebuilds_the_same(
    app: App, nc: NATS, store: EventStore, tmp_path: Path
) -> None:
    """First a log prune (log_retention_days 0), then record retention 1 day with the
    clock 2 days on: every ended run but the state head's is removed whole (rows gone, a
    tombstone, its logs and plan gone, its events kept plus `run.removed` naming each
    object with its bucket and SHA-256); runs not ended and the head's run keep all.
    A replay of the whole stream after each pass gives the live projector's rows."""
    async with Projector(nc, tmp_path / "live.db") as live:
        runs = await varied_history(app)
        ids = sorted(runs.values())
        await store_objects(nc, ids)
        await put_head(nc, "net", runs["applied"])
        states = {r: await state(app, r) for r in ids}
        ended = sorted(r for r in ids if states[r].terminal)
        await set_org(app, ORG, log_retention_days=0)
        first = await Retention(nc, app, grace=0).pass_once()
        assert sorted(first.pruned) == ended and first.removed == []
        await settle(live, store)
        await replay(nc, tmp_path / "after-prune.db")
        async with await ReadModel.open(tmp_path / "after-prune.db") as replayed:
            assert await replayed.dump() == await live.read.dump()

        before = {r: await events_of(store, app, r) for r in ids}
        await set_org(app, ORG, record_retention_days=1)
        ahead(app)
        report = await Retention(nc, app, grace=0).pass_once()
        gone = sorted(r for r in ended if r != runs["applied"])
        assert sorted(report.removed) == gone and report.referenced == 1
        assert report.removed_objects == len(gone)  # the plans: the logs went with the prune
        await settle(live, store)
        for run_id in gone:
            evs = await events_of(store, app, run_id)
            assert evs[:-1] == before[run_id] and isinstance(evs[-1], RunRemoved)
            named = {(o.bucket, o.name, o.sha256) for o in evs[-1].objects}
            assert (
                PLANS_BUCKET,
                f"{run_id}.tfplan",
                hashlib.sha256(body(f"{run_id} plan")).hexdigest(),
            ) in named
            assert await objects_of(nc, run_id) == []
            assert await live.read.runs.get(ORG, run_id) is None
            assert await live.read.runs.steps(ORG, run_id) == []
            assert await live.read.runs.removed_at(ORG, run_id)
        for run_id in sorted(set(ids) - set(gone)):
            assert await live.read.runs.get(ORG, run_id) is not None
            assert await events_of(store, app, run_id) == before[run_id]
        assert await objects_of(nc, runs["queued"]) != []
        live_dump = await live.read.dump()
        assert {row[0] for row in live_dump["removed_runs"]} == set(gone)
    await replay(nc, tmp_path / "after-removal.db")
    async with await ReadModel.open(tmp_path / "after-removal.db") as replayed:
        assert await replayed.dump() == live_dump


async def test_a_pass_killed_after_the_event_is_finished_by_the_next(
    app: App, nc: NATS, store: EventStore
) -> None:
    """`run.removed` recorded, nothing deleted (a kill between the two lines): the next
    pass deletes the objects and records nothing more."""
    (run_id,) = await canceled(app, ORG, "net", 1)
    await store_objects(nc, [run_id])
    ended = (await state(app, run_id)).ended_at
    assert ended is not None
    intent = RemoveRun(actor="retention", objects=[], ended_before=ended, days=1)
    await app.run_command(ORG, "net", run_id, intent)
    assert len(await objects_of(nc, run_id)) == 3
    await set_org(app, ORG, record_retention_days=1)
    ahead(app)
    report = await Retention(nc, app, grace=0).pass_once()
    assert report.removed == [] and report.removed_objects == 3
    assert await objects_of(nc, run_id) == [] and await stored_logs(nc) == {}
    evs = await events_of(store, app, run_id)
    assert sum(isinstance(e, RunRemoved) for e in evs) == 1
    assert not any(isinstance(e, LogPruned) for e in evs)  # (the log pass left it alone)


async def test_two_passes_racing_on_two_processes_remove_each_run_once(
    system: Plane, process: Any, nc: NATS, store: EventStore
) -> None:
    """Two passes at once, each on its own process graph: one `run.removed` per run, each
    run reported by one pass, every object gone."""
    runs = await canceled(system.app, ORG, "net", 10)
    await store_objects(nc, runs)
    await set_org(system.app, ORG, record_retention_days=1)
    other: Plane = process()
    ahead(system.app)
    ahead(other.app)
    a, b = await asyncio.gather(
        Retention(nc, system.app, grace=0, concurrency=4).pass_once(),
        Retention(nc, other.app, grace=0, concurrency=4).pass_once(),
    )
    assert sorted(a.removed + b.removed) == sorted(runs)
    for run_id in runs:
        evs = await events_of(store, system.app, run_id)
        assert sum(isinstance(e, RunRemoved) for e in evs) == 1
        assert await objects_of(nc, run_id) == []


async def test_one_organizations_setting_never_removes_anothers_runs(
    app: App, nc: NATS, store: EventStore
) -> None:
    """Attack: org a keeps records 1 day; org b sets nothing (the deployment's 0: for
    ever), its workspace and runs named like a's. A pass removes a's runs only: b's
    rows, events and objects stay, whatever a sets (a's settings name no other org)."""
    ours = await canceled(app, "a", "net", 2)
    theirs = await canceled(app, "b", "net", 2)
    await store_objects(nc, ours + theirs)
    await set_org(app, "a", record_retention_days=1, log_retention_days=0)
    ahead(app, days=60)  # (within the deployment's 90 days of logs: b sets nothing)
    report = await Retention(nc, app, grace=0).pass_once()
    assert sorted(report.removed) == sorted(ours)
    for run_id in theirs:
        s = await state(app, run_id)
        assert s.removed_at is None and s.log_removed_at is None
        assert len(await objects_of(nc, run_id)) == 3
    # the deployment's default reaches b only where b sets nothing, and b's own 0 wins
    await set_org(app, "b", record_retention_days=0)
    again = await Retention(nc, app, grace=0, record_days=1).pass_once()
    assert again.removed == []
    for run_id in theirs:
        assert (await state(app, run_id)).removed_at is None


def test_the_core_removes_only_an_ended_run_before_the_cutoff_and_once() -> None:
    """`RemoveRun` is refused for a run not ended, one ended after the cutoff, and a
    second time; once removed, a run takes no command (a log prune neither)."""
    from datetime import UTC, datetime

    from events.run import PruneLog, Status, decide, evolve

    now = datetime(2026, 1, 1, tzinfo=UTC)
    cmd = RemoveRun(actor="retention", objects=[], ended_before=now, days=1)
    ended = RunState(run_id="r", status=Status.APPLIED, ended_at=now - timedelta(days=1))

    def ids() -> str:
        return "x"

    with pytest.raises(IllegalTransition):
        decide(RunState(run_id="r", status=Status.PLANNING), cmd, now=now, new_id=ids)
    late = RemoveRun(actor="retention", objects=[], ended_before=now - timedelta(days=2), days=2)
    with pytest.raises(IllegalTransition):
        decide(ended, late, now=now, new_id=ids)
    (event,) = decide(ended, cmd, now=now, new_id=ids)
    assert isinstance(event, RunRemoved) and event.rows == list(RUN_TABLES)
    removed = evolve(ended, event)
    assert removed.removed_at == now and removed.updated_at == ended.updated_at
    prune = PruneLog(actor="retention", objects=[], ended_before=now, days=0)
    for again in (cmd, prune):
        with pytest.raises(IllegalTransition):
            decide(removed, again, now=now, new_id=ids)


async def test_reads_of_a_removed_run_are_410_and_anothers_org_404(
    http: Http, app: App, nc: NATS
) -> None:
    """GET of a removed run and of its steps, changes, resources, events and logs: 410
    `run-removed` saying when and that its events stay; the org's run list leaves it out;
    org b's admin asking for it (in a's path or b's) gets 404, as for any run not b's."""
    tokens_b = await http.org("b")
    (run_id,) = await canceled(app, ORG, "net", 1)
    await set_org(app, ORG, record_retention_days=1)
    ahead(app)
    assert (await Retention(nc, app, grace=0).pass_once()).removed == [run_id]
    path = f"{V1}/{ORG}/runs/{run_id}"

    async def gone() -> dict[str, Any]:
        return (await http.get(path)).problem("run-removed", 410)

    problem = await eventually(gone, what="the removal projected")
    assert problem["detail"].startswith(f"run {run_id} was removed by retention on 20")
    assert "events stay" in problem["detail"] and problem["removed_at"]
    for part in ("/steps", "/changes", "/resources", "/events", "/logs", "/logs?follow=1"):
        (await http.get(path + part)).problem("run-removed", 410)
    listed = (await http.get(f"{V1}/{ORG}/runs")).body["items"]
    assert run_id not in [r["id"] for r in listed]
    (await http.get(path, token=tokens_b["admin"])).problem("not-found", 404)
    (await http.get(f"{V1}/b/runs/{run_id}", token=tokens_b["admin"])).problem("not-found", 404)


@pytest.mark.parametrize("value", [-1, 36501, 10**30, "7", 1.5, True, [1], {"d": 1}])
async def test_a_hostile_record_retention_value_is_a_422_problem(http: Http, value: Any) -> None:
    """Negative, huge, not an integer: 422 invalid-command, the value before stays; a
    workspace may not set it (the organization's alone)."""
    await http.org("a")
    await http.workspace("a", "net")
    ok = await http.call("PATCH", f"{V1}/a/settings", json={"record_retention_days": 30})
    assert ok.status == 200, ok.body
    bad = await http.call("PATCH", f"{V1}/a/settings", json={"record_retention_days": value})
    bad.problem("invalid-command", 422)
    ws = await http.call(
        "PATCH", f"{V1}/a/workspaces/net/settings", json={"record_retention_days": 1}
    )
    ws.problem("invalid-command", 422)
    got = await http.get(f"{V1}/a/settings")
    assert got.body["effective"]["record_retention_days"] == {"value": 30, "origin": "org"}


async def test_removals_are_on_the_audit_record_listing_what_went_and_verify_passes(
    system: Plane, app: App, nc: NATS
) -> None:
    """Each `run.removed` is a record of the org's chain (actor retention, system) whose
    detail lists the rows and each object with its bucket and SHA-256; `audit verify`
    passes after the passes (the events stay: nothing of the chain's sources is gone)."""
    await system.start_auditor(checkpoint_s=0.1)
    runs = await canceled(app, ORG, "net", 2)
    await store_objects(nc, runs)
    await set_org(app, ORG, record_retention_days=1, log_retention_days=0)
    ahead(app)
    await Retention(nc, app, grace=0).pass_once()
    records = await recorded(nc, ORG, "run.removed", 2)
    assert {r["thing"] for r in records} == {f"run net/{r}" for r in runs}
    for r in records:
        run_id = r["thing"].split("/")[1]
        digest = hashlib.sha256(body(f"{run_id} plan")).hexdigest()
        assert r["actor"] == "retention" and r["actor_kind"] == "system"
        assert "rows: runs, steps, changes, resource_states" in r["detail"]
        assert f"{PLANS_BUCKET}/{run_id}.tfplan sha256:{digest}" in r["detail"]
    code, out = await verify(nc)
    assert code == 0, out


@pytest.mark.slow
async def test_record_removal_pass_rate(app: App, nc: NATS) -> None:
    """The figure: runs removed whole per second by one pass (printed; README's figure)."""
    runs = [r for i in range(6) for r in await canceled(app, ORG, f"w{i}", 50)]
    await store_objects(nc, runs)
    await set_org(app, ORG, record_retention_days=1)
    ahead(app)
    started = time.perf_counter()
    report = await Retention(nc, app, grace=0).pass_once()
    rate = len(report.removed) / (time.perf_counter() - started)
    print(
        f"\nrecord removal pass: {len(report.removed)} runs ({report.removed_objects} objects)"
        f" in {report.seconds:.2f} s, {rate:.0f}/s"
    )
    assert len(report.removed) == 300 and report.removed_objects == 900


async def removed_run(app: App, nc: NATS) -> str:
    """A canceled run of acme/net, removed whole by a pass (the clock two days on)."""
    (run_id,) = await canceled(app, ORG, "net", 1)
    await set_org(app, ORG, record_retention_days=1)
    ahead(app)
    assert (await Retention(nc, app, grace=0).pass_once()).removed == [run_id]
    return run_id


async def test_the_ui_says_a_removed_run_is_gone(ui: Ui, app: App, nc: NATS) -> None:
    """The run page, its log page and its live feed of a removed run: 410 with the
    removal's date, not a page of nothing (nor a 404 as for a run that never was)."""
    run_id = await removed_run(app, nc)
    browser = ui.browser()
    await browser.signin(ADMIN_TOKEN, ORG)

    async def said() -> str:
        page = await browser.get(f"/orgs/{ORG}/runs/{run_id}")
        assert page.status == 410 and "removed by retention on 20" in page.text, page.text
        return page.text

    await eventually(said, what="the run page saying it is removed")
    for part in ("/log", "/live"):
        page = await browser.get(f"/orgs/{ORG}/runs/{run_id}{part}")
        assert page.status == 410, (part, page.status, page.text[:300])


async def test_the_tfe_api_answers_410_for_a_removed_run(tfe: Tfe) -> None:
    """The Terraform CLI's view of a removed run (folded from its events, which stay):
    410, not the run as if nothing were removed; its plan's log too."""
    await tfe.org(ORG)
    run_id = await removed_run(tfe.app, tfe.app.store.nc)
    tfe_id = ids.run_object_id("run", ORG, "net", run_id)
    got = await tfe.tfe("GET", f"/api/v2/runs/{tfe_id}")
    assert got.status == 410, got.body
    assert "removed by retention" in str(got.body)
    plan = await tfe.tfe("GET", f"/api/v2/plans/{ids.run_object_id('plan', ORG, 'net', run_id)}")
    assert plan.status == 410, plan.body
