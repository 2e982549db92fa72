"""Replay: a rebuild from sequence 1 gives the very rows the live projector wrote."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from events.codec import encode, run_subject, ws_subject
from events.org import OrgCreated
from events.run import PlanFinished, PlanSummary, RunCreated, RunQueued, Workspace
from events.workspace import RunAdmitted, RunEnqueued, RunReleased, WorkspaceCreated
from infra.eventstore import EventStore
from projections import Projector, ReplayError, replay
from projections.batch import apply_batch
from projections.ordered import OrderedReader
from projections.readmodel import ReadModel
from projections.schema import connect
from services.app.commands import App
from tests.projection_support import ORG, settle, varied_history


async def dump_of(path: Path) -> dict[str, list[tuple[object, ...]]]:
    async with await ReadModel.open(path) as read:
        return await read.dump()


async def test_replay_reproduces_the_live_read_model_exactly(
    app: App, nc: NATS, store: EventStore, tmp_path: Path
) -> None:
    """After every kind of outcome and a poison message, live and replayed rows are equal."""
    async with Projector(nc, tmp_path / "live.db") as live:
        runs = await varied_history(app)
        await nc.jetstream().publish("rp.run.x.y.z", b"not json")
        await settle(live, store)
        live_dump = await live.read.dump()
        statuses = {
            name: (await live.read.runs.get(ORG, run_id) or {}).get("status")
            for name, run_id in runs.items()
        }
    reached = {name: name for name in runs}
    reached |= {"failed_step": "failed", "failed_reaped": "failed", "unattended_apply": "applied"}
    assert statuses == reached

    last = await store.last_seq()
    applied = await replay(nc, tmp_path / "replayed.db")
    assert applied == last - 1  # every event but the poison message
    assert await dump_of(tmp_path / "replayed.db") == live_dump
    assert len(live_dump["events"]) == last - 1 and len(live_dump["skipped"]) == 1


async def test_replay_swaps_the_file_atomically_and_the_projector_resumes_after_it(
    app: App, nc: NATS, store: EventStore, tmp_path: Path
) -> None:
    db = tmp_path / "read.db"
    async with Projector(nc, db) as live:
        await varied_history(app)
        await settle(live, store)
    assert await replay(nc, db) == await store.last_seq()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    await app.create_run(ORG, "net", "plan", "alice")
    async with Projector(nc, db) as resumed:
        await settle(resumed, store)
        resumed_dump = await resumed.read.dump()
    await replay(nc, tmp_path / "full.db")
    assert await dump_of(tmp_path / "full.db") == resumed_dump


async def test_replay_refuses_a_database_a_projector_still_has_open(
    app: App, nc: NATS, store: EventStore, tmp_path: Path
) -> None:
    """Renaming under a live WAL connection would corrupt it: refuse, keep everything."""
    db = tmp_path / "read.db"
    async with Projector(nc, db) as live:
        await app.create_org(ORG, "admin")
        await settle(live, store)
        with pytest.raises(ReplayError, match="open elsewhere"):
            await replay(nc, db)
        assert [p.name for p in tmp_path.iterdir() if p.suffix == ".replay"] == []
        result = await app.create_org("other", "admin")
        assert await live.wait_for(result.seq)
        assert await live.read.orgs.get("other") is not None


async def test_replay_of_an_empty_stream_builds_an_empty_model(nc: NATS, tmp_path: Path) -> None:
    assert await replay(nc, tmp_path / "read.db") == 0
    dump = await dump_of(tmp_path / "read.db")
    assert dump.pop("checkpoint") == [(1, 0)]
    assert all(rows == [] for rows in dump.values())


async def test_messages_at_or_below_the_checkpoint_change_nothing(
    app: App, nc: NATS, store: EventStore, tmp_path: Path
) -> None:
    """Redelivery is harmless: a batch entirely at or below the checkpoint is a no-op."""
    db_path = tmp_path / "read.db"
    await varied_history(app)
    await replay(nc, db_path)
    before = await dump_of(db_path)
    last = await store.last_seq()
    db = await connect(db_path)
    try:
        async with OrderedReader(nc, "RP_EVENTS", start_seq=1) as reader:
            batch = await reader.next_batch(10_000, timeout=5)
            while reader.last < last:
                batch += await reader.next_batch(10_000, timeout=5)
        result = await apply_batch(db, batch, after=last)
    finally:
        await db.close()
    assert (result.last_seq, result.events, result.skipped) == (last, 0, 0)
    assert await dump_of(db_path) == before


# ---------------------------------------------------------------- throughput


async def _publish_history(nc: NATS, runs: int) -> int:
    """Many complete run lifecycles, published without checks (the fastest way in)."""
    t = datetime(2025, 1, 1, tzinfo=UTC)
    config = Workspace(repository="/repo")
    n = 0

    async def put(subject: str, event: object) -> None:
        nonlocal n
        await nc.publish(subject, encode(event))  # type: ignore[arg-type]  # an event
        n += 1

    await put("rp.org.acme", OrgCreated(at=t, actor="a", name="acme"))
    await put(
        ws_subject("acme", "net"),
        WorkspaceCreated(at=t, actor="a", org="acme", name="net", config=config),
    )
    for i in range(runs):
        t += timedelta(milliseconds=1)
        rid, subject, ws = f"r{i:07d}", run_subject("acme", "net", f"r{i:07d}"), "net"
        await put(
            subject,
            RunCreated(
                at=t,
                actor="a",
                run_id=rid,
                org="acme",
                workspace=ws,
                run_type="plan",
                config=config,
            ),
        )
        await put(ws_subject("acme", ws), RunEnqueued(at=t, actor="a", run_id=rid))
        await put(ws_subject("acme", ws), RunAdmitted(at=t, actor="s", run_id=rid))
        await put(subject, RunQueued(at=t, actor="s"))
        await put(
            subject,
            PlanFinished(
                at=t, actor="e", lease_id="", commit="c", has_changes=False, summary=PlanSummary()
            ),
        )
        await put(
            ws_subject("acme", ws), RunReleased(at=t, actor="e", run_id=rid, status="no_changes")
        )
    await nc.flush()
    return n


@pytest.mark.slow
async def test_replay_rebuilds_tens_of_thousands_of_events_per_second(
    nc: NATS, store: EventStore, tmp_path: Path
) -> None:
    published = await _publish_history(nc, 20_000)
    while await store.last_seq() < published:
        await nc.flush()
    started = time.perf_counter()
    applied = await replay(nc, tmp_path / "read.db")
    rate = applied / (time.perf_counter() - started)
    print(f"replayed {applied} events at {rate:,.0f}/s")
    assert applied == published
    assert rate > 10_000  # ~25,000-30,000/s measured; a floor well under it to stay stable
