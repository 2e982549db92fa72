"""Nothing waits unseen: a phase whose work-queue message is gone is dispatched again.

Every dispatched phase has a `dispatched` marker on the board, with a dispatch timeout or
without (the default, 0: wait for ever). The reaper checks it every `redispatch_after`
seconds: a message still in the pool's queue is left alone (no pile-up), a missing one is
published again with the same `Nats-Msg-Id`, and a second message of a claimed phase is
refused by the claim's fencing. Real nats-server, real Terraform, a real executor.

The tests shorten RP_DISPATCH's duplicate window (120 s) to 1 s: a redispatch inside the
window is dropped by the server as a duplicate and goes at the next check after it.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from events import run as R
from infra import streams
from infra.heartbeats import DEADLINE, Beat, Board, subject
from services.app.commands import App
from services.processes.scheduler import watch
from services.processes.scheduler.reaper import Verdict, judge, queued
from tests.bootstrap_support import System
from tests.builders import api_workspace, queued_run
from tests.core_support import HISTORIES
from tests.executor_support import MAIN_TF
from tests.helpers import eventually
from tests.plane_support import Plane, commit, plane_fixture  # noqa: F401  # the fixtures
from tests.reaper_support import claim, entry, reaches
from tests.reaper_support import state as rstate
from tests.reaper_support import workspace as rworkspace


async def short_duplicate_window(nc: NATS, seconds: float = 1.0) -> None:
    api = f"$JS.API.STREAM.INFO.{streams.DISPATCH}"
    config = json.loads((await nc.request(api, b"", timeout=5)).data)["config"]
    config["duplicate_window"] = int(seconds * 1e9)
    update = f"$JS.API.STREAM.UPDATE.{streams.DISPATCH}"
    answer = json.loads((await nc.request(update, json.dumps(config).encode(), timeout=5)).data)
    assert "error" not in answer, answer


async def dispatch_state(nc: NATS) -> tuple[int, int]:
    """(messages in RP_DISPATCH now, messages ever published to it)."""
    info = await nc.jetstream().stream_info(streams.DISPATCH)
    return info.state.messages, info.state.last_seq


async def workspace(plane: Plane, repo: Path) -> None:
    commit(repo, {"main.tf": MAIN_TF})
    await api_workspace(plane.http, repo)


async def marker(nc: NATS, run_id: str) -> Beat:
    beat = await Board(nc).last(run_id, "plan", leader=True)
    assert beat is not None and not beat.lease_id, beat
    return beat


async def claims(plane: Plane, run_id: str) -> list[R.PhaseStarted]:
    return [e for e in await plane.events("net", run_id) if isinstance(e, R.PhaseStarted)]


@pytest.mark.terraform
async def test_a_lost_dispatch_is_dispatched_again_and_the_run_finishes(
    plane: Plane, repo: Path
) -> None:
    """A consumer takes the plan's message and acks it without claiming (the message is
    gone, the run `queued`, default settings): the reaper dispatches it again, an executor
    runs it once. A later third message of the claimed phase is dropped by the executor."""
    nc = plane.nc
    await short_duplicate_window(nc)
    await workspace(plane, repo)
    run_id = await plane.start("net", "plan")

    async def dispatched() -> bool:
        return (await dispatch_state(nc))[0] == 1

    await eventually(dispatched, what="the plan dispatched")
    js = nc.jetstream()
    await streams.ensure_executor_consumer(js, "default")
    rogue = await js.pull_subscribe_bind(
        durable=streams.executor_consumer("default"), stream=streams.DISPATCH
    )
    [taken] = await rogue.fetch(1, timeout=5)
    assert json.loads(taken.data)["run_id"] == run_id
    await taken.ack_sync()
    await rogue.unsubscribe()
    assert await dispatch_state(nc) == (0, 1)
    first = await marker(nc, run_id)
    assert (first.body.kind, first.body.timeout, first.body.pool) == ("dispatched", 0, "default")

    await plane.stack.enter_async_context(plane.system.reaper(interval=0.1, redispatch_after=1))
    await plane.executor("e1")
    run = await plane.reaches("net", run_id, "planned")
    assert run.plan_summary is not None and run.plan_summary.add == 1
    assert len(await claims(plane, run_id)) == 1
    assert (await dispatch_state(nc))[1] == 2, "dispatched exactly once more"

    # After the duplicate window a message of the finished phase is new to the server:
    # the executor takes it, the claim is refused, nothing runs and nothing changes.
    # (each try inside the window is dropped by the server: nothing is published twice)
    await eventually(lambda: watch.dispatch(nc, run, "plan", "default"), what="the window past")

    async def consumed() -> bool:
        return (await dispatch_state(nc)) == (0, 3)

    await eventually(consumed, what="the third message taken and dropped")
    after = await plane.run("net", run_id)
    assert (after.status, after.version) == (R.Status.PLANNED, run.version)
    assert len(await claims(plane, run_id)) == 1


@pytest.mark.terraform
async def test_a_run_waiting_for_a_pool_without_executors_stays_queued_and_watched(
    plane: Plane, repo: Path
) -> None:
    """Default settings (no dispatch timeout) and no executor: the run stays `queued` and
    never fails; its one message stays in the queue (the reaper's checks publish nothing
    more, though the duplicate window is long past); its GET shows no owner and a live
    `dispatch_check` deadline that moves on with each check."""
    nc = plane.nc
    await short_duplicate_window(nc)
    await workspace(plane, repo)
    run_id = await plane.start("net")
    await plane.stack.enter_async_context(plane.system.reaper(interval=0.1, redispatch_after=1))
    seen: list[Beat] = [await eventually(lambda: marker(nc, run_id), what="the marker")]

    async def checked_again() -> bool:
        now = await marker(nc, run_id)
        if now.seq != seen[-1].seq:
            seen.append(now)
        return len(seen) >= 4

    await eventually(checked_again, timeout=30, what="three rechecks by the reaper")
    assert await dispatch_state(nc) == (1, 1)
    assert await queued(nc, "default") == {watch.dispatch_id(run_id, "plan")}
    last = seen[-1]
    assert last.body.dispatched_at == seen[0].time, "the first dispatch's time is kept"
    assert (last.body.timeout, last.body.recheck) == (0, 1)

    shown = (await plane.http.get(f"/api/v1/orgs/acme/runs/{run_id}")).body
    assert shown["status"] == "queued"
    assert shown["owner"] is None
    assert shown["deadline"]["kind"] == "dispatch_check"
    at = datetime.fromisoformat(shown["deadline"]["at"].replace("Z", "+00:00"))
    assert at > seen[0].time
    assert (await plane.run("net", run_id)).status == R.Status.QUEUED
    assert not [e for e in await plane.events("net", run_id) if isinstance(e, R.RunFailed)]


async def test_a_claim_whose_marker_stayed_is_adopted_not_dispatched_again(
    nc: NATS, app: App, system: System
) -> None:
    """The phase was claimed but nobody beat for it (the marker still says `dispatched`,
    no dispatch timeout, its message gone): the check sees the run planning and beats for
    the lease instead of dispatching; the silent lease then fails the run as any other."""
    await rworkspace(app, "net", heartbeat=2)
    run_id = await queued_run(app, "net")
    await watch.mark_dispatched(nc, await rstate(app, "net", run_id), "plan", "default")
    lease = await claim(app, "net", run_id)
    async with system.reaper(interval=0.1, redispatch_after=1):

        async def adopted() -> Beat:
            beat = await Board(nc).last(run_id, "plan", leader=True)
            assert beat is not None and beat.lease_id == lease, beat
            return beat

        beat = await eventually(adopted, timeout=15, what="the reaper to beat for the lease")
        assert beat.body.kind == "claimed"
        failed = await reaches(app, "net", run_id, "failed")
    assert "sent no heartbeat" in failed.error_message
    assert await dispatch_state(nc) == (0, 0), "never dispatched"


async def test_a_queued_run_with_nothing_on_the_board_is_found_and_dispatched(
    nc: NATS, app: App, system: System
) -> None:
    """Whatever the gap: the phase's message and its marker are both gone (as if the
    scheduler had never dispatched it). The run's deadline marker, kept for every open
    run even without limits, shows the reaper an open run: it marks and dispatches."""
    await short_duplicate_window(nc)
    await rworkspace(app, "net")
    async with system.scheduler():
        run_id = await queued_run_via_scheduler(app)
        await eventually(lambda: _dispatched(nc), what="the plan dispatched")

        async def deadline_marker() -> Any:  # written after the dispatch, by the same reaction
            return await Board(nc).last(run_id, DEADLINE, leader=True)

        deadline = await eventually(deadline_marker, what="the deadline marker")
        assert deadline.body.run_deadline is None, "no limit set"
        assert deadline.body.pool == "default"
    await take_the_message(nc)
    await Board(nc).purge(subject(run_id, "plan"))
    assert await Board(nc).last(run_id, "plan", leader=True) is None
    async with system.reaper(interval=0.1, redispatch_after=1):

        async def dispatched_again() -> bool:
            return await dispatch_state(nc) == (1, 2)

        await eventually(dispatched_again, timeout=15, what="the unseen phase dispatched")
        assert await queued(nc, "default") == {watch.dispatch_id(run_id, "plan")}
        marked = await Board(nc).last(run_id, "plan", leader=True)
        assert marked is not None and marked.body.kind == "dispatched"
    assert (await rstate(app, "net", run_id)).status == R.Status.QUEUED


async def queued_run_via_scheduler(app: App) -> str:
    run_id = str((await app.create_run("acme", "net", "apply", "alice")).state.run_id)
    await reaches(app, "net", run_id, "queued")
    return run_id


async def _dispatched(nc: NATS) -> bool:
    return await dispatch_state(nc) == (1, 1)


async def take_the_message(nc: NATS) -> None:
    """A consumer that takes the pool's message and acks it without claiming."""
    js = nc.jetstream()
    await streams.ensure_executor_consumer(js, "default")
    rogue = await js.pull_subscribe_bind(
        durable=streams.executor_consumer("default"), stream=streams.DISPATCH
    )
    [taken] = await rogue.fetch(1, timeout=5)
    await taken.ack_sync()
    await rogue.unsubscribe()


@pytest.mark.parametrize(
    ("status", "verdict"),
    [
        (R.Status.QUEUED, Verdict.REDISPATCH),  # still waiting: dispatched again if lost
        (R.Status.PLANNING, Verdict.ADOPT),  # claimed, nobody beat: beat for the lease
        (R.Status.AWAITING_APPROVAL, Verdict.PURGE),  # moved on
        (R.Status.FAILED, Verdict.PURGE),
    ],
)
def test_a_marker_due_for_its_recheck_is_judged_without_failing_anything(
    status: R.Status, verdict: Verdict
) -> None:
    marker = entry("plan", "")
    assert judge(marker, R.fold(HISTORIES[status]), timed_out=False) == verdict
    if verdict == Verdict.REDISPATCH:
        assert judge(marker, R.fold(HISTORIES[status])) == Verdict.FAIL_UNCLAIMED
