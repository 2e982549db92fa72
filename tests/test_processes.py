"""runplane as a user runs it: real processes, real nats-server, real Terraform."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from events.run import Workspace
from infra.eventstore import EventStore
from infra.natsserver import EmbeddedNats
from projections.readmodel import ReadModel
from services.app.commands import App
from services.root.demo import DEMO_ORG, DEMO_WS, ensure_demo, make_demo_repo
from tests.helpers import eventually
from tests.procs import Client, Proc, free_port, nats_servers_using, wait_healthy
from tests.scheduler_support import FakeExecutor, check_history

pytestmark = pytest.mark.terraform

HAPPY_PATH = [
    "pending",
    "queued",
    "planning",
    "awaiting_approval",
    "apply_queued",
    "applying",
    "applied",
]


def statuses_from_events(events: list[dict[str, object]]) -> list[str]:
    """The run's status path, read from its audit history alone."""
    path = []
    for e in events:
        kind = e["type"]
        data = e["data"]
        assert isinstance(data, dict)
        step = {
            "run.created": "pending",
            "run.queued": "queued",
            "run.approved": "apply_queued",
            "run.apply_finished": "applied",
            "run.failed": "failed",
        }.get(str(kind))
        if kind == "run.phase_started":
            step = "planning" if data["phase"] == "plan" else "applying"
        if kind == "run.plan_finished":
            step = "awaiting_approval" if data.get("require_approval", True) else "apply_queued"
        if step:
            path.append(step)
    return path


async def test_runplane_up_plans_and_applies_the_demo_and_stops_everything(
    tmp_path: Path,
) -> None:
    data, port = tmp_path / "data", free_port()
    deliveries = tmp_path / "deliveries.txt"  # up runs the subscribers: a test-only one here
    up = await Proc(
        ["up", "--data-dir", str(data), "--listen", f"127.0.0.1:{port}"],
        tmp_path / "up.log",
        env={
            "RUNPLANE_ADMIN_TOKEN": "t0ken-for-tests",
            "RUNPLANE_SUBSCRIBER_MODULES": "tests.subscriber_support",
            "RP_TEST_SUB_LOG": str(deliveries),
        },
    ).start()
    base = f"http://127.0.0.1:{port}"
    client = Client(base, "t0ken-for-tests")
    try:
        await wait_healthy(base)
        banner = up.output()
        assert base in banner and "t0ken-for-tests" in banner and "curl" in banner
        run = await client.ok("POST", "/api/v1/orgs/demo/workspaces/hello/runs", {"type": "apply"})
        # the run as projected once it holds the create's last write (its enqueue): the
        # scheduler of the same process may have admitted it, and an executor claimed it
        assert run["status"] in ("pending", "queued", "planning"), run
        planned = await client.wait_status("demo", run["id"], {"awaiting_approval", "failed"})
        assert planned["status"] == "awaiting_approval", planned
        assert planned["plan_summary"] == {"add": 2, "change": 0, "destroy": 0}
        await client.ok("POST", f"/api/v1/orgs/demo/runs/{run['id']}/approve", {"acknowledged": []})
        done = await client.wait_status("demo", run["id"], {"applied", "failed"})
        assert done["status"] == "applied", done
        events = (await client.ok("GET", f"/api/v1/orgs/demo/runs/{run['id']}/events"))["items"]
        assert statuses_from_events(events) == HAPPY_PATH
        seqs = [e["seq"] for e in events]
        assert seqs == sorted(seqs) and all(e["actor"] and e["at"] for e in events)
        assert nats_servers_using(data), "the embedded nats-server runs on the data directory"
        assert [line.split()[0] for line in deliveries.read_text().splitlines()] == ["got", "done"]
    finally:
        await client.close()
        code = await up.stop(signal.SIGTERM)
    assert code == 0, up.output()[-3000:]
    assert not nats_servers_using(data), "runplane up left its nats-server running"
    live = await _dump(data / "readmodel.sqlite")
    replay = await Proc(["replay", "--data-dir", str(data)], tmp_path / "replay.log").start()
    assert await replay.stop(signal.SIGCONT, timeout=60) == 0, replay.output()
    assert "replayed" in replay.output()
    assert await _dump(data / "readmodel.sqlite") == live, "replay rebuilt identical rows"


async def _dump(path: Path) -> dict[str, list[tuple[object, ...]]]:
    async with await ReadModel.open(path) as rm:
        return await rm.dump()


async def test_the_api_killed_mid_run_loses_nothing(
    tmp_path: Path, nats_server: EmbeddedNats, store: EventStore
) -> None:
    """Kill -9 the api while a run moves on; the restarted api catches up from its
    checkpoint and shows every event the run has, in order."""
    url = nats_server.url
    common = ["--nats-url", url, "--data-dir"]
    env = {"RUNPLANE_ADMIN_TOKEN": "adm"}
    sched = await Proc(["scheduler", *common, str(tmp_path / "s")], tmp_path / "s.log", env).start()
    execu = await Proc(["executor", *common, str(tmp_path / "e")], tmp_path / "e.log", env).start()
    port = free_port()
    api_args = ["api", *common, str(tmp_path / "a"), "--listen", f"127.0.0.1:{port}"]
    api = await Proc(api_args, tmp_path / "a.log", env).start()
    base = f"http://127.0.0.1:{port}"
    client = Client(base, "adm")
    repo = make_demo_repo(tmp_path / "repo")
    try:
        await wait_healthy(base)
        await client.ok("POST", "/api/v1/orgs", {"name": "acme"})
        await client.ok(
            "POST",
            "/api/v1/orgs/acme/workspaces",
            {"name": "net", "repository": str(repo), "variables": {"n": "1"}},
        )
        run = await client.ok("POST", "/api/v1/orgs/acme/workspaces/net/runs", {"type": "apply"})
        api.kill()
        await api.proc.wait()  # type: ignore[union-attr]
        api = await Proc(api_args, tmp_path / "a.log", env).start()
        await wait_healthy(base)
        await client.wait_status("acme", run["id"], {"awaiting_approval"})
        await client.ok("POST", f"/api/v1/orgs/acme/runs/{run['id']}/approve", {"acknowledged": []})
        api.kill()
        await api.proc.wait()  # type: ignore[union-attr]
        api = await Proc(api_args, tmp_path / "a.log", env).start()
        await wait_healthy(base)
        done = await client.wait_status("acme", run["id"], {"applied", "failed"})
        assert done["status"] == "applied", done
        events = (await client.ok("GET", f"/api/v1/orgs/acme/runs/{run['id']}/events"))["items"]
        stored = await store.read(f"rp.run.acme.net.{run['id']}")
        assert [e["seq"] for e in events] == [e.seq for e in stored]
        assert statuses_from_events(events) == HAPPY_PATH
    finally:
        await client.close()
        for p in (api, sched, execu):
            await p.stop()


async def test_two_scheduler_processes_never_admit_twice_or_out_of_order(
    tmp_path: Path, nats_server: EmbeddedNats, nc: NATS, app: App, store: EventStore
) -> None:
    workspaces = [f"ws{i}" for i in range(4)]
    await app.create_org("acme", "admin")
    for ws in workspaces:
        # A real repository: admission resolves its branch for the run's snapshot.
        config = Workspace(repository=str(make_demo_repo(tmp_path / "repo")))
        await app.create_workspace("acme", ws, config, "admin")
    args = ["scheduler", "--nats-url", nats_server.url, "--data-dir"]
    scheds = [
        await Proc([*args, str(tmp_path / f"s{i}")], tmp_path / f"s{i}.log").start()
        for i in range(2)
    ]
    try:
        async with FakeExecutor(nc, app) as fake:
            created = await asyncio.gather(
                *(app.create_run("acme", workspaces[i % 4], "plan", "al") for i in range(40))
            )

            async def all_done() -> bool:
                for r in created:
                    s = (await app.load_run("acme", r.state.workspace, r.state.run_id)).state
                    if s.status != "no_changes":
                        return False
                return True

            await eventually(all_done, timeout=60, what="every run to finish")
    finally:
        for p in scheds:
            assert await p.stop() == 0, p.output()[-2000:]
    ids = sorted(r.state.run_id for r in created)
    admitted = check_history(await store.read("rp.>"))
    assert sorted(r for runs in admitted.values() for r in runs) == ids
    assert sorted(fake.claimed) == ids, "every run planned exactly once"


async def test_runplane_up_killed_with_sigkill_leaves_no_nats_server_behind(
    tmp_path: Path,
) -> None:
    data, port = tmp_path / "data", free_port()
    up = await Proc(
        ["up", "--data-dir", str(data), "--listen", f"127.0.0.1:{port}", "--no-demo"],
        tmp_path / "up.log",
        env={"RUNPLANE_ADMIN_TOKEN": "t0ken-for-tests"},
    ).start()
    try:
        await wait_healthy(f"http://127.0.0.1:{port}")
        assert nats_servers_using(data)
    finally:
        up.kill()
        await up.proc.wait()  # type: ignore[union-attr]

    async def gone() -> bool:
        return not nats_servers_using(data)

    await eventually(gone, timeout=15, what="the embedded nats-server to exit with runplane")


async def test_the_demo_workspace_records_its_repository_by_absolute_path(
    app: App, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`runplane up` with its default data directory (`.runplane`, relative): the demo
    repository must still be found by an executor running git in its job directory."""
    monkeypatch.chdir(tmp_path)
    await ensure_demo(app, Path(".runplane"))
    config = (await app.load_ws(DEMO_ORG, DEMO_WS)).state.config
    assert config is not None
    assert Path(config.repository).is_absolute()
    assert (Path(config.repository) / ".git").is_dir()
