"""A run's owner and deadline come from the read model: the heartbeat board folded into
`run_liveness` (projections/board.py), decided by one pure function
(projections/liveness.py); a GET of a run reads them with its row and asks NATS nothing.

- the decision, given stored values (no I/O);
- the fold: an older message never replaces a newer one, a redelivery changes nothing,
  a purge is applied, and a fold from sequence 1 gives the rows the live fold has;
- the API: a GET and a list answer with no NATS request, the board writes of the same
  process already in them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiosqlite
import pytest
from nats.aio.client import Client as NATS

from infra.heartbeats import DEADLINE, Board, body, subject
from infra.natsserver import EmbeddedNats
from infra.streams import HEARTBEATS
from projections import schema
from projections.board import BoardFold, apply_board
from projections.liveness import Entry, Limits, iso, liveness
from projections.ordered import Delivered
from services.app.commands import App
from tests.api_support import Http, http_fixture  # noqa: F401  # registers the `http` fixture
from tests.builders import queued_run
from tests.helpers import eventually
from tests.reaper_support import ORG, beat, claim, workspace

T0 = datetime(2030, 1, 1, tzinfo=UTC)
ISO0 = "2030-01-01T00:00:00.000000Z"


def at(seconds: float) -> str:
    return str(iso(T0 + timedelta(seconds=seconds)))


def entry(lease: str = "", **kw: Any) -> Entry:
    fields: dict[str, Any] = {
        "at": T0,
        "lease_id": lease,
        "executor_id": "e1" if lease else "",
        "timeout": 0,
        "recheck": 0,
        "dispatched_at": None,
    }
    return Entry(**(fields | kw))


# ---------------------------------------------------------------- the decision (pure)


def test_a_running_phase_whose_entry_holds_a_lease_has_that_owner_and_no_deadline() -> None:
    shown = liveness("planning", "plan", entry("L1"), Limits(None, None))
    assert shown == {
        "owner": {"executor_id": "e1", "lease_id": "L1", "last_beat_at": ISO0},
        "deadline": None,
    }


def test_a_waiting_phase_shows_its_dispatch_timeout_before_its_check() -> None:
    marker = entry(timeout=30, recheck=60, dispatched_at=T0 - timedelta(seconds=10))
    shown = liveness("queued", "plan", marker, None)
    assert shown == {"owner": None, "deadline": {"kind": "dispatch_timeout", "at": at(20)}}
    forever = entry(recheck=60)  # no dispatch timeout: when the reaper looks next
    shown = liveness("apply_queued", "apply", forever, None)
    assert shown["deadline"] == {"kind": "dispatch_check", "at": at(60)}


def test_limits_count_by_status_and_the_earliest_deadline_is_shown() -> None:
    limits = Limits(T0 + timedelta(seconds=100), T0 + timedelta(seconds=50))
    assert liveness("awaiting_approval", "", None, limits)["deadline"] == {
        "kind": "approval_timeout",
        "at": at(50),
    }
    assert liveness("pending", "", None, limits)["deadline"] == {
        "kind": "run_timeout",
        "at": at(100),
    }
    # an apply is never interrupted by a limit; a check waits behind a real deadline
    assert liveness("applying", "apply", entry("L2"), limits)["deadline"] is None
    shown = liveness("queued", "plan", entry(recheck=1), limits)
    assert shown["deadline"] == {"kind": "run_timeout", "at": at(100)}


@pytest.mark.parametrize("status", ["applied", "failed", "canceled", "discarded", "planned"])
def test_an_ended_run_has_neither_whatever_the_board_still_holds(status: str) -> None:
    limits = Limits(T0, T0)
    assert liveness(status, "plan", entry("L1"), limits) == {"owner": None, "deadline": None}


# ---------------------------------------------------------------- the fold


def msg(
    seq: int, run_id: str, phase: str = "plan", *, seconds: float = 0, **fields: Any
) -> Delivered:
    when = T0 + timedelta(seconds=seconds)
    ns = int(when.timestamp()) * 1_000_000_000 + when.microsecond * 1000
    return Delivered(seq, subject(run_id, phase), body(**fields), ns)


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[aiosqlite.Connection]:
    conn = await schema.connect(tmp_path / "rm.sqlite")
    yield conn
    await conn.close()


async def rows(db: aiosqlite.Connection) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in await db.execute_fetchall(f"{schema.LIVENESS.select_sorted}")]


async def test_an_older_beat_never_replaces_a_newer_and_a_redelivery_changes_nothing(
    db: aiosqlite.Connection,
) -> None:
    assert await apply_board(db, [msg(10, "r1", lease_id="new", seconds=10)], [], after=0) == 10
    # an older message of the subject folded later (a rebuild below the row's sequence)
    await apply_board(db, [msg(4, "r1", lease_id="old", seconds=4)], [], after=0)
    [(run_id, phase, seq, when, lease, *_)] = await rows(db)
    assert (run_id, phase, seq, when, lease) == ("r1", "plan", 10, at(10), "new")
    # a redelivery at or below the checkpoint is skipped, the checkpoint stays
    assert await apply_board(db, [msg(10, "r1", lease_id="again")], [], after=10) == 10
    assert (await rows(db))[0][4] == "new"
    # within one batch, each subject's newest message wins, whatever the order handed in
    batch = [msg(12, "r1", lease_id="b", seconds=12), msg(11, "r1", lease_id="a", seconds=11)]
    assert await apply_board(db, batch, [], after=10) == 12
    assert [(r[2], r[4]) for r in await rows(db)] == [(12, "b")]
    assert await schema.checkpoint(db, schema.BOARD_CHECKPOINT) == 12


async def test_a_purge_drops_what_it_covers_and_keeps_what_came_after(
    db: aiosqlite.Connection,
) -> None:
    await apply_board(db, [msg(1, "r1"), msg(2, "r2"), msg(3, "r3", DEADLINE)], [], after=0)
    # r1 purged whole; r2 purged through 2 while its newer beat (5) is in the batch;
    # r3's purge through 1 is older than its row
    purges = [
        (subject("r1", "plan"), None),
        (subject("r2", "plan"), 2),
        (subject("r3", DEADLINE), 1),
    ]
    await apply_board(db, [msg(5, "r2", lease_id="L")], purges, after=3)
    assert [(r[0], r[1], r[2]) for r in await rows(db)] == [("r2", "plan", 5), ("r3", DEADLINE, 3)]
    # a beat purged before it was folded does not come back with its batch
    await apply_board(db, [msg(6, "r4")], [(subject("r4", "plan"), 6)], after=5)
    assert "r4" not in {r[0] for r in await rows(db)}


async def test_clock_messages_alone_write_nothing(db: aiosqlite.Connection) -> None:
    clock = Delivered(7, "rp.hb._clock.now", b"", 0)
    assert await apply_board(db, [clock], [], after=0) == 7
    assert await rows(db) == []


async def test_a_read_model_without_the_board_tables_gains_them_and_keeps_its_rows(
    tmp_path: Path,
) -> None:
    """A read model made before the board was folded is not rebuilt: the events' fold is
    unchanged; the board's tables are created empty, to be folded from the start."""
    path = tmp_path / "old.sqlite"
    conn = await schema.connect(path)
    await conn.execute("UPDATE checkpoint SET seq = 41 WHERE id = 1")
    await conn.execute("INSERT INTO orgs (name) VALUES ('acme')")
    await conn.execute("DROP TABLE run_liveness")
    await conn.execute("DROP TABLE board_checkpoint")
    await conn.close()
    conn = await schema.connect(path)
    try:
        assert await schema.checkpoint(conn) == 41
        assert list(await conn.execute_fetchall("SELECT name FROM orgs")) == [("acme",)]
        assert await schema.checkpoint(conn, schema.BOARD_CHECKPOINT) == 0
        assert await rows(conn) == []
    finally:
        await conn.close()


async def fold_rows(path: Path) -> list[tuple[Any, ...]]:
    async with aiosqlite.connect(path) as conn:
        return [tuple(r) for r in await conn.execute_fetchall(schema.LIVENESS.select_sorted)]


async def folded(db: aiosqlite.Connection, nc: NATS, **kw: Any) -> BoardFold:
    fold = BoardFold(nc, db, asyncio.Lock(), **kw)
    await fold.start()
    return fold


async def caught_up(fold: BoardFold, nc: NATS) -> bool:
    last = (await nc.jetstream().stream_info(HEARTBEATS)).state.last_seq
    assert fold.seq >= last, (fold.seq, last)
    return True


async def test_a_fold_from_the_start_gives_the_live_folds_rows_and_a_restart_resumes(
    nats_server: EmbeddedNats, nc: NATS, tmp_path: Path
) -> None:
    """Writes, rewrites, a purge here and one by another process: once the live fold has
    listed the stream's subjects, its rows are those of a fold of the stream from
    sequence 1 (which holds each subject's last message); stopped and started again, it
    resumes from its checkpoint."""
    board, other = Board(nc), await nats_server.connect()
    live_db = await schema.connect(tmp_path / "live.sqlite")
    try:
        live = await folded(live_db, nc, reconcile_s=0.2)
        marker = body(kind=DEADLINE, run_deadline=T0.isoformat(), version=3)
        for run_id in ("r1", "r2", "r3"):
            assert await board.put(subject(run_id, "plan"), body(lease_id=f"{run_id}-a"))
        assert await board.put(subject("r1", DEADLINE), marker)
        assert await board.put(subject("r1", "plan"), body(lease_id="r1-b", executor_id="e"))
        await board.put("rp.hb._clock.now", b"")
        await board.purge(subject("r2", "plan"))  # here: heard of at once
        await Board(other).purge(subject("r3", "plan"))  # elsewhere: at the next listing
        assert await live.settle(5)
        await eventually(lambda: caught_up(live, nc), what="the live fold")

        async def listed() -> bool:
            shown = {r[0] for r in await fold_rows(tmp_path / "live.sqlite")}
            assert shown == {"r1"}, shown
            return True

        await eventually(listed, what="the other process's purge folded")
        fresh_db = await schema.connect(tmp_path / "fresh.sqlite")
        fresh = await folded(fresh_db, other)
        try:
            await eventually(lambda: caught_up(fresh, other), what="the fold from the start")
        finally:
            await fresh.stop()
            await fresh_db.close()
        want = await fold_rows(tmp_path / "fresh.sqlite")
        assert await fold_rows(tmp_path / "live.sqlite") == want
        assert [(r[0], r[1], r[4]) for r in want] == [("r1", DEADLINE, ""), ("r1", "plan", "r1-b")]

        await live.stop()
        stopped_at = await schema.checkpoint(live_db, schema.BOARD_CHECKPOINT)
        assert stopped_at > 0
        assert await board.put(subject("r4", "plan"), body(lease_id="r4-a"))
        again = await folded(live_db, nc, reconcile_s=3600)
        assert again.seq == stopped_at  # resumed from the checkpoint, not from 1
        try:
            await eventually(lambda: caught_up(again, nc), what="the fold resumed")
            shown = await fold_rows(tmp_path / "live.sqlite")
            assert [(r[0], r[1]) for r in shown] == [
                ("r1", DEADLINE),
                ("r1", "plan"),
                ("r4", "plan"),
            ]
        finally:
            await again.stop()
    finally:
        await live_db.close()
        await other.close()


# ---------------------------------------------------------------- the API


class Counted:
    """Every request and publish made on a connection while counting."""

    def __init__(self, nc: NATS, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sent: list[str] = []
        self.counting = False
        request, publish = nc.request, nc.publish

        async def counted_request(subj: str, *args: Any, **kw: Any) -> Any:
            if self.counting:
                self.sent.append(subj)
            return await request(subj, *args, **kw)

        async def counted_publish(subj: str, *args: Any, **kw: Any) -> Any:
            if self.counting:
                self.sent.append(subj)
            return await publish(subj, *args, **kw)

        monkeypatch.setattr(nc, "request", counted_request)
        monkeypatch.setattr(nc, "publish", counted_publish)


async def test_a_get_and_a_list_of_runs_ask_nats_nothing(
    http: Http, app: App, nc: NATS, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A planning run shows its owner, a queued one its dispatch timeout: read with their
    rows from the read model, with no request or publish on the connection (the board
    used to be asked up to three times per run). The beat and marker written through
    this process are in the answer at once."""
    await workspace(app, "net")
    await workspace(app, "dns")
    planning = await queued_run(app, "net")
    lease = await claim(app, "net", planning)
    board = Board(nc)
    await beat(board, "net", planning, lease, 600)
    waiting = await queued_run(app, "dns")
    assert await board.put(subject(waiting, "plan"), body(org=ORG, workspace="dns", timeout=45))
    seq = str(await app.store.last_seq())
    assert http.api.projector.board is not None
    http.api.projector.board.reconcile_s = 3600  # its own listing is no answer's question
    counted = Counted(nc, monkeypatch)

    counted.counting = True
    run = (await http.get(f"/api/v1/orgs/{ORG}/runs/{planning}", headers={"RP-Min-Seq": seq})).body
    queued = (await http.get(f"/api/v1/orgs/{ORG}/runs/{waiting}")).body
    listed = (await http.get(f"/api/v1/orgs/{ORG}/runs")).body["items"]
    counted.counting = False

    assert counted.sent == []
    assert (run["status"], run["owner"]["lease_id"], run["owner"]["executor_id"]) == (
        "planning",
        lease,
        "t",
    )
    assert run["deadline"] is None
    assert (queued["status"], queued["owner"], queued["deadline"]["kind"]) == (
        "queued",
        None,
        "dispatch_timeout",
    )
    assert {r["id"]: (r["owner"], r["deadline"]) for r in listed} == {
        planning: (run["owner"], None),
        waiting: (None, queued["deadline"]),
    }
