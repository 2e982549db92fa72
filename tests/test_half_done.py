"""A writer that dies between the appends of a step that spans two aggregates (create,
admission, release, pinning) leaves a state the scheduler finishes or heals: no run is
lost, stuck or admitted twice (services/app/commands.py, module docstring)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import nats.errors
import pytest
from nats.aio.client import Client as NATS

from events import run as R
from events import workspace as W
from events.codec import tag_of
from events.errors import IllegalTransition, SnapshotFailed
from events.templates import SaveTemplate, TemplateStep
from infra import streams
from infra.eventstore import Append, EventStore, StoreError
from services.app.commands import App
from services.processes.scheduler import scheduler as sched
from tests.bootstrap_support import Process, pinned_by
from tests.builders import workspaces
from tests.helpers import eventually

ORG = "acme"


def _dies(app: App, name: str, error: Exception | None = None) -> None:
    """The app's writer dies just before this step (the step's append never happens)."""

    async def died(*args: Any, **kwargs: Any) -> Any:
        raise error or StoreError(f"{name}: the writer died")

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


async def _scheduler_idle(nc: NATS) -> bool:
    """The scheduler has handled every event so far (so what follows is news to it)."""
    info = await nc.jetstream().consumer_info(streams.EVENTS, streams.SCHEDULER_CONSUMER)
    return info.num_pending == 0 and info.num_ack_pending == 0


@pytest.fixture(name="fast_grace")
def fast_grace_fixture(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sched, "ENQUEUE_GRACE", 0.2)


async def test_a_run_whose_creator_died_before_enqueueing_it_is_enqueued_by_the_scheduler(
    process: Process, fast_grace: None
) -> None:
    creator, scheduler = process().app, process()
    await workspaces(creator, "net")
    _dies(creator, "enqueue_run", nats.errors.NoRespondersError())  # not a StoreError
    created = await creator.create_run(ORG, "net", "apply", "alice")  # answered: it landed
    run_id = created.state.run_id
    assert (await _ws(creator, "net")).queue == ()
    async with scheduler.scheduler():
        await eventually(_is(creator, "net", run_id, "queued"), timeout=10, what="queued")
    assert await _types(creator, f"rp.ws.{ORG}.net") == [
        "ws.created",
        "ws.run_enqueued",
        "ws.run_admitted",
    ]
    assert (await _ws(creator, "net")).active == run_id


async def test_the_scheduler_leaves_a_fresh_run_to_its_creator_for_the_grace_period(
    process: Process, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its creator enqueues a run right after `run.created`: the scheduler, seeing a fresh
    `run.created` of a run on no queue, waits ENQUEUE_GRACE before it enqueues the run
    itself (no race with the creator), then does."""
    monkeypatch.setattr(sched, "ENQUEUE_GRACE", 2.0)
    creator = process().app
    await workspaces(creator, "net")
    _dies(creator, "enqueue_run")
    async with process().scheduler():
        run_id = (await creator.create_run(ORG, "net", "apply", "alice")).state.run_id
        await asyncio.sleep(0.8)  # the scheduler has seen run.created by now
        assert (await _ws(creator, "net")).queue == ()
        assert await _status(creator, "net", run_id) == "pending"
        await eventually(_is(creator, "net", run_id, "queued"), timeout=10, what="queued")
    assert (await _types(creator, f"rp.ws.{ORG}.net")).count("ws.run_enqueued") == 1


async def test_an_admission_whose_scheduler_died_before_run_queued_is_finished(
    app: App, store: EventStore, process: Process
) -> None:
    await workspaces(app, "net")
    run_id = (await app.create_run(ORG, "net", "apply", "alice")).state.run_id
    w = await app.load_ws(ORG, "net")
    admitted = W.RunAdmitted(at=app.clock(), actor="scheduler", run_id=run_id)
    await store.append([Append(subject=w.subject, event=admitted, expected=w.seq)])
    assert await _status(app, "net", run_id) == "pending"  # and the workspace held
    async with process().scheduler():
        await eventually(_is(app, "net", run_id, "queued"), timeout=10, what="queued")
    assert (await _types(app, f"rp.ws.{ORG}.net")).count("ws.run_admitted") == 1


async def test_a_run_that_ended_without_releasing_its_workspace_is_released_and_the_next_goes(
    app: App, store: EventStore, process: Process
) -> None:
    """The terminal event landed and its writer died before `ws.run_released`: the
    scheduler, seeing the terminal event, releases the workspace; the next run goes."""
    await workspaces(app, "net")
    async with process().scheduler():
        first = (await app.create_run(ORG, "net", "apply", "alice")).state.run_id
        await eventually(_is(app, "net", first, "queued"), timeout=10, what="first queued")
        dying = process(store=store).app
        _dies(dying, "release", nats.errors.TimeoutError())  # not a StoreError
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
    app: App, store: EventStore, process: Process
) -> None:
    """The cancel found nothing to release; the late enqueue put a canceled run at the
    head: admission releases it and admits the run behind it."""
    await workspaces(app, "net")
    late = process(store=store).app
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
    nc: NATS, store: EventStore, process: Process
) -> None:
    """Queued `pinning` (the admitting scheduler died before the snapshot): no executor
    may claim it; the next scheduler takes the snapshot, then dispatches."""
    taken: list[str] = []

    async def snapshot(run: R.RunState) -> R.Snapshot:
        taken.append(run.run_id)
        return R.Snapshot(commit="c" * 40)

    app = process(store=store, pinning=pinned_by(snapshot)).app
    await workspaces(app, "net")
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
    async with process(pinning=pinned_by(snapshot)).scheduler():
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


async def test_a_run_ended_by_its_approval_is_released_even_if_its_approver_died(
    nc: NATS, app: App, store: EventStore, process: Process
) -> None:
    """A template whose last step is the approval: `run.approved` ends the run, and the
    scheduler releases the workspace when its approver's App died before the release."""
    await workspaces(app, "net")
    steps = [TemplateStep(number=10, kind="plan"), TemplateStep(number=20, kind="approval")]
    await app.org_command(ORG, SaveTemplate(actor="admin", name="review", steps=steps))
    await app.set_workspace_settings(ORG, "net", {"require_approval": True}, "admin")
    async with process().scheduler():
        created = await app.create_run(ORG, "net", "apply", "alice", template="review")
        run_id = created.state.run_id
        await eventually(_is(app, "net", run_id, "queued"), timeout=10, what="queued")
        lease = "l1"
        claim = R.ClaimPhase(actor="ex", phase="plan", lease_id=lease, executor_id="ex")
        await app.run_command(ORG, "net", run_id, claim)
        plan = R.FinishPlan(
            actor="ex",
            lease_id=lease,
            commit="c",
            has_changes=True,
            summary=R.PlanSummary(add=1),
            require_approval=True,
        )
        await app.run_command(ORG, "net", run_id, plan)
        assert await _status(app, "net", run_id) == "awaiting_approval"
        await eventually(lambda: _scheduler_idle(nc), timeout=10, what="the scheduler idle")
        approver = process(store=store).app
        _dies(approver, "release")
        ended = await approver.run_command(ORG, "net", run_id, R.ApproveRun(actor="bob"))
        assert ended.state.terminal

        async def released() -> bool:
            return (await _ws(app, "net")).active == ""

        await eventually(released, timeout=10, what="the workspace released")


async def test_a_snapshot_that_fails_late_does_not_fail_a_run_another_scheduler_pinned(
    store: EventStore, process: Process
) -> None:
    """Two schedulers took the same `run.queued`: one pinned the run; the other's snapshot
    then failed. The run stays pinned and queued, not failed `checkout_failed`."""

    async def good(run: R.RunState) -> R.Snapshot:
        return R.Snapshot(commit="c" * 40)

    async def gone(run: R.RunState) -> R.Snapshot:
        raise SnapshotFailed("git ls-remote: the repository is gone")

    fast = process(store=store, pinning=pinned_by(good)).app
    slow = process(store=store, pinning=pinned_by(gone)).app
    await workspaces(fast, "net")
    run_id = (await fast.create_run(ORG, "net", "apply", "alice")).state.run_id
    assert await fast.admit_next(ORG, "net") == run_id
    seen_by_slow = await slow.load_run(ORG, "net", run_id)  # pinning, as it read it
    assert await fast.pin_run(ORG, "net", run_id)
    assert await slow.pin_run(ORG, "net", run_id, loaded=seen_by_slow) is False
    state = (await fast.load_run(ORG, "net", run_id)).state
    assert (state.status, state.pinning, state.commit) == ("queued", False, "c" * 40)
