"""The open-runs quota (issue 23 items 5 and 6, services/app/openruns.py): an
organization and each of its workspaces may keep so many runs open, however they are
started; one more is refused (429 `quota-exceeded`) with nothing written, and another
organization is untouched. Replicas share the ledger, so racing creates never pass it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from events.errors import QuotaExceeded
from events.run import CancelRun
from services.app import openruns
from services.app.commands import App
from services.root.bootstrap import Plane
from services.surfaces.api.context import API
from tests import builders
from tests.api_support import Http, served
from tests.bootstrap_support import built, options_for
from tests.helpers import eventually


@pytest.fixture
async def system(nc: NATS, tmp_path: Path) -> AsyncIterator[Plane]:
    """The graph with an organization allowed 5 open runs, a workspace 3 (overrides
    conftest's `system`)."""
    opts = options_for(tmp_path, org_max_open_runs=5, workspace_max_open_runs=3)
    async with AsyncExitStack() as stack:
        yield built(nc, stack, tmp_path, opts=opts)


async def _workspaces(system: Plane, org: str, *names: str) -> None:
    for ws in names:
        await builders.workspace(system.app, ws, org=org, actor="alice")


async def test_a_workspace_past_its_open_runs_is_refused_with_nothing_written(
    system: Plane, tmp_path: Path
) -> None:
    app = system.app
    await app.create_org("acme", "test")
    await _workspaces(system, "acme", "net")
    async with served(system, tmp_path / "rm.sqlite", "api-test") as (web_app, client):
        http = Http(client, web_app[API], app)
        for _ in range(3):
            assert (await http.run("acme", "net", "plan"))["status"] in ("pending", "queued")
        before = await app.store.last_seq()
        a = await http.post("/api/v1/orgs/acme/workspaces/net/runs", json={"type": "plan"})
        assert a.status == 429, a.body
        assert a.body["type"].endswith("/quota-exceeded")
        assert "workspace net has 3 open runs" in a.body["detail"]
        assert await app.store.last_seq() == before  # no run.created, nothing half written


async def test_an_organization_past_its_open_runs_is_refused_and_another_is_not(
    system: Plane,
) -> None:
    """Org A fills its quota over two workspaces, speculative plans included; org B (an
    attacker's neighbour) starts runs as before."""
    app = system.app
    for org in ("acme", "beta"):
        await app.create_org(org, "test")
        await _workspaces(system, org, "a", "b")
    for ws, n in (("a", 3), ("b", 2)):
        for _ in range(n):
            await app.create_run("acme", ws, "plan", "alice", speculative=ws == "b")
    with pytest.raises(QuotaExceeded, match="the organization has 5 open runs"):
        await app.create_run("acme", "b", "plan", "alice", speculative=True)
    for ws in ("a", "b"):
        assert (await app.create_run("beta", ws, "plan", "alice")).state.exists


async def test_an_ended_run_frees_its_place(system: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    app = system.app
    await app.create_org("acme", "test")
    await _workspaces(system, "acme", "net")
    runs = [(await app.create_run("acme", "net", "plan", "alice")).state.run_id for _ in range(3)]
    with pytest.raises(QuotaExceeded):
        await app.create_run("acme", "net", "plan", "alice")
    await app.run_command("acme", "net", runs[1], CancelRun(actor="alice"))
    monkeypatch.setattr(openruns, "GRACE", 0.0)  # the reservations are old enough to look up
    monkeypatch.setattr(openruns, "PRUNE_EVERY", 0.0)
    assert (await app.create_run("acme", "net", "plan", "alice")).state.exists
    with pytest.raises(QuotaExceeded):  # the three open ones again
        await app.create_run("acme", "net", "plan", "alice")


async def test_replicas_racing_never_pass_the_quota(
    system: Plane, nc: NATS, tmp_path: Path
) -> None:
    app = system.app
    await app.create_org("acme", "test")
    await _workspaces(system, "acme", "a", "b", "c")
    opts = options_for(tmp_path, org_max_open_runs=5, workspace_max_open_runs=3)
    async with AsyncExitStack() as stack:
        other = built(nc, stack, tmp_path, opts=opts).app

        async def create(i: int) -> bool:
            try:
                await (app, other)[i % 2].create_run("acme", "abc"[i % 3], "plan", "alice")
            except QuotaExceeded:
                return False
            return True

        made = await asyncio.gather(*(create(i) for i in range(12)))
    assert sum(made) == 5


async def test_creates_racing_a_ledger_full_of_ended_runs_all_get_in(
    system: Plane, nc: NATS, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attack review's livelock: a workspace's ledger full of runs that ended (their
    releases lost), creates in it from two replicas at once while others come in on
    another workspace: each prune is written at once, so every create that fits gets in."""
    app = system.app
    await app.create_org("acme", "test")
    await _workspaces(system, "acme", "net", "web")
    for _ in range(3):
        run = (await app.create_run("acme", "net", "plan", "alice")).state.run_id
        await app.run_command("acme", "net", run, CancelRun(actor="alice"))
    monkeypatch.setattr(openruns, "GRACE", 0.0)
    assert app.open_runs is not None
    looked_up = app.open_runs.is_open

    async def slowly(org: str, ws: str, run_id: str) -> bool:  # the other writes meanwhile
        await asyncio.sleep(0.05)
        return await looked_up(org, ws, run_id)

    app.open_runs.is_open = slowly
    opts = options_for(tmp_path, org_max_open_runs=5, workspace_max_open_runs=3)
    async with AsyncExitStack() as stack:
        other = built(nc, stack, tmp_path, opts=opts).app
        made = await asyncio.gather(
            *(a.create_run("acme", "net", "plan", "alice") for a in (app, app, app)),
            *(other.create_run("acme", "web", "plan", "alice") for _ in range(2)),
        )
    assert all(r.state.exists for r in made)
    with pytest.raises(QuotaExceeded, match="the organization has 5 open runs"):
        await app.create_run("acme", "web", "plan", "alice")


async def test_the_scheduler_takes_an_ended_run_out(system: Plane, app: App) -> None:
    """No prune needed: the scheduler releases a run's place when it ends."""
    await app.create_org("acme", "test")
    await _workspaces(system, "acme", "net")
    async with system.scheduler():
        runs = [
            (await app.create_run("acme", "net", "plan", "alice")).state.run_id for _ in range(3)
        ]
        await app.run_command("acme", "net", runs[0], CancelRun(actor="alice"))
        ledger = openruns.Ledger()

        async def released() -> bool:
            nonlocal ledger
            assert app.open_runs is not None
            ledger, _ = await app.open_runs._read("acme", leader=True)
            return not ledger.holds(runs[0])

        await eventually(released, what="the canceled run out of the ledger")
    assert [r for _, r, _ in ledger.runs] == runs[1:]
    assert (await app.create_run("acme", "net", "plan", "alice")).state.exists
