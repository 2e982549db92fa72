"""Schedules in real `runplane scheduler` processes, on the real clock (slow: it waits
for two minute boundaries, up to 2 minutes): two schedulers fire an every-minute schedule
once, one of them is killed -9, and the survivor handles the next minute, skipped because
the first run still waits for an executor (none runs here)."""

from __future__ import annotations

import signal
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from events import run as R
from events import schedule as sc
from infra.natsserver import EmbeddedNats
from services.app.commands import App
from services.processes.schedules import store
from services.processes.schedules.loop import run_id_for
from services.root.demo import make_demo_repo
from tests.helpers import eventually
from tests.procs import Proc
from tests.schedule_support import fires_of, runs_of

pytestmark = pytest.mark.slow


async def test_two_scheduler_processes_fire_once_and_a_survivor_carries_on(
    tmp_path: Path, nats_server: EmbeddedNats, app: App
) -> None:
    await app.create_org("acme", "alice")
    # a real repository: admission pins the run to its branch's head
    repo = make_demo_repo(tmp_path / "repo")
    await app.create_workspace("acme", "net", R.Workspace(repository=str(repo)), "alice")
    cmd = sc.SaveSchedule(
        actor="alice",
        schedule_id=app.ids(),
        org="acme",
        workspace="net",
        create=True,
        cron="* * * * *",
        run_type="plan",
    )
    state, _ = await store.command(app, "acme", "net", cmd)
    s = state.schedules[cmd.schedule_id]
    args = ["scheduler", "--nats-url", nats_server.url, "--data-dir"]
    scheds = [
        await Proc([*args, str(tmp_path / f"s{i}")], tmp_path / f"s{i}.log").start()
        for i in range(2)
    ]
    try:

        async def recorded(n: int) -> list[sc.ScheduleFired | sc.ScheduleSkipped]:
            got = await fires_of(app, s.id)
            return got if len(got) >= n else []

        (first,) = await eventually(lambda: recorded(1), timeout=90, what="the first fire")
        scheds[0].kill()  # -9: whatever it held is the survivor's now
        await scheds[0].stop(signal.SIGKILL)
        both = await eventually(lambda: recorded(2), timeout=90, what="the next minute")
    finally:
        for p in scheds:
            p.kill()
    assert isinstance(first, sc.ScheduleFired)
    assert first.fire_time == first.fire_time.replace(second=0, microsecond=0)
    assert first.fire_time <= datetime.now(UTC)
    second = both[1]
    assert isinstance(second, sc.ScheduleSkipped), second
    assert (second.reason, second.waiting_run) == (sc.WAITING, first.run_id)
    assert second.fire_time == first.fire_time + timedelta(minutes=1)
    assert list(await runs_of(app)) == [run_id_for(s.id, first.fire_time)]
    assert all("schedule_loop_started" in p.output() for p in scheds)
