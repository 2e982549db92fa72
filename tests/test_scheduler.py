"""Admission and dispatch with real JetStream: FIFO per workspace, one active run, no
double admission even with two schedulers racing."""

from __future__ import annotations

import asyncio
import json
import random
from contextlib import AsyncExitStack

import nats
import nats.errors
import pytest
from nats.aio.client import Client as NATS

from events import run as R
from events.errors import IllegalTransition
from infra import streams
from infra.eventstore import EventStore
from infra.ids import new_id
from infra.natsserver import EmbeddedNats
from services.app.commands import App
from services.processes.scheduler.scheduler import Scheduler
from tests import builders
from tests.bootstrap_support import Process, pinned_by
from tests.helpers import eventually
from tests.scheduler_support import FakeExecutor, check_history


async def test_runs_are_admitted_in_arrival_order_one_at_a_time_per_workspace(
    nats_server: EmbeddedNats, nc: NATS, app: App, store: EventStore, process: Process
) -> None:
    workspaces = [f"ws{i}" for i in range(5)]
    await builders.workspaces(app, *workspaces)
    async with AsyncExitStack() as stack:
        for _ in range(2):  # two schedulers, each with its own connection, as two processes
            conn = await nats_server.connect()
            stack.push_async_callback(conn.close)
            await stack.enter_async_context(Scheduler(conn, process(conn).app))
        fake = await stack.enter_async_context(FakeExecutor(nc, app))
        created = await asyncio.gather(
            *(app.create_run("acme", random.choice(workspaces), "plan", "alice") for _ in range(60))
        )
        ids = {r.state.run_id for r in created}

        async def all_done() -> bool:
            states = [
                (await app.load_run("acme", r.state.workspace, r.state.run_id)).state
                for r in created
            ]
            return all(s.status == R.Status.NO_CHANGES for s in states)

        await eventually(all_done, timeout=60, what="every run to finish")
    admitted = check_history(await store.read("rp.>"))
    assert sorted(r for runs in admitted.values() for r in runs) == sorted(ids)
    assert sorted(fake.claimed) == sorted(ids), "every run planned exactly once"


async def test_a_busy_workspace_does_not_block_another(nc: NATS, app: App) -> None:
    await builders.workspaces(app, "busy", "free")
    async with Scheduler(nc, app):
        first = await app.create_run("acme", "busy", "apply", "alice")
        second = await app.create_run("acme", "busy", "apply", "alice")
        other = await app.create_run("acme", "free", "apply", "alice")

        async def status(ws: str, run: str) -> str:
            return str((await app.load_run("acme", ws, run)).state.status)

        async def both_admitted() -> bool:
            return (
                await status("busy", first.state.run_id) == "queued"
                and await status("free", other.state.run_id) == "queued"
            )

        await eventually(both_admitted, what="both workspaces' first runs admitted")
        assert await status("busy", second.state.run_id) == "pending"


async def test_a_slow_admission_snapshot_holds_only_its_own_workspace(
    nc: NATS, store: EventStore, process: Process
) -> None:
    """The snapshot (`git ls-remote`) of one workspace hangs: its run is queued at once
    but waits, unclaimable and undispatched, for its snapshot; the scheduler keeps
    admitting and dispatching the other workspaces meanwhile, and dispatches the slow
    one, pinned, when its snapshot comes."""
    release = asyncio.Event()

    async def snapshot(run: R.RunState) -> R.Snapshot:
        if run.workspace == "slow":
            await release.wait()
        return R.Snapshot(commit="0" * 40)

    app = process(store=store, pinning=pinned_by(snapshot)).app  # the scheduler's
    await builders.workspaces(app, "slow", "fast")
    js = nc.jetstream()
    await streams.ensure_executor_consumer(js, "default")
    work = await js.pull_subscribe_bind(
        durable=streams.executor_consumer("default"), stream=streams.DISPATCH
    )
    dispatched: list[str] = []

    async def take() -> None:
        try:
            for m in await work.fetch(10, timeout=0.2):
                dispatched.append(json.loads(m.data)["run_id"])
                await m.ack()
        except (TimeoutError, nats.errors.TimeoutError):
            pass

    async with Scheduler(nc, app, batch=8):
        slow = await app.create_run("acme", "slow", "apply", "alice")
        fast = [await app.create_run("acme", "fast", "plan", "alice") for _ in range(3)]

        async def state(ws: str, run: str) -> R.RunState:
            return (await app.load_run("acme", ws, run)).state  # type: ignore[no-any-return]

        async def fast_dispatched(i: int) -> bool:
            await take()
            return fast[i].state.run_id in dispatched

        await eventually(lambda: fast_dispatched(0), timeout=10, what="the fast run dispatched")
        held = await state("slow", slow.state.run_id)
        assert (held.status, held.pinning, held.snapshot) == ("queued", True, None)
        claim = R.ClaimPhase(actor="x", phase="plan", lease_id="l", executor_id="x")
        with pytest.raises(IllegalTransition, match="snapshot"):
            await app.run_command("acme", "slow", slow.state.run_id, claim)
        # the fast workspace goes on: its first run ends, the next one is dispatched
        await app.run_command("acme", "fast", fast[0].state.run_id, R.CancelRun(actor="alice"))
        await eventually(lambda: fast_dispatched(1), timeout=10, what="the next fast run")
        assert slow.state.run_id not in dispatched
        release.set()

        async def slow_dispatched() -> bool:
            await take()
            return slow.state.run_id in dispatched

        await eventually(slow_dispatched, timeout=10, what="the slow run dispatched")
        pinned = await state("slow", slow.state.run_id)
        assert (pinned.pinning, pinned.commit) == (False, "0" * 40)


async def test_what_a_killed_scheduler_held_is_handled_by_another_within_seconds(
    nc: NATS, app: App
) -> None:
    """A scheduler that fetched the event log and died (kill -9: nothing acked) holds its
    messages only for the consumer's short ack wait, not half a minute."""
    await builders.workspaces(app, "net")
    js = nc.jetstream()
    await streams.ensure_scheduler_consumer(js)
    created = await app.create_run("acme", "net", "apply", "alice")
    dead = await js.pull_subscribe_bind(durable=streams.SCHEDULER_CONSUMER, stream=streams.EVENTS)
    held = await dead.fetch(100, timeout=2)
    assert held, "the dead scheduler took the backlog"
    await dead.unsubscribe()
    started = asyncio.get_running_loop().time()
    async with Scheduler(nc, app):

        async def admitted() -> bool:
            run = (await app.load_run("acme", "net", created.state.run_id)).state
            return run.status == R.Status.QUEUED

        await eventually(admitted, timeout=20, what="the run admitted by the live scheduler")
    assert asyncio.get_running_loop().time() - started < streams.SCHEDULER_ACK_WAIT + 5


async def test_a_run_awaiting_approval_holds_its_workspace_until_discarded(
    nc: NATS, app: App
) -> None:
    await builders.workspaces(app, "net")
    async with Scheduler(nc, app):
        first = await app.create_run("acme", "net", "apply", "alice")
        second = await app.create_run("acme", "net", "apply", "alice")
        r1 = first.state.run_id

        async def is_queued(run: str) -> bool:
            return (await app.load_run("acme", "net", run)).state.status == R.Status.QUEUED

        await eventually(lambda: is_queued(r1), what="first run admitted")
        lease = new_id()
        await app.run_command(
            "acme",
            "net",
            r1,
            R.ClaimPhase(actor="x", phase="plan", lease_id=lease, executor_id="x"),
        )
        await app.run_command(
            "acme",
            "net",
            r1,
            R.FinishPlan(
                actor="x",
                lease_id=lease,
                commit="c",
                has_changes=True,
                summary=R.PlanSummary(add=1),
            ),
        )
        await asyncio.sleep(0.3)  # give a wrong admission the chance to happen
        assert (await app.load_run("acme", "net", second.state.run_id)).state.status == "pending"
        await app.run_command("acme", "net", r1, R.DiscardRun(actor="bob"))
        await eventually(lambda: is_queued(second.state.run_id), what="second run admitted")


async def test_canceling_a_pending_run_removes_it_from_the_queue(nc: NATS, app: App) -> None:
    await builders.workspaces(app, "net")
    async with Scheduler(nc, app):
        runs = [await app.create_run("acme", "net", "apply", "alice") for _ in range(3)]
        r0, r1, r2 = (r.state.run_id for r in runs)

        async def status(run: str) -> str:
            return str((await app.load_run("acme", "net", run)).state.status)

        await eventually(lambda: _eq(status(r0), "queued"), what="first admitted")
        await app.run_command("acme", "net", r1, R.CancelRun(actor="alice"))
        await app.run_command("acme", "net", r0, R.CancelRun(actor="alice"))
        await eventually(lambda: _eq(status(r2), "queued"), what="third admitted after cancels")
        assert await status(r1) == "canceled"


async def _eq(value: object, expected: str) -> bool:
    return (await value) == expected  # type: ignore[misc]


async def test_dispatch_is_deduplicated_per_phase(nc: NATS, app: App) -> None:
    """Handling the same event twice publishes the phase to the work queue once."""
    await builders.workspaces(app, "net")
    async with Scheduler(nc, app) as sched:
        r = await app.create_run("acme", "net", "apply", "alice")
        run_id = r.state.run_id

        async def queued() -> bool:
            return (await app.load_run("acme", "net", run_id)).state.status == R.Status.QUEUED

        await eventually(queued, what="admitted")
        await sched._dispatch("acme", "net", run_id)  # a redelivered event, handled again
    info = await nc.jetstream().stream_info(streams.DISPATCH)
    assert info.state.messages == 1
