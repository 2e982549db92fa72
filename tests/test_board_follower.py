"""The reaper's board is folded by an ordered consumer (`heartbeats.Follower`): a round
costs what changed on the board, not a read of every entry, and still sees the board
as its leader has it (the clock message read back), purges included."""

from __future__ import annotations

from contextlib import AsyncExitStack
from datetime import UTC, datetime
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from infra.heartbeats import Board, BoardError, Follower, body, subject
from infra.natsserver import EmbeddedNats
from tests.bootstrap_support import built
from tests.helpers import eventually

ENTRIES = 2000


async def fill(nc: NATS, n: int = ENTRIES) -> None:
    for i in range(n):
        await nc.publish(subject(f"run{i:05d}", "plan"), body(lease_id=f"l{i}", timeout=3600))
    await nc.flush()


def received(nc: NATS) -> int:
    return int(nc.stats["in_msgs"])


async def test_a_reaper_round_receives_what_changed_not_the_whole_board(
    nats_server: EmbeddedNats, nc: NATS, tmp_path: Path
) -> None:
    """2,000 live phases: after the first round, a round with three new beats takes in a
    handful of messages (the clock, acks, the changed entries), not 2,000 (the old
    snapshot read every entry every round)."""
    await fill(nc)
    conn = await nats_server.connect()
    try:
        async with AsyncExitStack() as stack:  # the reaper's own process
            reaper = built(conn, stack, tmp_path).reaper()
            try:
                await reaper.reap_once()  # the first round folds the board as it is
                for i in range(3):
                    await nc.publish(subject(f"new{i}", "plan"), body(lease_id="x", timeout=3600))
                await nc.flush()
                before = received(conn)
                await reaper.reap_once()
                assert received(conn) - before < 50
                assert {f"new{i}" for i in range(3)} <= {
                    b.run_id for b in reaper.fold.entries.values()
                }
            finally:
                await reaper.fold.stop()
    finally:
        await conn.close()


async def test_a_snapshot_has_everything_written_before_it_with_the_servers_now(
    nc: NATS,
) -> None:
    board = Board(nc)
    follower = Follower(board)
    try:
        await fill(nc, 500)
        now, beats = await follower.snapshot()
        assert sorted(b.run_id for b in beats) == [f"run{i:05d}" for i in range(500)]
        for b in beats[:50]:  # to the microsecond what a direct get answers (markers keep it)
            assert b == await board.last(b.run_id, "plan")
        assert max(b.time for b in beats) <= now
        assert abs((datetime.now(UTC) - now).total_seconds()) < 60
        assert await board.put(subject("run00007", "plan"), body(lease_id="again", timeout=60))
        later, beats = await follower.snapshot()  # written just before: in it, not later
        assert later >= now
        assert {b.run_id: b.lease_id for b in beats}["run00007"] == "again"
        assert len(beats) == 500
    finally:
        await follower.stop()


async def test_purges_here_leave_the_fold_at_once_and_others_at_the_next_listing(
    nats_server: EmbeddedNats, nc: NATS, monkeypatch: pytest.MonkeyPatch
) -> None:
    board = Board(nc)
    follower = Follower(board, reconcile_s=3600)
    other = await nats_server.connect()
    try:
        await fill(nc, 10)
        _, beats = await follower.snapshot()
        assert len(beats) == 10
        await board.purge(subject("run00001", "plan"))  # this process: at once
        await Board(other).purge(subject("run00002", "plan"))  # another one's
        _, beats = await follower.snapshot()
        shown = {b.run_id for b in beats}
        assert "run00001" not in shown and "run00002" in shown
        follower.reconcile_s = 0  # the next snapshot lists the stream's subjects
        _, beats = await follower.snapshot()
        shown = {b.run_id for b in beats}
        assert "run00002" not in shown and len(shown) == 8
        # a purge up to an older sequence keeps the newer entry
        assert await board.put(subject("run00003", "plan"), body(lease_id="newer"))
        await board.purge(subject("run00003", "plan"), through=1)
        _, beats = await follower.snapshot()
        assert {b.run_id: b.lease_id for b in beats}["run00003"] == "newer"
    finally:
        await follower.stop()
        await other.close()


async def test_the_fold_keeps_up_after_the_server_restarts(
    nats_server: EmbeddedNats, nc: NATS
) -> None:
    board = Board(nc)
    follower = Follower(board)
    try:
        await fill(nc, 5)
        await follower.snapshot()
        await nats_server.stop()
        async with EmbeddedNats(nats_server.data_dir, port=nats_server.port):

            async def caught_up() -> bool:
                await board.put(subject("after", "plan"), body(lease_id="a", timeout=60))
                try:
                    _, beats = await follower.snapshot()
                except BoardError as e:  # the round fails: the reaper's next one retries
                    raise AssertionError(str(e)) from e
                assert "after" in {b.run_id for b in beats}
                assert len(beats) == 6
                return True

            await eventually(caught_up, timeout=20, what="the fold after a restart")
    finally:
        await follower.stop()
