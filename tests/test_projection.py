"""The live projector against a real nats-server, driven through the App like production."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from events.codec import encode, run_subject
from events.run import (
    ApproveRun,
    CancelRun,
    FailRun,
    FinishPlan,
    PlanSummary,
    RunQueued,
    Workspace,
)
from infra import streams
from infra.eventstore import EventStore, wait_for_stream
from infra.ids import hash_token
from infra.natsserver import EmbeddedNats
from projections import Projector, replay
from projections.readmodel import ReadModel
from services.app.commands import App
from services.app.execute import Result
from tests.bootstrap_support import Process
from tests.helpers import eventually
from tests.projection_support import (
    EXECUTOR,
    ORG,
    apply,
    cmd,
    new_run,
    run_phase,
    settle,
    setup_org,
)

# ---------------------------------------------------------------- fixtures


@pytest.fixture
async def projector(nc: NATS, tmp_path: Path) -> AsyncIterator[Projector]:
    async with Projector(nc, tmp_path / "read.db", idle_heartbeat=0.5) as p:
        yield p


# ---------------------------------------------------------------- live projection


async def test_a_run_is_projected_through_plan_approval_and_apply(
    app: App, store: EventStore, projector: Projector
) -> None:
    """Each command's result seq is readable at once, with the status the core derives."""
    await setup_org(app, "net")
    read = projector.read

    async def status_after(result: Result) -> str:
        assert await projector.wait_for(result.seq)
        run = await read.runs.get(ORG, run_id)
        return str((run or {}).get("status"))

    created = await app.create_run(ORG, "net", "apply", "alice", message="bump vpc")
    run_id = str(created.state.run_id)
    assert await status_after(created) == "pending"
    await app.admit_next(ORG, "net")
    lease = await run_phase(app, "net", run_id, "plan")
    await settle(projector, store)
    assert (await read.runs.get(ORG, run_id) or {}).get("status") == "planning"
    finish = FinishPlan(
        actor=EXECUTOR,
        lease_id=lease,
        commit="abc123",
        has_changes=True,
        summary=PlanSummary(add=2, change=1),
        plan_digest="sha256:feed",
    )
    assert await status_after(await cmd(app, "net", run_id, finish)) == "awaiting_approval"
    approved = await cmd(app, "net", run_id, ApproveRun(actor="bob", acknowledged=["destroys"]))
    assert await status_after(approved) == "apply_queued"
    applied = await apply(app, "net", run_id)
    assert await status_after(applied) == "applied"

    run = await read.runs.get(ORG, run_id)
    assert run is not None
    assert run | {"created_at": None, "updated_at": None} == {
        "id": run_id,
        "org": ORG,
        "workspace": "net",
        "type": "apply",
        "status": "applied",
        "created_by": "alice",
        "created_at": None,
        "updated_at": None,
        "message": "bump vpc",
        "commit": "abc123",
        "has_changes": True,
        "plan_summary": {"add": 2, "change": 1, "destroy": 0},
        "apply_summary": {"add": 2, "change": 1, "destroy": 0},
        "plan_digest": "sha256:feed",
        "approved_by": "bob",
        "acknowledged": ["destroys"],
        "reason": None,
        "error_message": None,
        "phase": None,
        "executor_id": EXECUTOR,
        "seq": applied.seq,  # the run's own last event (its workspace is released after it)
        "cause": None,  # created by a command without one (the API's would say "api")
        "snapshot": None,  # admitted without a snapshot hook
        "speculative": False,
        "commit_author": None,
        "commit_message": None,
        "usage": None,  # its steps were reported without what they used
        "log_removed_at": None,  # no retention pass removed its logs
        "policies": [],
        "overridden": [],
        "template": "apply",
        "current_step": None,
        "steps": run["steps"],  # checked below
    }
    assert [(s["number"], s["kind"], s["status"]) for s in run["steps"]] == [
        (100, "plan", "done"),
        (125, "policy", "done"),
        (150, "approval", "done"),
        (200, "apply", "done"),
    ]
    steps = await read.runs.steps(ORG, run_id)
    assert [(s["phase"], s["step"], s["status"]) for s in steps] == [
        ("plan", "checkout", "ok"),
        ("plan", "init", "ok"),
        ("plan", "plan", "ok"),
        ("apply", "checkout", "ok"),
        ("apply", "init", "ok"),
        ("apply", "apply", "ok"),
    ]
    assert all(s["duration_ms"] >= 0 and s["ended_at"] >= s["started_at"] for s in steps)
    assert steps[0]["log_object"] == f"{run_id}/checkout.log"

    async def released() -> dict[str, Any]:
        # the workspace is released by its own event after the run's last one: the
        # projection may hold the run's end and not yet the release
        ws = await read.workspaces.get(ORG, "net")
        assert ws is not None and ws["active_run"] is None and ws["queue"] == [], ws
        return ws

    await eventually(released, timeout=10, what="the workspace released in the read model")


async def test_run_events_are_the_runs_own_history_in_stream_order(
    app: App, store: EventStore, projector: Projector
) -> None:
    await setup_org(app, "net")
    run_id = await new_run(app, "net", message="hello")
    await app.admit_next(ORG, "net")
    await cmd(app, "net", run_id, CancelRun(actor="alice", reason="oops"))
    await settle(projector, store)
    events = await projector.read.runs.events(ORG, run_id)
    assert [e["type"] for e in events] == ["run.created", "run.queued", "run.canceled"]
    assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
    assert events[0]["actor"] == "alice" and events[1]["actor"] == "scheduler"
    assert events[0]["data"]["message"] == "hello"
    assert events[2]["data"] == {"reason": "oops"}
    assert not any({"type", "at", "actor"} & e["data"].keys() for e in events)


async def test_workspace_queue_is_fifo_and_follows_admission_and_release(
    app: App, store: EventStore, projector: Projector
) -> None:
    await setup_org(app, "net", "app")
    read = projector.read
    first, second, third = [await new_run(app, "net") for _ in range(3)]
    await settle(projector, store)
    ws = await read.workspaces.get(ORG, "net")
    assert ws is not None
    assert (ws["active_run"], ws["queue"]) == (None, [first, second, third])
    assert ws["variables"] == {"env": "net", "region": "eu"}
    assert (ws["repository"], ws["branch"], ws["directory"]) == ("/repo", "main", ".")

    await app.admit_next(ORG, "net")
    await cmd(app, "net", third, CancelRun(actor="alice"))
    await settle(projector, store)
    ws = await read.workspaces.get(ORG, "net")
    assert ws is not None and (ws["active_run"], ws["queue"]) == (first, [second])

    await cmd(app, "net", first, FailRun(actor="reaper", reason="timeout"))
    await app.admit_next(ORG, "net")
    await settle(projector, store)
    listed = await read.workspaces.find(ORG)
    assert [(w["name"], w["active_run"], w["queue"]) for w in listed] == [
        ("app", None, []),
        ("net", second, []),
    ]
    assert await read.workspaces.get(ORG, "nope") is None


async def test_list_runs_is_newest_first_filters_and_pages(
    app: App, store: EventStore, projector: Projector
) -> None:
    await setup_org(app, "net", "app")
    ids = [await new_run(app, ws) for ws in ("net", "app", "net", "app", "net")]
    await app.admit_next(ORG, "net")  # ids[0] becomes queued
    await settle(projector, store)
    read = projector.read
    newest_first = list(reversed(ids))
    assert [r["id"] for r in await read.runs.find(ORG)] == newest_first
    assert [r["id"] for r in await read.runs.find(ORG, workspace="app")] == [ids[3], ids[1]]
    assert [r["id"] for r in await read.runs.find(ORG, status=["queued"])] == [ids[0]]
    pages, before = [], None
    while page := await read.runs.find(ORG, limit=2, before=before):
        pages.append([r["id"] for r in page])
        before = page[-1]["id"]
    assert pages == [newest_first[0:2], newest_first[2:4], newest_first[4:]]
    assert await read.runs.find(ORG, before="unknown") == []


async def test_reads_are_scoped_to_the_organization(
    app: App, store: EventStore, projector: Projector
) -> None:
    token = await setup_org(app, "net")
    await app.create_org("other", "admin")
    run_id = await new_run(app, "net")
    await settle(projector, store)
    read = projector.read
    assert await read.runs.get("other", run_id) is None
    assert await read.runs.events("other", run_id) == []
    assert await read.runs.steps("other", run_id) == []
    assert await read.runs.find("other") == []
    assert await read.workspaces.find("other") == []
    org = await read.orgs.get(ORG)
    assert org is not None and (org["name"], org["created_by"]) == (ORG, "admin")
    assert await read.orgs.get("nobody") is None
    owner = await read.orgs.token(hash_token(token))
    assert owner is not None
    assert (owner["org"], owner["user"], owner["role"]) == (ORG, "alice", "admin")
    assert await read.orgs.token(hash_token("rp_guess")) is None


async def test_the_clear_token_is_never_stored(
    app: App, store: EventStore, projector: Projector
) -> None:
    token = await setup_org(app)
    await settle(projector, store)
    dump = await projector.read.dump()
    assert token not in repr(dump)
    assert hash_token(token) in repr(dump["tokens"])


# ---------------------------------------------------------------- wait_for


async def test_wait_for_resolves_on_commit_and_gives_up_after_its_timeout(
    app: App, store: EventStore, projector: Projector
) -> None:
    await settle(projector, store)
    started = time.monotonic()
    assert await projector.wait_for(projector.seq + 100, timeout=0.2) is False
    assert time.monotonic() - started < 1.0
    assert await projector.wait_for(0) is True

    waiter = asyncio.create_task(projector.wait_for(await store.last_seq() + 1, timeout=5))
    await asyncio.sleep(0)
    assert not waiter.done()
    result = await app.create_org(ORG, "admin")
    assert await waiter is True
    assert projector.seq >= result.seq
    assert await projector.read.orgs.get(ORG) is not None  # read-your-writes


# ---------------------------------------------------------------- restarts and faults


async def test_a_restarted_projector_resumes_from_its_checkpoint(
    app: App, nc: NATS, store: EventStore, tmp_path: Path
) -> None:
    """Nothing is projected twice (positions, counts) and the result equals a full replay."""
    db = tmp_path / "read.db"
    async with Projector(nc, db) as first:
        await setup_org(app, "net")
        queued = await new_run(app, "net")
        await settle(first, store)
        checkpoint = first.seq
        before = await first.read.dump()
    later = await new_run(app, "net")
    await app.admit_next(ORG, "net")
    async with Projector(nc, db) as second:
        assert second.seq == checkpoint  # read back from the database, not zero
        await settle(second, store)
        after = await second.read.dump()
        ws = await second.read.workspaces.get(ORG, "net")
    assert second.received == await store.last_seq() - checkpoint  # nothing read twice
    assert ws is not None and (ws["active_run"], ws["queue"]) == (queued, [later])
    assert [row[0] for row in after["events"]] == list(range(1, await store.last_seq() + 1))
    assert set(before["ws_queue"]) - set(after["ws_queue"]) == {
        row
        for row in before["ws_queue"]
        if row[2] == queued  # only the admitted run left
    }
    assert await replay(store.nc, tmp_path / "fresh.db") == await store.last_seq()
    async with await ReadModel.open(tmp_path / "fresh.db") as fresh:
        assert await fresh.dump() == after


async def test_poison_messages_are_skipped_recorded_and_counted(
    app: App, nc: NATS, store: EventStore, tmp_path: Path
) -> None:
    """Garbage, a foreign shape and an event for a run never created must not stall it."""
    js = nc.jetstream()
    db = tmp_path / "read.db"
    async with Projector(nc, db) as projector:
        await setup_org(app, "net")
        garbage = await js.publish("rp.run.x.y.z", b'{"type": "run.created", "at": ')
        shapeless = await js.publish("rp.run.x.y.z", b'{"hello": "world"}')
        orphan = RunQueued(at=datetime.now(UTC), actor="ghost")
        ghost = await js.publish(run_subject(ORG, "net", "ghost"), encode(orphan))
        after = await app.create_workspace(ORG, "app", Workspace(repository="/r"), "alice")
        assert await projector.wait_for(after.seq, timeout=10)
        assert projector.skipped == 3
        assert await projector.read.workspaces.get(ORG, "app") is not None
        skipped = (await projector.read.dump())["skipped"]
    assert [(seq, subject) for seq, subject, _, _ in skipped] == [
        (garbage.seq, "rp.run.x.y.z"),
        (shapeless.seq, "rp.run.x.y.z"),
        (ghost.seq, run_subject(ORG, "net", "ghost")),
    ]
    assert skipped[0][3].startswith("undecodable") and skipped[2][2] == "run.queued"
    async with Projector(nc, db) as again:
        assert again.skipped == 3  # the count is durable


async def test_the_projector_survives_a_nats_server_restart(
    app: App, nc: NATS, store: EventStore, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    async with Projector(nc, tmp_path / "read.db", idle_heartbeat=0.5) as projector:
        await setup_org(app, "net")
        await settle(projector, store)
        await nats_server.stop()
        async with EmbeddedNats(nats_server.data_dir, port=nats_server.port):
            await wait_for_stream(nc)
            created = await eventually(lambda: _try_create_run(app), what="append after restart")
            assert created is not None
            assert await projector.wait_for(created.seq, timeout=30)
            run = await projector.read.runs.get(ORG, created.state.run_id)
            assert run is not None and run["status"] == "pending"


async def _try_create_run(app: App) -> Result | None:
    try:
        return await app.create_run(ORG, "net", "plan", "alice")
    except Exception:  # noqa: BLE001 - the connection is still coming back
        return None


async def test_a_checkpoint_past_the_end_of_the_stream_rebuilds_the_model(
    app: App, nc: NATS, store: EventStore, tmp_path: Path, process: Process
) -> None:
    """The stream was recreated (fewer events than the checkpoint): rebuild, not ignore."""
    db = tmp_path / "read.db"
    async with Projector(nc, db) as projector:
        await setup_org(app, "net", "app")
        await settle(projector, store)
    async with EmbeddedNats(tmp_path / "fresh-nats") as other:
        conn = await other.connect()
        try:
            await streams.declare(conn, conn.jetstream())
            await process(conn).app.create_org("newco", "admin")
            async with Projector(conn, db) as rebuilt:
                assert await rebuilt.wait_for(1, timeout=10)
                assert await rebuilt.read.orgs.get("newco") is not None
                assert await rebuilt.read.orgs.get(ORG) is None
                assert rebuilt.seq == 1
        finally:
            await conn.close()
