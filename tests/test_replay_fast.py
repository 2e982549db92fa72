"""The replay's own fill (`projections/fill.py`): folded from rows it keeps in memory,
written by a thread in multi-row statements, it must still give the live projection's
rows exactly, whatever the batch size and however little it keeps."""

from __future__ import annotations

import gc
import sqlite3
import sys
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from itertools import count, zip_longest
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from events import run as run_agg
from events.codec import AnyEvent, encode, run_subject, ws_subject
from events.org import OrgCreated
from events.run import (
    AdmitRun,
    ApproveRun,
    CancelRun,
    ClaimPhase,
    CreateRun,
    FailRun,
    FinishApply,
    FinishPlan,
    FinishStep,
    PlanSummary,
    ReportResource,
    RunCommand,
    StartStep,
    Workspace,
)
from events.values import ResourceChange
from events.workspace import (
    RunAdmitted,
    RunEnqueued,
    RunReleased,
    StatePushed,
    VariablesSet,
    WorkspaceCreated,
    WorkspaceLocked,
    WorkspaceUnlocked,
)
from infra.eventstore import EventStore
from projections import fill as fill_mod
from projections import replay
from projections.batch import apply_batch
from projections.fill import Rows, Writer, create_indexes, fill, replay_runtime, statements
from projections.ordered import Delivered, OrderedReader
from projections.readmodel import ReadModel
from projections.schema import BY_NAME, EVENTS, TABLES, connect
from projections.working import Working
from tests.bootstrap_support import System
from tests.projection_support import T0, decide_all

ORG = "acme"
CONFIG = Workspace(repository="/repo")

PLAN = [
    ResourceChange(address="t.a", type="t", action="create"),
    ResourceChange(address="t.rep", type="t", action="replace", replace_paths=["name"]),
    ResourceChange(address="t.c", type="t", action="update"),
    ResourceChange(address="data.t.d", type="t", action="read"),
]


def _run_commands(run_id: str, ws: str, ending: str) -> list[RunCommand]:
    """A run through plan, approval and apply with resource reports, ending as told."""
    plan_lease, apply_lease = f"{run_id}-p", f"{run_id}-a"

    def report(address: str, action: str, state: str) -> ReportResource:
        return ReportResource(
            actor="x", lease_id=apply_lease, address=address, action=action, state=state
        )

    commands: list[RunCommand] = [
        CreateRun(
            actor="alice",
            run_id=run_id,
            org=ORG,
            workspace=ws,
            run_type="apply",
            config=CONFIG,
            message=f"run {run_id}",
        ),
        AdmitRun(actor="s"),
        ClaimPhase(actor="x", phase="plan", lease_id=plan_lease, executor_id="x"),
        StartStep(actor="x", lease_id=plan_lease, step="init"),
        FinishStep(actor="x", lease_id=plan_lease, step="init", ok=True, started_at=T0),
        StartStep(actor="x", lease_id=plan_lease, step="plan"),
        FinishStep(actor="x", lease_id=plan_lease, step="plan", ok=True, started_at=T0),
        FinishPlan(
            actor="x",
            lease_id=plan_lease,
            commit="c",
            has_changes=True,
            summary=PlanSummary(add=1, change=1, destroy=1),
            changes=PLAN,
        ),
    ]
    if ending == "canceled":
        return [*commands, CancelRun(actor="bob")]
    commands += [
        ApproveRun(actor="bob"),
        ClaimPhase(actor="x", phase="apply", lease_id=apply_lease, executor_id="x"),
        StartStep(actor="x", lease_id=apply_lease, step="apply"),
        report("t.rep", "delete", "applying"),
        report("t.rep", "delete", "done"),
        report("t.rep", "create", "applying"),
        report("t.c", "update", "applying"),
    ]
    if ending == "failed":
        return [*commands, FailRun(actor="reaper", reason="executor_unavailable")]
    if ending == "open":  # still applying: a step running, resources pending and applying
        return commands
    return [
        *commands,
        report("t.rep", "create", "done"),
        report("t.c", "update", "done"),
        report("t.a", "create", "done"),
        FinishStep(actor="x", lease_id=apply_lease, step="apply", ok=True, started_at=T0),
        FinishApply(actor="x", lease_id=apply_lease, summary=PlanSummary(add=1)),
    ]


def _interleaved_history(recreate: bool = False) -> Iterator[tuple[str, AnyEvent | bytes]]:
    """Two workspaces and ten runs whose events are interleaved, so that most batches
    update rows an earlier batch created; a poison message; workspace locks. `recreate`:
    then a run created again (how that projects depends on where batches start)."""
    t = T0
    yield f"rp.org.{ORG}", OrgCreated(at=t, actor="admin", name=ORG)
    for ws in ("net", "app"):
        config = Workspace(repository="/repo", variables={"env": ws})
        yield (
            ws_subject(ORG, ws),
            WorkspaceCreated(at=t, actor="alice", org=ORG, name=ws, config=config),
        )
    lanes: list[list[tuple[str, AnyEvent | bytes]]] = []
    endings = ["applied", "failed", "canceled"]
    for i in range(10):
        run_id, ws = f"r{i}", ("net", "app")[i % 2]
        subject = run_subject(ORG, ws, run_id)
        at = T0 + timedelta(minutes=i)
        lane: list[tuple[str, AnyEvent | bytes]] = [
            (ws_subject(ORG, ws), RunEnqueued(at=at, actor="alice", run_id=run_id)),
            (ws_subject(ORG, ws), RunAdmitted(at=at, actor="s", run_id=run_id)),
        ]
        ending = "open" if i == 9 else endings[i % 3]
        lane += [(subject, e) for e in decide_all(_run_commands(run_id, ws, ending), i * 60)]
        lane.append(
            (ws_subject(ORG, ws), RunReleased(at=at, actor="x", run_id=run_id, status="applied"))
        )
        if i == 4:
            lane.insert(3, (ws_subject(ORG, ws), WorkspaceLocked(at=at, actor="bob", reason="x")))
            lane.insert(5, ("rp.run.acme.net.nope", b"not json"))
            lane.insert(7, (ws_subject(ORG, ws), WorkspaceUnlocked(at=at, actor="bob")))
            lane.insert(9, (ws_subject(ORG, ws), VariablesSet(at=at, actor="bob", variables={})))
            lane.insert(4, (ws_subject(ORG, ws), _pushed(at, ws)))  # under bob's lock
        lanes.append(lane)
    for step in zip_longest(*lanes):
        for pair in step:
            if pair is not None:
                yield pair
    if not recreate:
        return
    # Much later r9, still applying, is created again and canceled: skipped as "created
    # twice" when its row is in the batch, taken as a new run when the batch starts with
    # it (and then the cancel closes its old steps and stages).
    subject, at = run_subject(ORG, "app", "r9"), T0 + timedelta(hours=1)
    yield (
        subject,
        run_agg.RunCreated(
            at=at,
            actor="eve",
            run_id="r9",
            org=ORG,
            workspace="app",
            run_type="plan",
            config=CONFIG,
        ),
    )
    yield subject, run_agg.StepStarted(at=at, actor="x", lease_id="l", step="again")
    yield subject, run_agg.RunCanceled(at=at, actor="eve")


def _pushed(at: datetime, ws: str) -> StatePushed:
    """`terraform state push` by bob while he holds the workspace's lock."""
    return StatePushed(
        at=at,
        actor="bob",
        serial=3,
        lineage="l-1",
        digest="ab" * 32,
        object=f"{ORG}/{ws}/3-abababababababab",
        size=120,
        forced=True,
    )


async def _publish(nc: NATS, store: EventStore, *, recreate: bool = False) -> int:
    js = nc.jetstream()
    n = 0
    for subject, event in _interleaved_history(recreate):
        data = event if isinstance(event, bytes) else encode(event)
        await js.publish(subject, data)
        n += 1
    assert await store.last_seq() == n
    return n


async def _dump(path: Path) -> dict[str, list[tuple[object, ...]]]:
    async with await ReadModel.open(path) as read:
        return await read.dump()


async def _live(system: System, path: Path) -> dict[str, list[tuple[object, ...]]]:
    """The read model the api's projector makes live, at `path`."""
    async with system.projector(path, batch_size=500) as live:
        assert await live.wait_for(await system.store.last_seq(), timeout=10)
        return await live.read.dump()


class _Fixed:
    """A reader handing out the same batches every time (OrderedReader's depend on what
    has arrived)."""

    def __init__(self, batches: list[list[Delivered]]) -> None:
        self.batches = iter(batches)

    async def next_batch(self, max_msgs: int, timeout: float | None = None) -> list[Delivered]:
        return next(self.batches)


async def _batches(nc: NATS, store: EventStore, size: int) -> list[list[Delivered]]:
    msgs: list[Delivered] = []
    async with OrderedReader(nc, "RP_EVENTS", start_seq=1) as reader:
        while reader.last < await store.last_seq():
            msgs += await reader.next_batch(1000, timeout=5)
    return [msgs[i : i + size] for i in range(0, len(msgs), size)]


async def _apply_batches(path: Path, batches: list[list[Delivered]]) -> None:
    """What replay did before it had a fill of its own: `apply_batch` per batch."""
    db = await connect(path)
    try:
        seq = 0
        for batch in batches:
            seq = (await apply_batch(db, batch, after=seq)).last_seq
    finally:
        await db.close()


async def _fill_with(
    path: Path, batches: list[list[Delivered]], rows_of: Callable[[Writer], Rows]
) -> Rows:
    """Fill a new file in this process with the given `Rows`; return it."""
    db = await connect(path, fast_unsafe=True)
    await db.close()
    writer = Writer(path)
    try:
        await writer.open()
        rows = rows_of(writer)
        target = batches[-1][-1].seq
        reader: Any = _Fixed(batches)
        await fill(reader, writer, target, batch_size=0, idle_timeout=5, rows=rows)
        await writer.call(create_indexes)
    finally:
        await writer.close()
    return rows


# ---------------------------------------------------------------- equal to the live model


@pytest.mark.parametrize("batch_size", [1, 2, 7, 1000])
async def test_replay_in_any_batch_size_equals_the_live_projection(
    nc: NATS, store: EventStore, system: System, tmp_path: Path, batch_size: int
) -> None:
    """Later events update rows (runs, steps, changes, resource states, workspaces, the
    queue) that earlier batches created, in batches as small as one event."""
    published = await _publish(nc, store)
    live = await _live(system, tmp_path / "live.db")
    assert len(live["skipped"]) == 1
    assert all(live[t] for t in ("runs", "steps", "changes", "resource_states", "workspaces"))
    pushed = [r for r in live["state_versions"] if "bob" in r]
    assert len(pushed) == 1 and 3 in pushed[0], live["state_versions"]  # ws.state_pushed
    assert await replay(nc, tmp_path / "replayed.db", batch_size=batch_size) == published - 1
    assert await _dump(tmp_path / "replayed.db") == live


@pytest.mark.parametrize("size", [1, 3, 50])
async def test_the_fill_gives_apply_batchs_rows_for_the_same_batches(
    nc: NATS, store: EventStore, tmp_path: Path, size: int
) -> None:
    """However little `Rows` keeps (one run, one workspace: what earlier batches wrote is
    then read back from the file, behind their queued writes), each batch folds the rows
    `apply_batch` would have read, even for a run created a second time."""
    await _publish(nc, store, recreate=True)
    batches = await _batches(nc, store, size)
    await _apply_batches(tmp_path / "reference.db", batches)
    reference = await _dump(tmp_path / "reference.db")

    def tiny(writer: Writer) -> Rows:
        return Rows(writer, max_runs=1, max_workspaces=1)

    rows = await _fill_with(tmp_path / "tiny.db", batches, tiny)
    assert rows.reads > (10 if size < 50 else 0)
    assert await _dump(tmp_path / "tiny.db") == reference

    rows = await _fill_with(tmp_path / "roomy.db", batches, Rows)
    assert rows.reads == 0  # the file started empty: nothing it never wrote is read
    assert await _dump(tmp_path / "roomy.db") == reference


async def test_the_audit_row_keeps_each_event_exactly_as_stored(
    nc: NATS, store: EventStore, tmp_path: Path
) -> None:
    await _publish(nc, store)
    await replay(nc, tmp_path / "read.db", batch_size=5)
    stored: dict[int, bytes] = {}
    async with OrderedReader(nc, "RP_EVENTS", start_seq=1) as reader:
        while reader.last < await store.last_seq():
            for m in await reader.next_batch(100, timeout=5):
                stored[m.seq] = m.data
    with sqlite3.connect(tmp_path / "read.db") as conn:
        audit = dict(conn.execute("SELECT seq, data_json FROM events"))
        skipped = [seq for (seq,) in conn.execute("SELECT seq FROM skipped")]
    assert len(skipped) == 1
    assert {seq: data.encode() for seq, data in audit.items()} == {
        seq: data for seq, data in stored.items() if seq not in skipped
    }


# ---------------------------------------------------------------- failures


async def test_a_failed_write_fails_the_replay_and_leaves_nothing_behind(
    nc: NATS, store: EventStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _publish(nc, store)
    calls = count()

    def broken(w: Working, seq: int) -> list[tuple[str, list[object]]]:
        if next(calls) == 3:
            return [("INSERT INTO no_such_table VALUES (?)", [1])]
        return statements(w, seq)

    monkeypatch.setattr(fill_mod, "statements", broken)
    before = sys.getswitchinterval()
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(sqlite3.OperationalError, match="no_such_table"):
        await replay(nc, out / "read.db", batch_size=4)
    assert list(out.iterdir()) == []
    assert sys.getswitchinterval() == before
    assert gc.get_freeze_count() == 0


# ---------------------------------------------------------------- the pieces


def test_the_audit_row_is_built_in_the_events_tables_column_order() -> None:
    from projections.project import _AUDIT_COLUMNS

    assert EVENTS.names == _AUDIT_COLUMNS


@pytest.mark.parametrize("n", [0, 1, 2, 3, 255, 256, 257, 511, 513, 1000])
def test_rows_are_chunked_in_order_into_few_distinct_sizes(n: int) -> None:
    chunks = list(fill_mod._chunks(list(range(n))))
    assert [x for c in chunks for x in c] == list(range(n))
    assert all(len(c) in {256, 128, 64, 32, 16, 8, 4, 2, 1} for c in chunks)


def test_multi_row_statements_write_what_executemany_writes() -> None:
    """Every table: the multi-row upserts and deletes give the rows of apply_batch's
    executemany statements."""
    w = Working()
    tables = [t for t in TABLES if t.name != "checkpoint"]

    def row(table: str, i: int) -> dict[str, object]:
        return {c: i if c == "seq" else f"{table}-{c}-{i}" for c in BY_NAME[table].names}

    for table in tables:
        for i in range(300):
            w.put(table.name, row(table.name, i))
        for i in range(0, 300, 7):
            w.delete(table.name, BY_NAME[table.name].key(row(table.name, i)))
    w.audit += [tuple(row("events", i).values()) for i in range(300, 700)]

    def build(many: bool) -> list[tuple[object, ...]]:
        conn = sqlite3.connect(":memory:", isolation_level=None)
        for table in TABLES:
            conn.execute(table.ddl)
        conn.execute("INSERT INTO checkpoint (id, seq) VALUES (1, 0)")
        if many:
            from projections.batch import changed

            for table, deletes, upserts in changed(w):
                conn.executemany(table.delete, deletes)
                conn.executemany(table.upsert, upserts)
            conn.execute("UPDATE checkpoint SET seq = ? WHERE id = 1", (7,))
        else:
            fill_mod.write(statements(w, 7))(conn)
        return [r for t in TABLES for r in conn.execute(t.select_sorted)]

    assert build(many=False) == build(many=True)


def test_replay_runtime_restores_the_interval_and_the_collector() -> None:
    before = sys.getswitchinterval()
    with replay_runtime():
        assert sys.getswitchinterval() <= 0.0002
        assert gc.get_freeze_count() > 0
    assert sys.getswitchinterval() == before
    assert gc.get_freeze_count() == 0
