"""The reaper against a real nats-server: silent executors, unclaimed phases, races.

Executors are played by the test (claims through the App, beats on the board) so that
each timing is pinned; tests/test_reaper_processes.py does it with real processes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from events import run as R
from events.errors import IllegalTransition
from events.workspace import RunReleased
from infra import heartbeats
from infra.eventstore import EventStore
from infra.heartbeats import Board, body, subject
from infra.natsserver import EmbeddedNats
from services.app.commands import App
from services.processes.scheduler.reaper import Reaper, Verdict, silent_guard
from tests.bootstrap_support import Process, System
from tests.builders import queued_run
from tests.helpers import eventually
from tests.reaper_support import ORG, beat, claim, failures, reaches, state, workspace


@pytest.fixture
def board(nc: NATS) -> Board:
    return Board(nc)


@pytest.fixture
async def reaper(nc: NATS, app: App) -> AsyncIterator[Reaper]:
    async with Reaper(nc, app, interval=0.1) as r:
        yield r


# ---------------------------------------------------------------- silent executors


async def test_a_silent_executor_fails_its_run_after_the_heartbeat_timeout(
    app: App, board: Board, reaper: Reaper
) -> None:
    """No beat for heartbeat_timeout seconds: failed by the reaper, workspace released."""
    await workspace(app, "net", heartbeat=1)
    run_id = await queued_run(app, "net")
    lease = await claim(app, "net", run_id)
    await beat(board, "net", run_id, lease, timeout=1)
    silent_since = time.monotonic()

    failed = await reaches(app, "net", run_id, "failed")
    waited = time.monotonic() - silent_since
    assert 0.9 <= waited < 2.5, waited
    assert failed.reason == "executor_unavailable"
    assert "executor t sent no heartbeat" in failed.error_message
    assert "heartbeat timeout 1s" in failed.error_message
    [event] = await failures(app, "net", run_id)
    assert (event.actor, event.lease_id) == ("reaper", "")

    async def released() -> bool:  # the release is the append after the failure's
        return not (await app.load_ws(ORG, "net")).state.active

    await eventually(released, timeout=10, what="the workspace released with the failure")
    await eventually(_gone(board, run_id), what="the board entry purged")


async def test_silence_while_the_reaper_could_not_see_nats_does_not_count(
    nc: NATS, app: App, board: Board
) -> None:
    """After a round that could not read the board (NATS away: executors could not beat
    either), an entry's silence counts from the first round back, not from its last beat;
    a reaper that never lost sight judges by the beat alone."""
    await workspace(app, "net", heartbeat=1)
    run_id = await queued_run(app, "net")
    lease = await claim(app, "net", run_id)
    await beat(board, "net", run_id, lease, timeout=1)
    await asyncio.sleep(1.3)  # the beat is now older than its timeout
    blind = Reaper(nc, app)
    blind.lost_sight()
    assert await blind.reap_once() == []  # silence restarts now
    assert (await state(app, "net", run_id)).status == R.Status.PLANNING
    await asyncio.sleep(1.2)
    [(_, verdict)] = await blind.reap_once()
    assert verdict == Verdict.FAIL_SILENT
    await reaches(app, "net", run_id, "failed")

    run2 = await queued_run(app, "net")
    lease2 = await claim(app, "net", run2)
    await beat(board, "net", run2, lease2, timeout=1)
    await asyncio.sleep(1.3)
    [(_, verdict)] = await Reaper(nc, app).reap_once()  # never blind: judged at once
    assert verdict == Verdict.FAIL_SILENT


async def test_beats_keep_a_run_alive_and_only_the_servers_clock_counts(
    nc: NATS, store: EventStore, board: Board, process: Process
) -> None:
    """Beats whose `at` lies (an executor's clock a day behind) and a reaper whose clock
    runs an hour ahead change nothing: ages are measured on the server's timestamps."""
    skewed = process(store=store, clock=lambda: datetime.now(UTC) + timedelta(hours=1)).app
    await workspace(skewed, "net", heartbeat=1)
    run_id = await queued_run(skewed, "net")
    lease = await claim(skewed, "net", run_id)
    lie = (datetime.now(UTC) - timedelta(days=1)).isoformat()
    async with Reaper(nc, skewed, interval=0.1):
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # three timeouts, beating every 0.3 s
            await beat(board, "net", run_id, lease, timeout=1, at=lie)
            await asyncio.sleep(0.3)
            assert (await state(skewed, "net", run_id)).status == R.Status.PLANNING
        await reaches(skewed, "net", run_id, "failed")


async def test_an_entry_without_a_timeout_is_judged_by_the_runs_configuration(
    app: App, board: Board, reaper: Reaper
) -> None:
    """An older executor's beat (no org, workspace or timeout): the run's config decides."""
    await workspace(app, "net", heartbeat=1)
    run_id = await queued_run(app, "net")
    lease = await claim(app, "net", run_id)
    assert await board.put(subject(run_id, "plan"), body(lease_id=lease, executor_id="old"))
    failed = await reaches(app, "net", run_id, "failed")
    assert failed.reason == "executor_unavailable"


async def test_an_executor_dead_between_claim_and_first_beat_is_reaped(
    app: App, system: System, board: Board, reaper: Reaper
) -> None:
    """The scheduler beats on a fresh lease's behalf when it sees `run.phase_started`."""
    await workspace(app, "net", heartbeat=1)
    async with system.scheduler():
        run_id = str((await app.create_run(ORG, "net", "apply", "alice")).state.run_id)
        await reaches(app, "net", run_id, "queued")
        lease = await claim(app, "net", run_id)  # ...and the executor dies: it never beats

        async def beaten() -> heartbeats.Beat:  # (the `dispatched` marker comes first)
            entry = await board.last(run_id, "plan")
            assert entry is not None and (entry.lease_id, entry.body.kind) == (lease, "claimed")
            return entry

        await eventually(beaten, what="a beat for the lease")
        failed = await reaches(app, "net", run_id, "failed")
    assert failed.reason == "executor_unavailable"


async def test_the_claimed_beat_never_overwrites_the_executors_own(app: App, board: Board) -> None:
    """Adopting a lease that already beat publishes nothing (no older news over newer)."""
    from services.processes.scheduler.watch import adopt

    await workspace(app, "net", heartbeat=60)
    run_id = await queued_run(app, "net")
    lease = await claim(app, "net", run_id)
    await beat(board, "net", run_id, lease, timeout=60)
    before = await board.last(run_id, "plan")
    assert not await adopt(board, await state(app, "net", run_id))
    assert await board.last(run_id, "plan") == before


async def test_two_reapers_racing_fail_each_run_exactly_once(
    nats_server: EmbeddedNats, app: App, board: Board, process: Process
) -> None:
    """Two replicas, each on its own connection, judge the same stale runs at once."""
    await workspace(app, "net", heartbeat=1)
    runs = []
    for i in range(12):
        ws = f"ws{i}"
        await workspace(app, ws, heartbeat=1)
        run_id = await queued_run(app, ws)
        await beat(board, ws, run_id, await claim(app, ws, run_id), timeout=1)
        runs.append((ws, run_id))
    conns = [await nats_server.connect() for _ in range(2)]
    try:
        reapers = [process(c).reaper() for c in conns]  # each its own process
        await asyncio.sleep(1.2)  # let every beat go stale (the timeout is the subject here)
        rounds = await asyncio.gather(*(r.reap_once() for r in reapers))
    finally:
        for c in conns:
            await c.close()
    assert all(v == Verdict.FAIL_SILENT for rnd in rounds for _, v in rnd)
    for ws, run_id in runs:
        assert len(await failures(app, ws, run_id)) == 1, run_id
        envs = await app.store.read(f"rp.ws.{ORG}.{ws}")
        assert sum(isinstance(e.event, RunReleased) for e in envs) == 1


async def test_a_run_that_moved_on_is_never_failed_by_a_stale_judgement(
    app: App, board: Board
) -> None:
    """The guard re-checks the judged condition on the state the append expects."""
    await workspace(app, "net", heartbeat=1)
    run_id = await queued_run(app, "net")
    lease = await claim(app, "net", run_id)
    await beat(board, "net", run_id, lease, timeout=1)
    entry = await board.last(run_id, "plan")
    assert entry is not None
    finish = R.FinishPlan(
        actor="t", lease_id=lease, commit="c", has_changes=True, summary=R.PlanSummary(add=1)
    )
    await app.run_command(ORG, "net", run_id, finish)  # the plan ended just before the reaper
    reap = R.FailRun(actor="reaper", reason="executor_unavailable")
    with pytest.raises(IllegalTransition):
        await app.run_command(ORG, "net", run_id, reap, guard=silent_guard(entry))
    assert (await state(app, "net", run_id)).status == R.Status.AWAITING_APPROVAL


async def test_a_stale_entry_of_a_run_that_moved_on_is_purged_not_failed(
    app: App, board: Board
) -> None:
    await workspace(app, "net", heartbeat=1)
    run_id = await queued_run(app, "net")
    lease = await claim(app, "net", run_id)
    await beat(board, "net", run_id, lease, timeout=1)
    finish = R.FinishPlan(
        actor="t", lease_id=lease, commit="c", has_changes=True, summary=R.PlanSummary(add=1)
    )
    await app.run_command(ORG, "net", run_id, finish)
    await asyncio.sleep(1.1)  # the entry must be stale for the reaper to look at it
    [(_, verdict)] = await Reaper(board.nc, app, board=board).reap_once()
    assert verdict == Verdict.PURGE
    assert await board.last(run_id, "plan") is None
    assert (await state(app, "net", run_id)).status == R.Status.AWAITING_APPROVAL


def _gone(board: Board, run_id: str) -> Callable[[], Awaitable[bool]]:
    async def probe() -> bool:
        return await board.last(run_id, "plan") is None

    return probe


async def test_the_board_lists_every_phase_once_across_pages_with_the_servers_now(
    nc: NATS, board: Board
) -> None:
    """2,500 phases beaten twice each: one entry per phase (pages joined), the clock left
    out, and `now` (the server's) not before any entry's server time."""
    for _ in range(2):
        for i in range(2500):
            await nc.publish(subject(f"run{i:05d}", "plan"), body(lease_id=f"l{i}", timeout=60))
    await nc.flush()
    now, beats = await board.snapshot()
    assert sorted(b.run_id for b in beats) == [f"run{i:05d}" for i in range(2500)]
    assert all(b.body.lease_id == f"l{int(b.run_id[3:])}" for b in beats)
    assert max(b.time for b in beats) <= now


async def test_reading_a_big_board_leaves_room_for_the_other_work_of_the_process(
    nc: NATS, board: Board, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reaper shares the scheduler's event loop: a 5,000-entry board is parsed in
    slices of 50 with the loop's other tasks run between them, not a page at a time."""
    for i in range(5000):
        await nc.publish(subject(f"run{i:05d}", "plan"), body(lease_id=f"l{i}", timeout=60))
    await nc.flush()
    turns = 0  # how often another task got the loop
    seen: list[int] = []  # `turns` as each entry was parsed

    async def ticker() -> None:
        nonlocal turns
        while True:
            await asyncio.sleep(0)
            turns += 1

    real = heartbeats.parse

    def parse(hdrs: dict[str, str], data: bytes) -> Any:
        seen.append(turns)
        return real(hdrs, data)

    monkeypatch.setattr(heartbeats, "parse", parse)
    tick = asyncio.create_task(ticker())
    try:
        _, beats = await board.snapshot()
    finally:
        tick.cancel()
    assert len(beats) == 5000
    slices = [seen[i : i + 50] for i in range(0, len(seen), 50)]
    assert len(set(seen)) >= len(slices)  # the loop turned between every two slices
