"""Retention of terminal runs' logs (issue 25, item 4): a pass records `run.log_pruned`
(the objects with their SHA-256) on the run, then deletes the stored logs; the run's row,
steps and events stay; a run not ended is never touched; replicas racing record it once;
a pass killed after the record finishes the deletion next time; one organization's
setting never reaches another's runs; the chain still verifies; replay rebuilds the same
read model. Real nats-server, the App the composition root builds; logs stored in
`rp-logs` as the executor names them (`<run>/<phase>/<step>.log`). Passes here delete at
once (`grace=0`); the readers' grace is tests/test_retention_race.py's."""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS
from yarl import URL

from events import folder as fo
from events.errors import IllegalTransition
from events.run import CancelRun, LogPruned, PrunedObject, PruneLog, RunState
from infra.eventstore import EventStore
from infra.streams import LOGS_BUCKET
from projections import Projector, replay
from projections.readmodel import ReadModel
from services.app.commands import App
from services.processes.retention import Retention, stored_logs
from services.root.bootstrap import Plane
from tests.api_support import ADMIN_TOKEN, Http, http_fixture  # noqa: F401  # `http`
from tests.audit_support import recorded, verify
from tests.helpers import eventually
from tests.projection_support import ORG, settle, varied_history
from tests.tfe_support import Tfe, new_run, tfe_fixture, uploaded  # noqa: F401  # `tfe`
from tests.ui.support import Ui, ui_fixture  # noqa: F401  # `ui`

V1 = "/api/v1/orgs"


async def dump_of(path: Path) -> dict[str, list[tuple[object, ...]]]:
    async with await ReadModel.open(path) as read:
        return await read.dump()


def log_text(run_id: str) -> bytes:
    return f'{{"stream":"stdout","line":1,"text":"log of {run_id}"}}\n'.encode()


async def store_logs(nc: NATS, run_ids: list[str]) -> None:
    """Two stored step logs per run, as an executor leaves them."""
    store = await nc.jetstream().object_store(LOGS_BUCKET)
    for run_id in run_ids:
        for step in ("checkout", "init"):
            await store.put(f"{run_id}/plan/{step}.log", log_text(run_id))


async def states(app: App, run_ids: list[str]) -> dict[str, RunState]:
    return {r: (await app.load_run("*", None, r)).state for r in run_ids}


async def events_of(store: EventStore, app: App, run_id: str) -> list[Any]:
    subject = (await app.load_run("*", None, run_id)).subject
    return [env.event for env in await store.read(subject)]


async def set_days(app: App, org: str, days: int) -> None:
    changes = {"log_retention_days": days}
    await app.org_command(org, fo.SetOrgSettings(actor="admin", changes=changes))


async def canceled_runs(app: App, org: str, ws: str, count: int) -> list[str]:
    """`count` runs of `org`/`ws` created and canceled at once (terminal, ended now)."""
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


async def test_a_pass_removes_ended_runs_logs_keeps_the_rest_and_replay_agrees(
    app: App, nc: NATS, store: EventStore, tmp_path: Path
) -> None:
    """Retention 0 days: every ended run's stored logs are gone and its events stay with
    one `run.log_pruned` more, naming each object with its SHA-256; the runs still
    waiting or awaiting approval keep theirs. A replay from sequence 1 gives the very rows
    the live projector wrote after the pass."""
    async with Projector(nc, tmp_path / "live.db") as live:
        runs = list((await varied_history(app)).values())
        await store_logs(nc, runs)
        before = await states(app, runs)
        ended = sorted(r for r, s in before.items() if s.terminal)
        open_ = sorted(r for r, s in before.items() if not s.terminal)
        assert ended and open_
        events_before = {r: await events_of(store, app, r) for r in runs}
        await set_days(app, ORG, 0)

        report = await Retention(nc, app, grace=0).pass_once()
        assert sorted(report.pruned) == ended and report.deleted == 2 * len(ended)
        assert sorted(await stored_logs(nc)) == open_
        for run_id in ended:
            evs = await events_of(store, app, run_id)
            assert evs[:-1] == events_before[run_id]  # nothing before it removed
            assert isinstance(evs[-1], LogPruned) and evs[-1].days == 0
            digest = hashlib.sha256(log_text(run_id)).hexdigest()
            assert {(o.name, o.sha256) for o in evs[-1].objects} == {
                (f"{run_id}/plan/checkout.log", digest), (f"{run_id}/plan/init.log", digest),
            }  # fmt: skip
        for run_id in open_:
            assert await events_of(store, app, run_id) == events_before[run_id]
        await settle(live, store)
        live_dump = await live.read.dump()
        row = await live.read.runs.get(ORG, ended[0])
        assert (
            row is not None
            and row["log_removed_at"]
            and row["status"] == str(before[ended[0]].status)
        )
        assert (await live.read.runs.get(ORG, open_[0]) or {})["log_removed_at"] is None
    await replay(nc, tmp_path / "replayed.db")
    assert await dump_of(tmp_path / "replayed.db") == live_dump


async def test_two_replicas_racing_record_each_run_once_and_remove_everything(
    system: Plane, process: Any, nc: NATS, store: EventStore
) -> None:
    """Two passes at once, each on its own process graph: every ended run gets exactly one
    `run.log_pruned`, each run is reported pruned by one pass, no object is left."""
    runs = await canceled_runs(system.app, ORG, "net", 12)
    await store_logs(nc, runs)
    await set_days(system.app, ORG, 0)
    other: Plane = process()
    a, b = await asyncio.gather(
        Retention(nc, system.app, grace=0, concurrency=4).pass_once(),
        Retention(nc, other.app, grace=0, concurrency=4).pass_once(),
    )
    assert sorted(a.pruned + b.pruned) == sorted(runs)
    for run_id in runs:
        pruned = [e for e in await events_of(store, system.app, run_id) if isinstance(e, LogPruned)]
        assert len(pruned) == 1
    assert await stored_logs(nc) == {}


async def test_a_pass_killed_after_its_record_finishes_the_deletion_next_time(
    app: App, nc: NATS, store: EventStore
) -> None:
    """The intent recorded, the objects not yet deleted (a kill between the two lines):
    the next pass deletes them without a second record."""
    (run_id,) = await canceled_runs(app, ORG, "net", 1)
    await store_logs(nc, [run_id])
    state = (await app.load_run(ORG, "net", run_id)).state
    assert state.ended_at is not None
    objects = [PrunedObject(name=f"{run_id}/plan/init.log")]
    intent = PruneLog(actor="retention", objects=objects, ended_before=state.ended_at, days=0)
    await app.run_command(ORG, "net", run_id, intent)
    assert run_id in await stored_logs(nc)

    report = await Retention(nc, app, grace=0).pass_once()
    assert report.pruned == [] and report.deleted == 2
    assert await stored_logs(nc) == {}
    evs = await events_of(store, app, run_id)
    assert sum(isinstance(e, LogPruned) for e in evs) == 1


async def test_one_organizations_setting_never_prunes_anothers_runs(app: App, nc: NATS) -> None:
    """Org a keeps logs 0 days; org b sets nothing (the deployment's 90) and another of
    its runs ended now: a pass removes a's logs only. b setting 0 later prunes b's."""
    ours = await canceled_runs(app, "a", "net", 2)
    theirs = await canceled_runs(app, "b", "net", 2)
    await store_logs(nc, ours + theirs)
    await set_days(app, "a", 0)
    report = await Retention(nc, app, grace=0).pass_once()
    assert sorted(report.pruned) == sorted(ours) and report.kept == 2
    assert sorted(await stored_logs(nc)) == sorted(theirs)
    assert all(s.log_removed_at is None for s in (await states(app, theirs)).values())
    await set_days(app, "b", 0)
    assert sorted((await Retention(nc, app, grace=0).pass_once()).pruned) == sorted(theirs)


async def test_the_deployment_default_applies_where_an_org_sets_nothing(app: App, nc: NATS) -> None:
    """`--log-retention-days 0` for the deployment prunes an org that sets nothing; an
    org that sets more keeps its logs."""
    ours = await canceled_runs(app, "a", "net", 1)
    theirs = await canceled_runs(app, "b", "net", 1)
    await store_logs(nc, ours + theirs)
    await set_days(app, "b", 30)
    report = await Retention(nc, app, grace=0, default_days=0).pass_once()
    assert report.pruned == ours and sorted(await stored_logs(nc)) == theirs


def test_the_core_prunes_only_an_ended_run_before_the_cutoff_and_once() -> None:
    """`PruneLog` is refused for a run not ended, one that ended after the cutoff, and a
    second time."""
    from datetime import UTC, datetime, timedelta

    from events.run import Status, decide, evolve

    now = datetime(2026, 1, 1, tzinfo=UTC)
    cmd = PruneLog(actor="retention", objects=[], ended_before=now, days=0)
    ended = RunState(run_id="r", status=Status.APPLIED, ended_at=now - timedelta(days=1))

    def ids() -> str:
        return "x"

    with pytest.raises(IllegalTransition):
        decide(RunState(run_id="r", status=Status.AWAITING_APPROVAL), cmd, now=now, new_id=ids)
    late = PruneLog(actor="retention", objects=[], ended_before=now - timedelta(days=2), days=2)
    with pytest.raises(IllegalTransition):
        decide(ended, late, now=now, new_id=ids)
    (event,) = decide(ended, cmd, now=now, new_id=ids)
    pruned = evolve(ended, event)
    assert pruned.log_removed_at == now and pruned.updated_at == ended.updated_at
    with pytest.raises(IllegalTransition):
        decide(pruned, cmd, now=now, new_id=ids)


async def test_a_pass_is_on_the_audit_record_and_the_chain_still_verifies(
    system: Plane, app: App, nc: NATS
) -> None:
    """The auditor records each `run.log_pruned` (actor retention, a system actor, with
    the event's sequence and hash); `audit verify` passes after the pass."""
    await system.start_auditor(checkpoint_s=0.1)
    runs = await canceled_runs(app, ORG, "net", 3)
    await store_logs(nc, runs)
    await set_days(app, ORG, 0)
    await Retention(nc, app, grace=0).pass_once()
    records = await recorded(nc, ORG, "run.log_pruned", 3)
    assert {r["thing"] for r in records} == {f"run net/{r}" for r in runs}
    assert all(r["actor"] == "retention" and r["actor_kind"] == "system" for r in records)
    assert all(len(r["src_hash"]) == 64 for r in records)
    code, out = await verify(nc)
    assert code == 0, out


async def test_a_removed_log_answers_410_and_the_run_says_when(
    http: Http, app: App, nc: NATS
) -> None:
    """GET logs of a pruned run: 410 `log-removed` naming the date; the run's answer has
    `log_removed_at`; its steps and events still answer; a run not ended still reads."""
    runs = await varied_history(app)
    await store_logs(nc, list(runs.values()))
    await set_days(app, ORG, 0)
    await Retention(nc, app, grace=0).pass_once()
    run_id = runs["applied"]

    async def projected() -> dict[str, Any]:
        a = await http.get(f"{V1}/{ORG}/runs/{run_id}")
        assert a.body["log_removed_at"], a.body
        return a.body  # type: ignore[no-any-return]  # JSON object

    run = await eventually(projected, what="the pruned run projected")
    assert run["status"] == "applied"
    a = await http.get(f"{V1}/{ORG}/runs/{run_id}/logs")
    body = a.problem("log-removed", 410)
    assert body["detail"] == f"log removed by retention on {run['log_removed_at'][:10]}"
    follow = await http.get(f"{V1}/{ORG}/runs/{run_id}/logs?follow=1")
    follow.problem("log-removed", 410)
    events = await http.get(f"{V1}/{ORG}/runs/{run_id}/events")
    assert "run.log_pruned" in [e["type"] for e in events.body["items"]]
    assert "run.created" in [e["type"] for e in events.body["items"]]
    states_ = await states(app, list(runs.values()))
    waiting = next(r for r, s in states_.items() if not s.terminal)
    assert (await http.get(f"{V1}/{ORG}/runs/{waiting}/logs")).status == 200


@pytest.mark.parametrize("value", [-1, 36501, 10**30, "7", 1.5, True, [90], {"d": 1}])
async def test_a_hostile_retention_value_is_a_422_problem(http: Http, value: Any) -> None:
    """Negative, huge (a timedelta past its range would stop every org's pass), not an
    integer: 422 invalid-command, and the value set before stays."""
    await http.org("a")
    ok = await http.call("PATCH", f"{V1}/a/settings", json={"log_retention_days": 30})
    assert ok.status == 200, ok.body
    a = await http.call("PATCH", f"{V1}/a/settings", json={"log_retention_days": value})
    a.problem("invalid-command", 422)
    got = await http.get(f"{V1}/a/settings")
    assert got.body["settings"]["log_retention_days"] == 30
    assert got.body["effective"]["log_retention_days"] == {"value": 30, "origin": "org"}


async def test_retention_is_the_organizations_setting_alone(http: Http) -> None:
    """A workspace or a folder may not set it (422), and org b's admin cannot set org
    a's (refused): nobody but a's admins decides how long a keeps its logs."""
    await http.org("a")
    tokens_b = await http.org("b")
    await http.workspace("a", "net")
    body = {"log_retention_days": 0}
    a = await http.call("PATCH", f"{V1}/a/workspaces/net/settings", json=body)
    a.problem("invalid-command", 422)
    other = await http.call("PATCH", f"{V1}/a/settings", json=body, token=tokens_b["admin"])
    assert other.status in (403, 404), other.body
    ok = await http.call("PATCH", f"{V1}/a/settings", json=body)
    assert ok.status == 200 and ok.body["settings"]["log_retention_days"] == 0


@pytest.mark.slow
async def test_retention_pass_rate(app: App, nc: NATS) -> None:
    """The figure: runs pruned per second by one pass (printed; README's figure)."""
    runs = [r for i in range(6) for r in await canceled_runs(app, ORG, f"w{i}", 50)]
    await store_logs(nc, runs)
    await set_days(app, ORG, 0)
    started = time.perf_counter()
    report = await Retention(nc, app, grace=0).pass_once()
    rate = len(report.pruned) / (time.perf_counter() - started)
    print(f"\nretention pass: {len(report.pruned)} runs in {report.seconds:.2f} s, {rate:.0f}/s")
    assert len(report.pruned) == 300


async def test_the_ui_says_when_retention_removed_a_runs_log(ui: Ui, app: App, nc: NATS) -> None:
    """The run page and the log page of a pruned run say "Log removed by retention on
    <date>" (no log to follow); a run not ended still offers its log."""
    runs = await varied_history(app)
    await store_logs(nc, list(runs.values()))
    await set_days(app, ORG, 0)
    await Retention(nc, app, grace=0).pass_once()
    run_id = runs["applied"]
    browser = ui.browser()
    await browser.signin(ADMIN_TOKEN, ORG)

    async def said() -> str:
        page = await browser.get(f"/orgs/{ORG}/runs/{run_id}")
        assert page.status == 200 and "Log removed by retention on 20" in page.text, page.text
        return page.text

    text = await eventually(said, what="the run page saying its log is removed")
    assert 'id="log"' not in text and "The whole log as a page" not in text
    log_page = await browser.get(f"/orgs/{ORG}/runs/{run_id}/log")
    assert log_page.status == 200 and "Log removed by retention on 20" in log_page.text
    states_ = await states(app, list(runs.values()))
    waiting = next(r for r, s in states_.items() if not s.terminal)
    other = await browser.get(f"/orgs/{ORG}/runs/{waiting}")
    assert "The whole log as a page" in other.text and "Log removed" not in other.text


async def test_the_terraform_cli_reads_that_the_log_was_removed(tfe: Tfe) -> None:
    """A pruned run's plan log through the TFE API's log-read-url says so (and ends)
    instead of answering nothing for the CLI to wait on."""
    await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    cv, _ = await uploaded(tfe, ws_id)
    run = (await new_run(tfe, ws_id, cv)).body["data"]
    _, ws, run_id = run["id"].removeprefix("run-").split(".")
    canceled = await tfe.tfe("POST", f"/api/v2/runs/{run['id']}/actions/cancel", json={})
    assert canceled.status in (200, 202), canceled
    state = (await tfe.app.load_run("acme", ws, run_id)).state
    assert state.ended_at is not None
    intent = PruneLog(actor="retention", objects=[], ended_before=state.ended_at, days=0)
    await tfe.app.run_command("acme", ws, run_id, intent)
    plan_id = run["relationships"]["plan"]["data"]["id"]
    plan = await tfe.tfe("GET", f"/api/v2/plans/{plan_id}")
    url = URL(plan.body["data"]["attributes"]["log-read-url"])
    status, raw = await tfe.raw(f"{url.path}?offset=0&limit=4096")
    assert status == 200 and raw.endswith(b"\x03"), raw
    assert f"log removed by retention on {state.ended_at.date()}".encode() in raw
