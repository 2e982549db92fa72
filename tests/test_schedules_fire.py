"""The schedule loop (services/processes/schedules/loop.py) on a real nats-server, over a simulated
clock (each `tick(now)` is given its time: nothing sleeps): two replicas racing fire each
time exactly once; a fire while a run of the schedule waits is skipped and recorded, one
while another run holds the workspace is queued; missed fires are one fire or one skip;
a scheduler killed between making the run and recording it makes no second run; a
stale index never fires a deleted, disabled or changed schedule."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from events import run as R
from events import schedule as sc
from events.run_events import Status
from events.templates import DeleteTemplate, SaveTemplate, TemplateStep
from infra.eventstore import Append, EventStore
from infra.natsserver import EmbeddedNats
from services.app.commands import App
from services.app.execute import Result
from services.processes.schedules import store
from services.processes.schedules.loop import ScheduleLoop, run_id_for
from tests.helpers import eventually
from tests.schedule_support import T0, Clock, cancel, fires_of, make_schedule, minute_at, runs_of


class CountingApp(App):
    """An App that counts its creates and those that found the run already there."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.creates = 0
        self.existed = 0

    async def create_run(self, *a: Any, **kw: Any) -> Result:
        self.creates += 1
        r = await super().create_run(*a, **kw)
        self.existed += r.existed
        return r


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def replicas(
    nats_server: EmbeddedNats, nc: NATS, clock: Clock
) -> AsyncIterator[list[CountingApp]]:
    """Two scheduler replicas' command sides, each on a connection of its own."""
    conns = [await nats_server.connect() for _ in range(2)]
    yield [CountingApp(EventStore(c), clock=clock) for c in conns]
    for c in conns:
        await c.close()


@pytest.fixture
async def ws(app: App) -> str:
    await app.create_org("acme", "alice")
    await app.create_workspace("acme", "net", R.Workspace(repository="/nowhere"), "alice")
    return "net"


async def test_two_schedulers_racing_over_30_minutes_fire_each_minute_exactly_once(
    app: App, ws: str, clock: Clock, replicas: list[CountingApp]
) -> None:
    s = await make_schedule(app, clock)
    a, b = (ScheduleLoop(r, clock=clock) for r in replicas)
    for m in range(1, 31):
        clock.now = minute_at(m) + timedelta(seconds=1)
        # both at once, then b again a little later (a replica whose tick comes late)
        await asyncio.gather(a.tick(clock.now), b.tick(clock.now))
        await b.tick(clock.now + timedelta(seconds=3))
        await cancel(app, run_id_for(s.id, minute_at(m)))  # so the next one does not wait
    fires = await fires_of(app, s.id)
    assert [type(f) for f in fires] == [sc.ScheduleFired] * 30
    assert [f.fire_time for f in fires] == [minute_at(m) for m in range(1, 31)]
    runs = await runs_of(app)
    assert sorted(runs) == sorted(run_id_for(s.id, minute_at(m)) for m in range(1, 31))
    for f in fires:
        assert isinstance(f, sc.ScheduleFired)
        cause = runs[f.run_id].cause
        assert cause is not None and (cause.kind, cause.schedule) == ("schedule", s.id)
        assert cause.fire_time == f.fire_time
    creates = sum(r.creates for r in replicas)
    existed = sum(r.existed for r in replicas)
    assert creates - existed == 30  # every second creation found the first's run
    assert existed > 0, "the replicas never raced: the test proves nothing"


async def test_a_fire_while_the_schedules_run_waits_is_skipped_and_recorded(
    app: App, ws: str, clock: Clock
) -> None:
    s = await make_schedule(app, clock)
    loop = ScheduleLoop(app, clock=clock)
    first = run_id_for(s.id, minute_at(1))
    (fired,) = await loop.tick(minute_at(1) + timedelta(seconds=2))
    assert isinstance(fired, sc.ScheduleFired) and fired.run_id == first
    (skipped,) = await loop.tick(minute_at(2) + timedelta(seconds=2))
    assert isinstance(skipped, sc.ScheduleSkipped)
    assert (skipped.reason, skipped.waiting_run, skipped.fire_time) == (
        sc.WAITING,
        first,
        minute_at(2),
    )
    assert len(await runs_of(app)) == 1
    await cancel(app, first)
    (again,) = await loop.tick(minute_at(3) + timedelta(seconds=2))
    assert isinstance(again, sc.ScheduleFired) and again.run_id == run_id_for(s.id, minute_at(3))


async def test_a_fire_while_another_run_holds_the_workspace_is_queued_behind_it(
    app: App, ws: str, clock: Clock
) -> None:
    await make_schedule(app, clock, run_type="apply")
    manual = (await app.create_run("acme", "net", "apply", "alice")).state.run_id
    assert await app.admit_next("acme", "net") == manual  # it holds the workspace
    (fired,) = await ScheduleLoop(app, clock=clock).tick(minute_at(1) + timedelta(seconds=1))
    assert isinstance(fired, sc.ScheduleFired)
    w = (await app.load_ws("acme", "net")).state
    assert (w.active, w.queue) == (manual, (fired.run_id,))
    assert (await runs_of(app))[fired.run_id].status == Status.PENDING


def _hour(h: int) -> datetime:
    return T0.replace(second=0) + timedelta(hours=h)


@pytest.mark.parametrize("missed", ["run_once", "skip"])
async def test_fires_missed_while_no_scheduler_ran_are_one_fire_or_one_skip_never_a_burst(
    app: App, ws: str, clock: Clock, missed: str
) -> None:
    """Hourly; down from 01:00 to 05:20: 02:00 to 05:00 were missed, 05:00 itself 20
    minutes late. `run_once`: 05:00 fires once, standing for the 3 before; `skip`: it is
    recorded skipped, no run. Either way 06:00 then fires on time."""
    s = await make_schedule(app, clock, cron="0 * * * *", missed=missed)
    before = ScheduleLoop(app, clock=clock)
    await before.tick(_hour(1) + timedelta(seconds=1))
    await cancel(app, run_id_for(s.id, _hour(1)))
    after = ScheduleLoop(app, clock=clock)  # a fresh scheduler starts
    clock.now = _hour(5) + timedelta(minutes=20)
    (handled,) = await after.tick(clock.now)
    assert handled.fire_time == _hour(5) and handled.missed == 3
    assert await after.tick(clock.now + timedelta(seconds=30)) == []  # and nothing more
    runs = await runs_of(app)
    if missed == "run_once":
        assert isinstance(handled, sc.ScheduleFired)
        assert sorted(runs) == sorted([run_id_for(s.id, _hour(1)), handled.run_id])
        await cancel(app, handled.run_id)
    else:
        assert isinstance(handled, sc.ScheduleSkipped) and handled.reason == sc.MISSED_SKIPPED
        assert list(runs) == [run_id_for(s.id, _hour(1))]
    (next_one,) = await after.tick(_hour(6) + timedelta(seconds=1))
    assert isinstance(next_one, sc.ScheduleFired) and next_one.missed == 0


async def test_a_restart_just_after_a_fire_time_fires_it_on_time_the_missed_counted(
    app: App, ws: str, clock: Clock
) -> None:
    """Every minute, down from 00:01 to 00:20:05: 00:20 is on time and fires (whatever
    `missed` says), standing for the 18 missed; one run, not 19."""
    s = await make_schedule(app, clock, missed="skip")
    await ScheduleLoop(app, clock=clock).tick(minute_at(1) + timedelta(seconds=1))
    await cancel(app, run_id_for(s.id, minute_at(1)))
    (fired,) = await ScheduleLoop(app, clock=clock).tick(minute_at(20) + timedelta(seconds=5))
    assert isinstance(fired, sc.ScheduleFired)
    assert (fired.fire_time, fired.missed) == (minute_at(20), 18)
    assert len(await runs_of(app)) == 2


class Killed(Exception):
    """The scheduler process died here."""


async def test_a_scheduler_killed_after_making_the_run_makes_no_second_run_on_restart(
    app: App, ws: str, clock: Clock, replicas: list[CountingApp], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed between create_run and the fire's record, even with the schedule's previous
    run still waiting: the restarted scheduler finds the run by its derived id and
    records it (a skip for `waiting` would have lost the fire's record of it)."""
    s = await make_schedule(app, clock)
    await ScheduleLoop(app, clock=clock).tick(minute_at(1) + timedelta(seconds=1))  # waits on
    real_record = store.record

    async def killed(*a: Any, **kw: Any) -> int:
        raise Killed

    monkeypatch.setattr(store, "record", killed)
    dying = ScheduleLoop(replicas[0], clock=clock)
    await cancel(app, run_id_for(s.id, minute_at(1)))
    assert await dying.tick(minute_at(2) + timedelta(seconds=1)) == []  # died after the create
    assert replicas[0].creates == 1 and replicas[0].existed == 0
    second = run_id_for(s.id, minute_at(2))
    assert second in await runs_of(app)
    monkeypatch.setattr(store, "record", real_record)
    restarted = ScheduleLoop(replicas[1], clock=clock)
    (fired,) = await restarted.tick(minute_at(2) + timedelta(seconds=20))
    assert isinstance(fired, sc.ScheduleFired) and fired.run_id == second
    assert replicas[1].existed == 1  # found, not made
    assert len(await runs_of(app)) == 2
    assert [f.fire_time for f in await fires_of(app, s.id)] == [minute_at(1), minute_at(2)]


@pytest.mark.parametrize("change", ["deleted", "disabled", "cron"])
async def test_a_stale_index_never_fires_a_deleted_disabled_or_changed_schedule(
    app: App, ws: str, clock: Clock, replicas: list[CountingApp], change: str
) -> None:
    """The loop's index (a read any replica, maybe one behind, answered) still says
    every minute; the schedule as the stream's leader has it decides."""
    s = await make_schedule(app, clock)
    lagging = ScheduleLoop(replicas[0], clock=clock)
    await lagging.refresh()
    lagging.refresh = _no_refresh  # type: ignore[method-assign]  # a follower that stays behind
    clock.now = T0 + timedelta(seconds=10)
    cmd: sc.SaveSchedule | sc.DeleteSchedule
    if change == "deleted":
        cmd = sc.DeleteSchedule(actor="alice", schedule_id=s.id)
    elif change == "disabled":
        cmd = sc.SaveSchedule(
            actor="alice", schedule_id=s.id, org="acme", workspace="net", enabled=False
        )
    else:
        cmd = sc.SaveSchedule(
            actor="alice", schedule_id=s.id, org="acme", workspace="net", cron="0 12 * * *"
        )
    app.clock = clock
    await store.command(app, "acme", "net", cmd)
    assert (await lagging.tick(minute_at(1) + timedelta(seconds=1))) == []
    assert await runs_of(app) == {} and await fires_of(app, s.id) == []


async def _no_refresh() -> None:
    return None


async def test_a_schedule_of_a_workspace_that_refuses_the_run_records_the_refusal(
    app: App, ws: str, clock: Clock
) -> None:
    """A template removed after the schedule was saved: the fire is recorded as refused
    (once), not retried every tick."""
    steps = [TemplateStep(number=100, kind="plan")]
    await app.org_command("acme", SaveTemplate(actor="a", name="mine", steps=steps))
    await make_schedule(app, clock, template="mine")
    await app.org_command("acme", DeleteTemplate(actor="a", name="mine"))
    loop = ScheduleLoop(app, clock=clock)
    (refused,) = await loop.tick(minute_at(1) + timedelta(seconds=1))
    assert isinstance(refused, sc.ScheduleSkipped) and refused.reason == sc.REFUSED
    assert "mine" in refused.detail
    assert await loop.tick(minute_at(1) + timedelta(seconds=20)) == []
    assert await runs_of(app) == {}


async def test_a_definition_naming_another_organization_never_fires_there(
    app: App, ws: str, clock: Clock
) -> None:
    """Attack: a schedule event on acme's subject that names beta's workspace (no API
    writes one; a forged or buggy writer might) makes no run in beta, nor in acme."""
    await app.create_org("beta", "bob")
    await app.create_workspace("beta", "db", R.Workspace(repository="/nowhere"), "bob")
    forged = sc.Schedule(
        id="forged",
        org="beta",
        workspace="db",
        cron="* * * * *",
        run_type="destroy",
        since=T0,
        created_at=T0,
        created_by="mallory",
        updated_at=T0,
    )
    event = sc.ScheduleSaved(at=T0, actor="mallory", schedule=forged)
    append = Append(
        subject=sc.schedules_subject("acme", "net"), event=event, expected=0, msg_id="x"
    )
    await app.store.append([append])
    loop = ScheduleLoop(app, clock=clock)
    assert await loop.tick(minute_at(1) + timedelta(seconds=1)) == []
    assert await app.store.read("rp.run.beta.db.*") == [] and await runs_of(app) == {}
    assert await loop.fire(("acme", "net", "forged"), minute_at(2)) is None  # asked directly
    assert await app.store.read("rp.run.beta.db.*") == []


async def test_the_running_loop_sees_a_new_schedule_and_fires_it_when_its_clock_says(
    app: App, ws: str, clock: Clock
) -> None:
    """The loop as the scheduler process runs it (its own task, pausing `interval`),
    its clock simulated: a schedule made after it started fires once the clock passes
    its time, and not before."""
    async with ScheduleLoop(app, clock=clock, interval=0.02) as running:
        s = await make_schedule(app, clock, cron="*/10 * * * *")

        async def seen() -> bool:
            return any(k[2] == s.id for k in running.schedules)

        await eventually(seen, timeout=10, what="the schedule in the loop's index")
        clock.now = minute_at(9) + timedelta(seconds=59)
        ticked = running.ticks

        async def two_more() -> bool:
            return running.ticks >= ticked + 2

        await eventually(two_more, timeout=10, what="two ticks at 00:09:59")
        assert await fires_of(app, s.id) == []
        clock.now = minute_at(10) + timedelta(seconds=1)

        async def fired() -> list[Any]:
            return await fires_of(app, s.id)

        (f,) = await eventually(fired, timeout=10, what="the fire at 00:10")
    assert isinstance(f, sc.ScheduleFired) and f.fire_time == minute_at(10)
    assert f.run_id in await runs_of(app)
