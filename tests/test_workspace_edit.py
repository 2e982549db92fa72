"""Workspaces change and go: PATCH of the configuration (`ws.config_changed`), DELETE while
no run is open, purge to free the name; a delete racing a run's creation never leaves a
run on a deleted workspace; and the attacks (another organization's admin, an operator,
a repository inside runplane's data directory). Core given/when/then first, then the API
over a real nats-server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import nats
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from nats.aio.client import Client as NATS

from events import notification as nt
from events import run as run_agg
from events import workspace as ws_agg
from events.errors import AlreadyExists, Deleted, IllegalTransition, Invalid
from events.run import Status, Workspace
from events.workspace import (
    ChangeConfig,
    ConfigChanged,
    CreateWorkspace,
    DeleteWorkspace,
    EnqueueRun,
    PurgeWorkspace,
    RunEnqueued,
    WorkspaceCreated,
    WorkspaceDeleted,
    WorkspacePurged,
)
from infra import streams
from infra.eventstore import LATEST, Append, EventStore
from infra.kv import SECRETS_BUCKET, STATE_HEAD_BUCKET
from projections import replay
from projections.readmodel import ReadModel
from services.app import repositories
from services.app.commands import App
from services.app.execute import Result
from services.processes.notifications import outbox
from services.processes.schedules import store as schedule_store
from services.processes.triggers import graph
from services.surfaces.api.context import API
from tests.api_support import ADMIN_TOKEN, Http
from tests.bootstrap_support import Process, System, built
from tests.cluster_support import NatsCluster
from tests.gwt import NOW
from tests.helpers import kv_keys
from tests.vcs_support import connection

V1 = "/api/v1"
WS = f"{V1}/orgs/acme/workspaces/net"
REPO = "https://git.example.com/acme/net.git"
CONFIG = Workspace(repository=REPO)
DATA: web.AppKey[str] = web.AppKey("test.data_dir", str)  # the API's data directory


def _ids() -> str:
    return "id-1"


def _fold(*events: ws_agg.WorkspaceEvent) -> ws_agg.WorkspaceState:
    return ws_agg.fold(list(events))


CREATED = WorkspaceCreated(at=NOW, actor="a", org="acme", name="net", config=CONFIG)


def _decide(state: ws_agg.WorkspaceState, cmd: ws_agg.WorkspaceCommand) -> list[Any]:
    return ws_agg.decide(state, cmd, now=NOW, new_id=_ids)


# ---------------------------------------------------------------- core


def test_a_config_change_records_only_the_members_that_differ() -> None:
    state = _fold(CREATED)
    change = ChangeConfig(actor="a", changes={"branch": "prod", "repository": REPO})
    events = _decide(state, change)
    assert events == [ConfigChanged(at=NOW, actor="a", changes={"branch": "prod"})]
    after = ws_agg.fold(events, state)
    assert after.config is not None
    assert (after.config.branch, after.config.repository) == ("prod", REPO)
    assert _decide(after, ChangeConfig(actor="a", changes={"branch": "prod"})) == []


def test_a_config_change_is_checked_as_a_creation_is() -> None:
    state = _fold(CREATED)
    bad: dict[str, Any]
    for bad in ({"variables": {}}, {"name": "x"}, {"repository": "ext::sh -c id"}):
        with pytest.raises(Invalid):
            _decide(state, ChangeConfig(actor="a", changes=bad))
    with pytest.raises(Invalid):
        _decide(state, ChangeConfig(actor="a", changes={"branch": 7}))


def test_a_delete_is_refused_while_a_run_is_queued_naming_it() -> None:
    state = _fold(CREATED, RunEnqueued(at=NOW, actor="a", run_id="r1"))
    with pytest.raises(IllegalTransition, match="r1"):
        _decide(state, DeleteWorkspace(actor="a"))


def test_a_deleted_workspace_takes_no_command_but_a_purge() -> None:
    deleted = _fold(CREATED, WorkspaceDeleted(at=NOW, actor="a"))
    assert deleted.exists and deleted.deleted
    for cmd in (
        EnqueueRun(actor="a", run_id="r2"),
        ChangeConfig(actor="a", changes={"branch": "x"}),
        DeleteWorkspace(actor="a"),
        CreateWorkspace(actor="a", org="acme", name="net", config=CONFIG),
        ws_agg.SetVariables(actor="a", variables={}),
        ws_agg.LockWorkspace(actor="a", reason="r"),
    ):
        with pytest.raises(Deleted):
            _decide(deleted, cmd)
    assert _decide(deleted, ws_agg.AdmitNext(actor="s")) == []
    [purged] = _decide(deleted, PurgeWorkspace(actor="a"))
    fresh = ws_agg.fold([purged], deleted)
    assert not fresh.exists and fresh.purges == 1 and fresh.settings == {}
    again = _decide(fresh, CreateWorkspace(actor="a", org="acme", name="net", config=CONFIG))
    assert isinstance(again[0], WorkspaceCreated)
    with pytest.raises(IllegalTransition):  # a purge frees only a deleted name
        _decide(_fold(CREATED), PurgeWorkspace(actor="a"))
    with pytest.raises(AlreadyExists):
        _decide(_fold(CREATED), CreateWorkspace(actor="a", org="acme", name="n", config=CONFIG))
    assert isinstance(purged, WorkspacePurged)


# ---------------------------------------------------------------- the API


@pytest.fixture(name="http")
async def http_fixture(system: System, tmp_path: Path) -> AsyncIterator[Http]:
    """The API with the deployment's checks: repositories only from git.example.com or
    /srv/repos, never inside its data directory; secret variables sealed."""
    app = system.app
    data = tmp_path / "data"
    data.mkdir()
    sources = repositories.Sources.parse("https://git.example.com,/srv").guarding(
        data, "runplane-directory"
    )
    async with system.projector(tmp_path / "rm.sqlite") as projector:
        started = await app.create_org("api-test-fixture", "test")
        assert await projector.wait_for(started.seq)
        web_app = system.web_app(projector, admin_token=ADMIN_TOKEN, repositories=sources)
        web_app[DATA] = str(data)
        async with TestClient(TestServer(web_app)) as client:
            yield Http(client, web_app[API], app)


async def _acme(http: Http) -> dict[str, str]:
    tokens = await http.org("acme")
    await http.workspace("acme", "net", repository=REPO, secret_variables={"tok": "s3cret"})
    return tokens


async def test_patch_changes_the_configuration_and_runs_keep_theirs(http: Http) -> None:
    await _acme(http)
    before = await http.run("acme", "net", "plan")
    body = {
        "repository": "https://git.example.com/acme/other.git",
        "branch": "prod",
        "directory": "envs/prod",
    }
    a = await http.call("PATCH", WS, json=body)
    assert a.status == 200, a.body
    assert {k: a.body[k] for k in body} == body
    shown = await http.get(WS)
    assert {k: shown.body[k] for k in body} == body and shown.body["deleted_at"] is None
    old = (await http.app.load_run("acme", "net", before["id"])).state
    assert old.config is not None
    assert (old.config.repository, old.config.branch) == (REPO, "main")
    after = await http.run("acme", "net", "plan")
    new = (await http.app.load_run("acme", "net", after["id"])).state
    assert new.config is not None
    assert (new.config.branch, new.config.directory) == ("prod", "envs/prod")
    events = [e.event for e in await http.app.store.read("rp.ws.acme.net")]
    [changed] = [e for e in events if isinstance(e, ConfigChanged)]
    assert changed.changes == body and changed.actor == "admin"
    # variables and config in one PATCH; an empty one is refused
    both = await http.call("PATCH", WS, json={"variables": {"a": "1"}, "branch": "main"})
    assert both.status == 200 and both.body["variables"] == {"a": "1"}
    assert both.body["branch"] == "main"
    (await http.call("PATCH", WS, json={})).problem("invalid-command", 422)
    vcs = {
        "trigger_paths": ["envs/prod/**", "modules/*.tf"],
        "trigger_any_change": True,
        "trigger_tags": ["v*"],
        "vcs_run_type": "plan",
        "vcs_connection": "",
    }
    patched = await http.call("PATCH", WS, json=vcs)
    assert patched.status == 200, patched.body
    assert {k: patched.body[k] for k in vcs} == vcs
    assert {k: (await http.get(WS)).body[k] for k in vcs} == vcs
    cfg = (await http.app.load_ws("acme", "net")).state.config
    assert cfg is not None
    assert (cfg.trigger_paths, cfg.vcs_run_type) == (vcs["trigger_paths"], "plan")


async def test_patch_cannot_point_a_workspace_at_a_refused_repository(http: Http) -> None:
    """Attack: the repository of a PATCH is checked as at creation: runplane's data
    directory (also through `..`), a source the deployment does not allow, a git remote
    helper; nothing is recorded."""
    await _acme(http)
    data = http.client.app[DATA]
    for repo, rule in (
        (data, "runplane-directory"),
        (f"/srv/../{data}", "runplane-directory"),
        ("https://evil.example.org/x.git", "allowed-repos"),
    ):
        a = await http.call("PATCH", WS, json={"repository": repo})
        assert a.problem("repository-not-allowed", 422)["rule"] == rule, (repo, a.body)
    (await http.call("PATCH", WS, json={"repository": "ext::sh -c id"})).problem(
        "repository-not-allowed", 422
    )
    (await http.call("PATCH", WS, json={"vcs_connection": "not-ours"})).problem(
        "invalid-command", 422
    )
    (await http.call("PATCH", WS, json={"trigger_paths": ["a\x1bb"]})).problem("invalid-body", 400)
    (await http.call("PATCH", WS, json={"vcs_run_type": "destroy"})).problem("invalid-body", 400)
    assert (await http.get(WS)).body["repository"] == REPO
    events = [e.event for e in await http.app.store.read("rp.ws.acme.net")]
    assert not any(isinstance(e, ConfigChanged) for e in events)


async def test_delete_waits_for_runs_then_keeps_the_history(http: Http) -> None:
    await _acme(http)
    run = await http.run("acme", "net", "plan")
    busy = await http.call("DELETE", WS)
    assert busy.problem("conflict", 409)["run"] == run["id"]
    assert run["id"] in busy.body["detail"]
    canceled = await http.post(f"{V1}/orgs/acme/runs/{run['id']}/cancel")
    assert canceled.status == 200, canceled.body
    gone = await http.call("DELETE", WS)
    assert gone.status == 204, gone.body
    listed = await http.get(f"{V1}/orgs/acme/workspaces")
    assert [w["name"] for w in listed.body["items"]] == []
    with_deleted = await http.get(f"{V1}/orgs/acme/workspaces?deleted=true")
    [row] = with_deleted.body["items"]
    assert row["name"] == "net" and row["deleted_at"]
    (await http.post(f"{WS}/runs", json={"type": "plan"})).problem("workspace-deleted", 409)
    (await http.call("PATCH", WS, json={"branch": "x"})).problem("workspace-deleted", 409)
    (await http.call("DELETE", WS)).problem("workspace-deleted", 409)
    (await http.post(f"{WS}/lock", json={"reason": "r"})).problem("workspace-deleted", 409)
    put = await http.call("PUT", f"{WS}/secret-variables/x", json={"value": "v"})
    put.problem("workspace-deleted", 409)
    # its history stays readable
    assert (await http.get(f"{V1}/orgs/acme/runs/{run['id']}")).body["status"] == "canceled"
    assert (await http.get(f"{V1}/orgs/acme/runs/{run['id']}/events")).status == 200
    assert len((await http.get(f"{WS}/runs")).body["items"]) == 1
    # the name stays taken until a purge
    again = await http.post(f"{V1}/orgs/acme/workspaces", json={"name": "net", "repository": REPO})
    again.problem("workspace-deleted", 409)


async def test_a_purge_frees_the_name_and_what_it_would_inherit(http: Http, tmp_path: Path) -> None:
    tokens = await _acme(http)
    nc = http.app.store.nc
    head = await nc.jetstream().key_value(STATE_HEAD_BUCKET)
    await head.put("acme.net", b'{"old": "state"}')
    (await http.post(f"{WS}/purge")).problem("conflict", 409)  # not deleted yet
    for config_id, ws in (("n-net", "net"), ("n-org", "")):
        save = nt.SaveConfig(
            actor="admin",
            config_id=config_id,
            org="acme",
            workspace=ws,
            create=True,
            name=config_id,
            destination="generic",
            url="https://hooks.example.com/x",
        )
        await outbox.command(http.app, "acme", save)
    sched = await http.post(f"{WS}/schedules", json={"cron": "0 3 * * *", "run_type": "plan"})
    assert sched.status == 201, sched.body
    await http.workspace("acme", "dns", repository=REPO)
    await http.workspace("acme", "dep", repository=REPO)
    for follower, source in (("dns", "net"), ("net", "dep")):
        made = await http.post(
            f"{V1}/orgs/acme/workspaces/{follower}/run-triggers", json={"source": source}
        )
        assert made.status == 201, made.body
    old_run = await http.run("acme", "net", "plan")
    assert (await http.post(f"{V1}/orgs/acme/runs/{old_run['id']}/cancel")).status == 200
    assert (await http.call("DELETE", WS)).status == 204
    op = await http.post(f"{WS}/purge", token=tokens["operator"])
    op.problem("forbidden", 403)  # attack: an operator may not purge
    purged = await http.post(f"{WS}/purge", token=tokens["admin"])
    assert purged.status == 204, purged.body
    rows = await http.get(f"{V1}/orgs/acme/workspaces?deleted=true")
    assert [w["name"] for w in rows.body["items"]] == ["dep", "dns"]
    (await http.get(WS)).problem("not-found", 404)
    assert not [k for k in await kv_keys(nc, SECRETS_BUCKET) if k.startswith("acme.net.")]
    assert "acme.net" not in await kv_keys(nc, STATE_HEAD_BUCKET)
    schedules, _ = await schedule_store.load(http.app, "acme", "net", latest=True)
    assert schedules.schedules == {}
    g = (await graph.load(http.app, "acme")).state
    assert (g.followers_of("net"), g.sources_of("net"), g.sources_of("dns")) == ([], [], [])
    left = await outbox.configs(http.app.store, "acme")
    assert [c.id for c in left] == ["n-org"]  # the workspace's went, the organization's stay
    created = await http.post(
        f"{V1}/orgs/acme/workspaces", json={"name": "net", "repository": REPO}
    )
    assert created.status == 201, created.body
    assert created.body["variables"] == {} and created.body.get("secret_variables", {}) == {}
    # the old incarnation's runs left the read model; the new one's are its own
    new_run = await http.run("acme", "net", "plan")
    listed = (await http.get(f"{WS}/runs", headers={"RP-Min-Seq": str(new_run["seq"])})).body
    assert [r["id"] for r in listed["items"]] == [new_run["id"]]
    (await http.get(f"{V1}/orgs/acme/runs/{old_run['id']}")).problem("not-found", 404)
    kept = await http.api.read.rows(  # the audit table itself
        "SELECT type FROM events WHERE run_id = ? ORDER BY seq", (old_run["id"],)
    )
    assert [r["type"] for r in kept] == ["run.created", "run.canceled"]
    # a rebuild from the stream gives the very rows the live projector wrote, however
    # it cuts the history into batches: the old run's rows written by an earlier batch
    # than the purge's went too (they stayed, in CI, when the stream came in two)
    await http.api.after_write(await http.app.store.last_seq())
    live = await http.api.read.dump()
    for batch in (1, 16, 1000):
        await replay(nc, tmp_path / f"replayed-{batch}.sqlite", batch_size=batch)
        async with await ReadModel.open(tmp_path / f"replayed-{batch}.sqlite") as rebuilt:
            assert await rebuilt.dump() == live, batch
    # the audit of the delete and the purge survives it
    audit = await http.api.read.rows(  # the audit table itself
        "SELECT type, actor FROM events WHERE subject = 'rp.ws.acme.net' ORDER BY seq"
    )
    kinds = [(r["type"], r["actor"]) for r in audit]
    assert ("ws.deleted", "admin") in kinds and ("ws.purged", "admin-user") in kinds
    assert kinds.index(("ws.purged", "admin-user")) < len(kinds) - 1  # then created again


async def test_another_orgs_admin_cannot_patch_delete_or_purge(http: Http) -> None:
    """Attack: org B's admin sees org A's workspace as absent whatever it does."""
    await _acme(http)
    beta = await http.org("beta")
    b = beta["admin"]
    (await http.call("PATCH", WS, json={"branch": "x"}, token=b)).problem("not-found", 404)
    (await http.call("DELETE", WS, token=b)).problem("not-found", 404)
    (await http.post(f"{WS}/purge", token=b)).problem("not-found", 404)
    assert (await http.call("DELETE", WS)).status == 204
    (await http.post(f"{WS}/purge", token=b)).problem("not-found", 404)
    operator = (await http.post(f"{V1}/orgs/acme/tokens", json={"role": "operator"})).body
    (await http.call("DELETE", WS, token=operator["token"])).problem("forbidden", 403)
    shown = await http.get(f"{V1}/orgs/acme/workspaces?deleted=true")
    assert [w["name"] for w in shown.body["items"]] == ["net"]


# ---------------------------------------------------------------- the race


async def test_a_delete_between_a_runs_two_appends_refuses_the_run(
    nc: NATS, process: Process
) -> None:
    """`run.created` landed, then the delete (another replica), then the enqueue: the
    enqueue is refused on the workspace subject, the run canceled (workspace_deleted),
    the caller told 409; the scheduler's repair does the same for a creator that died."""
    other = process().app

    class Interleaved(App):
        async def enqueue_run(self, org: str, ws: str, run_id: str, actor: str, **kw: Any) -> int:
            await other.delete_workspace(org, ws, "admin")
            return await super().enqueue_run(org, ws, run_id, actor, **kw)

    app = Interleaved(EventStore(nc))
    await app.create_org("acme", "a")
    await app.create_workspace("acme", "net", CONFIG, "a")
    with pytest.raises(Deleted):
        await app.create_run("acme", "net", "plan", "alice")
    runs = await app.store.read("rp.run.acme.net.*")
    [run_id] = {e.subject.rsplit(".", 1)[1] for e in runs}
    state = (await app.load_run("acme", "net", run_id)).state
    assert (state.status, state.reason) == (Status.CANCELED, "workspace_deleted")

    # a creator that died after run.created: the scheduler's repair cancels it
    await app.create_workspace("acme", "dns", CONFIG, "a")
    created = process().app
    cmd = run_agg.CreateRun(
        actor="alice", run_id="r-dead", org="acme", workspace="dns", run_type="plan", config=CONFIG
    )
    evs = run_agg.decide(run_agg.INITIAL, cmd, now=NOW, new_id=_ids)
    subject = "rp.run.acme.dns.r-dead"
    await created.store.append([Append(subject=subject, event=evs[0], expected=0)])
    await other.delete_workspace("acme", "dns", "admin")
    assert not await created.ensure_enqueued("acme", "dns", "r-dead", "scheduler")
    dead = (await created.load_run("acme", "dns", "r-dead")).state
    assert (dead.status, dead.reason) == (Status.CANCELED, "workspace_deleted")


class Stepping(EventStore):
    """An event store that counts, per workspace, the reads and appends a create made:
    a racing delete starts once the create is that far (then both go on at once)."""

    def __init__(self, nc: NATS) -> None:
        super().__init__(nc)
        self.done: dict[str, int] = {}
        self.moved = asyncio.Condition()

    async def _step(self, subject: str) -> None:
        parts = subject.split(".")
        if parts[1] in ("ws", "run"):
            async with self.moved:
                self.done[parts[3]] = self.done.get(parts[3], 0) + 1
                self.moved.notify_all()

    async def read(self, subject: str, after: int = 0, *, min_seq: int = 0) -> Any:
        envs = await super().read(subject, after, min_seq=min_seq)
        await self._step(subject)
        return envs

    async def append(self, items: list[Append], **kw: Any) -> int:
        seq = await super().append(items, **kw)
        await self._step(items[0].subject)
        return seq

    async def reached(self, ws: str, steps: int) -> None:
        async with self.moved:
            await self.moved.wait_for(lambda: self.done.get(ws, 0) >= steps)


async def test_a_delete_racing_run_creations_never_leaves_a_run_on_a_deleted_workspace(
    nc: NATS, process: Process
) -> None:
    """Over 40 workspaces, a create and a delete through two Apps, the delete let go as
    the create starts, after its read of the workspace, after `run.created` and after
    `ws.run_enqueued`: each time exactly one of them wins (the other is refused: 409),
    and every run recorded on a deleted workspace is canceled, never admitted."""
    stepping = Stepping(nc)
    await _race(stepping, process(store=stepping).app, process().app)


async def test_on_a_cluster_a_delete_and_a_create_through_two_nodes_never_both_win(
    tmp_path: Path,
) -> None:
    """The same race on a 3-node cluster (streams at R3), the create's App connected to
    one node and the delete's to another, so that each may read from a follower that is
    behind: the checked appends on the workspace subject still let exactly one win."""
    async with NatsCluster(tmp_path / "cluster") as cluster:
        setup = await cluster.connect()
        await streams.declare(setup, setup.jetstream(), replicas=3)
        await setup.close()
        options = cluster.auth.connect_options()
        one = await nats.connect(servers=[cluster.nodes[0].url], **options)
        other = await nats.connect(servers=[cluster.nodes[2].url], **options)
        try:
            async with AsyncExitStack() as stack:  # an App on each node, as two replicas
                stepping = Stepping(one)
                create = built(one, stack, tmp_path, store=stepping).app
                await _race(stepping, create, built(other, stack, tmp_path).app)
        finally:
            await one.close()
            await other.close()


async def _race(stepping: Stepping, a: App, b: App) -> None:
    """`a` creates runs over `stepping` (its store), `b` deletes the workspaces."""
    await a.create_org("acme", "a")
    names = [f"ws-{i}" for i in range(40)]
    for n in names:
        await b.create_workspace("acme", n, CONFIG, "a")

    async def delete(n: str, after: int) -> Any:
        await stepping.reached(n, after)
        return await b.delete_workspace("acme", n, "admin")

    async def race(i: int, n: str) -> tuple[bool, bool]:
        made: Result | BaseException
        gone: Any
        made, gone = await asyncio.gather(
            a.create_run("acme", n, "plan", "alice"),
            delete(n, i % 4),
            return_exceptions=True,
        )
        assert not isinstance(made, BaseException) or isinstance(made, Deleted), made
        assert not isinstance(gone, BaseException) or isinstance(gone, IllegalTransition), gone
        return not isinstance(made, BaseException), not isinstance(gone, BaseException)

    outcomes = await asyncio.gather(*(race(i, n) for i, n in enumerate(names)))
    for n, (made, gone) in zip(names, outcomes, strict=True):
        assert made != gone, (n, made, gone)  # exactly one of them won
        w = (await b.load_ws("acme", n)).state
        assert w.deleted == gone
        for env in await b.store.read(f"rp.run.acme.{n}.*", min_seq=LATEST):
            run = await b.load_run("acme", n, env.subject.rsplit(".", 1)[1], min_seq=LATEST)
            if gone:
                assert run.state.status == Status.CANCELED, (n, run.state.status)
                assert run.state.reason == "workspace_deleted"
            else:
                assert w.holds(run.state.run_id) and run.state.status == Status.PENDING
    wins = sum(m for m, _ in outcomes)
    assert 0 < wins < len(names), wins  # both ways were taken
    refused = [n for n, (_, gone) in zip(names, outcomes, strict=True) if gone]
    recorded = [n for n in refused if await b.store.read(f"rp.run.acme.{n}.*")]
    assert recorded, "no delete landed between a run.created and its enqueue"


async def test_the_vcs_binding_follows_a_patch_and_goes_with_a_delete(http: Http) -> None:
    """PATCH binds the workspace to its organization's own connection (the webhooks'
    `vcs_bindings` row follows the new configuration); org B's connection is refused
    (attack); a deleted workspace leaves the bindings, so no webhook starts its runs."""
    await _acme(http)
    await http.org("beta")
    mine = await connection(http, "acme")
    theirs = await connection(http, "beta")
    refused = await http.call("PATCH", WS, json={"vcs_connection": theirs["id"]})
    refused.problem("invalid-command", 422)
    bind = {"vcs_connection": mine["id"], "branch": "prod", "trigger_paths": ["envs/**"]}
    a = await http.call("PATCH", WS, json=bind)
    assert a.status == 200 and a.body["vcs_connection"] == mine["id"], a.body
    query = "SELECT connection, branch, trigger_paths_json FROM vcs_bindings WHERE org = ?"
    rows = [tuple(r) for r in await http.api.read.rows(query, ("acme",))]
    assert rows == [(mine["id"], "prod", '["envs/**"]')]
    assert (await http.call("DELETE", WS)).status == 204
    assert await http.api.read.rows(query, ("acme",)) == []
