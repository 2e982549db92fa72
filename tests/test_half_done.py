"""A writer that dies between the appends of a step that spans two aggregates (create,
admission, release, pinning) leaves a state the scheduler finishes or heals: no run is
lost, stuck or admitted twice (services/commands.py, module docstring)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import nats.errors
import pytest
from nats.aio.client import Client as NATS

from events import run as R
from events import workspace as W
from events.codec import tag_of
from events.errors import IllegalTransition
from services.commands import App
from services.infra import streams
from services.infra.eventstore import Append, EventStore, StoreError
from services.scheduler import scheduler as sched
from services.scheduler.scheduler import Scheduler
from tests.helpers import eventually

ORG = "acme"


async def _setup(app: App, *workspaces: str) -> None:
    await app.create_org(ORG, "admin")
    for ws in workspaces:
        await app.create_workspace(ORG, ws, R.Workspace(repository="/nowhere"), "admin")


def _dies(app: App, name: str) -> None:
    """The app's writer dies just before this step (the step's append never happens)."""

    async def died(*args: Any, **kwargs: Any) -> Any:
        raise StoreError(f"{name}: the writer died")

    setattr(app, name, died)


async def _status(app: App, ws: str, run: str) -> str:
    return str((await app.load_run(ORG, ws, run)).state.status)


async def _ws(app: App, ws: str) -> W.WorkspaceState:
    return (await app.load_ws(ORG, ws)).state  # type: ignore[no-any-return]


async def _types(app: App, subject: str) -> list[str]:
    return [tag_of(e.event) for e in await app.store.read(subject)]


def _is(app: App, ws: str, run: str, status: str) -> Callable[[], Any]:
    async def probe() -> bool:
        return await _status(app, ws, run) == status

    return probe


@pytest.fixture(name="fast_grace")
def fast_grace_fixture(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sched, "ENQUEUE_GRACE", 0.2)


async def test_a_run_whose_creator_died_before_enqueueing_it_is_enqueued_by_the_scheduler(
    nc: NATS, fast_grace: None
) -> None:
    creator, scheduler_app = App(EventStore(nc)), App(EventStore(nc))
    await _setup(creator, "net")
    _dies(creator, "enqueue_run")
    created = await creator.create_run(ORG, "net", "apply", "alice")  # answered: it landed
    run_id = created.state.run_id
    assert (await _ws(creator, "net")).queue == ()
    async with Scheduler(nc, scheduler_app):
        await eventually(_is(creator, "net", run_id, "queued"), timeout=10, what="queued")
    assert await _types(creator, f"rp.ws.{ORG}.net") == [
        "ws.created",
        "ws.run_enqueued",
        "ws.run_admitted",
    ]
    assert (await _ws(creator, "net")).active == run_id


async def test_a_fresh_run_created_message_waits_for_its_creator_before_any_repair(
    nc: NATS, fast_grace: None
) -> None:
    """The creator enqueues right after `run.created`: the scheduler leaves that to it
    (no race, no second enqueue), and the run is admitted once."""
    app = App(EventStore(nc))
    await _setup(app, "net")
    async with Scheduler(nc, App(EventStore(nc))):
        runs = [(await app.create_run(ORG, "net", "plan", "alice")).state.run_id for _ in range(5)]
        await eventually(_is(app, "net", runs[0], "queued"), timeout=10, what="first queued")
        await app.run_command(ORG, "net", runs[0], R.CancelRun(actor="alice"))
        await eventually(_is(app, "net", runs[1], "queued"), timeout=10, what="second queued")
    ws_events = await _types(app, f"rp.ws.{ORG}.net")
    assert ws_events.count("ws.run_enqueued") == 5
    assert ws_events.count("ws.run_admitted") == 2


async def test_an_admission_whose_scheduler_died_before_run_queued_is_finished(
    nc: NATS, store: EventStore
) -> None:
    app = App(store)
    await _setup(app, "net")
    run_id = (await app.create_run(ORG, "net", "apply", "alice")).state.run_id
    w = await app.load_ws(ORG, "net")
    admitted = W.RunAdmitted(at=app.clock(), actor="scheduler", run_id=run_id)
    await store.append([Append(subject=w.subject, event=admitted, expected=w.seq)])
    assert await _status(app, "net", run_id) == "pending"  # and the workspace held
    async with Scheduler(nc, App(EventStore(nc))):
        await eventually(_is(app, "net", run_id, "queued"), timeout=10, what="queued")
    assert (await _types(app, f"rp.ws.{ORG}.net")).count("ws.run_admitted") == 1


async def test_a_run_that_ended_without_releasing_its_workspace_is_released_and_the_next_goes(
    nc: NATS, store: EventStore
) -> None:
    """The terminal event landed and its writer died before `ws.run_released`: the
    scheduler, seeing the terminal event, releases the workspace; the next run goes."""
    app = App(store)
    await _setup(app, "net")
    async with Scheduler(nc, App(EventStore(nc))):
        first = (await app.create_run(ORG, "net", "apply", "alice")).state.run_id
        await eventually(_is(app, "net", first, "queued"), timeout=10, what="first queued")
        dying = App(store)
        _dies(dying, "release")
        await dying.run_command(ORG, "net", first, R.CancelRun(actor="alice"))  # it landed

        async def released() -> bool:
            return (await _ws(app, "net")).active == ""

        await eventually(released, timeout=10, what="the workspace released")
        second = (await app.create_run(ORG, "net", "apply", "alice")).state.run_id
        await eventually(_is(app, "net", second, "queued"), timeout=10, what="next queued")
    events = [e.event for e in await store.read(f"rp.ws.{ORG}.net")]
    assert [(e.run_id, e.status) for e in events if isinstance(e, W.RunReleased)] == [
        (first, "canceled")
    ]


async def test_a_run_canceled_as_it_was_enqueued_is_dropped_from_the_head_of_the_queue(
    nc: NATS, store: EventStore
) -> None:
    """The cancel found nothing to release; the late enqueue put a canceled run at the
    head: admission releases it and admits the run behind it."""
    app = App(store)
    await _setup(app, "net")
    late = App(store)
    _dies(late, "enqueue_run")
    canceled = (await late.create_run(ORG, "net", "apply", "alice")).state.run_id
    await app.run_command(ORG, "net", canceled, R.CancelRun(actor="alice"))
    w = await app.load_ws(ORG, "net")
    enqueued = W.RunEnqueued(at=app.clock(), actor="alice", run_id=canceled)
    await store.append([Append(subject=w.subject, event=enqueued, expected=w.seq)])
    behind = (await app.create_run(ORG, "net", "apply", "alice")).state.run_id
    assert await app.admit_next(ORG, "net") == behind
    ws = await _ws(app, "net")
    assert (ws.active, ws.queue) == (behind, ())
    assert await _status(app, "net", canceled) == "canceled"


async def test_an_admitted_run_is_claimable_only_once_pinned_and_a_lost_pin_is_taken_again(
    nc: NATS, store: EventStore
) -> None:
    """Queued `pinning` (the admitting scheduler died before the snapshot): no executor
    may claim it; the next scheduler takes the snapshot, then dispatches."""
    taken: list[str] = []

    async def snapshot(run: R.RunState) -> R.Snapshot:
        taken.append(run.run_id)
        return R.Snapshot(commit="c" * 40)

    app = App(store, snapshot=snapshot)
    await _setup(app, "net")
    run_id = (await app.create_run(ORG, "net", "apply", "alice")).state.run_id
    assert await app.admit_next(ORG, "net") == run_id  # queued, pinning; no snapshot yet
    state = (await app.load_run(ORG, "net", run_id)).state
    assert (state.status, state.pinning, state.waiting_phase, taken) == ("queued", True, "", [])
    claim = R.ClaimPhase(actor="x", phase="plan", lease_id="l1", executor_id="x")
    with pytest.raises(IllegalTransition, match="snapshot"):
        await app.run_command(ORG, "net", run_id, claim)

    js = nc.jetstream()
    await streams.ensure_executor_consumer(js, "default")
    work = await js.pull_subscribe_bind(
        durable=streams.executor_consumer("default"), stream=streams.DISPATCH
    )
    async with Scheduler(nc, App(EventStore(nc), snapshot=snapshot)):
        dispatched: list[str] = []

        async def sent() -> bool:
            try:
                for m in await work.fetch(5, timeout=0.2):
                    dispatched.append(json.loads(m.data)["run_id"])
            except (TimeoutError, nats.errors.TimeoutError):
                pass
            return run_id in dispatched

        await eventually(sent, timeout=10, what="dispatched once pinned")
    state = (await app.load_run(ORG, "net", run_id)).state
    assert (state.pinning, state.commit, taken) == (False, "c" * 40, [run_id])
    assert (await _types(app, f"rp.run.{ORG}.net.{run_id}")).count("run.pinned") == 1
    await app.run_command(ORG, "net", run_id, claim)  # now it may be claimed
