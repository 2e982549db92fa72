"""Shared by the schedule tests (tests/test_schedules_*.py): a simulated clock, and
schedules, their fire records and the runs they made, read straight from the stream."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from events import run as R
from events import schedule as sc
from services.app.commands import App
from services.processes.schedules import store

T0 = datetime(2026, 3, 1, 0, 0, 30, tzinfo=UTC)  # the schedules are made at 00:00:30
MINUTE = timedelta(minutes=1)


class Clock:
    """The simulated time every App and loop of a test reads."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


async def make_schedule(app: App, clock: Clock, cron: str = "* * * * *", **kw: Any) -> sc.Schedule:
    sid = app.ids()
    fields = {"cron": cron, "run_type": "plan", **kw}
    cmd = sc.SaveSchedule(
        actor="alice", schedule_id=sid, org="acme", workspace="net", create=True, **fields
    )
    was = app.clock
    app.clock = clock
    try:
        state, _ = await store.command(app, "acme", "net", cmd)
    finally:
        app.clock = was
    return state.schedules[sid]


async def fires_of(app: App, sid: str) -> list[sc.ScheduleFired | sc.ScheduleSkipped]:
    envs = await app.store.read(sc.fires_subject("acme", "net", sid))
    return [e.event for e in envs]  # type: ignore[misc]  # the fires subject's own


async def runs_of(app: App) -> dict[str, R.RunState]:
    envs = await app.store.read("rp.run.acme.net.*")
    by_run: dict[str, list[Any]] = {}
    for e in envs:
        by_run.setdefault(e.subject.rsplit(".", 1)[1], []).append(e.event)
    return {rid: R.fold(evs) for rid, evs in by_run.items()}


async def cancel(app: App, run_id: str) -> None:
    await app.run_command("acme", "net", run_id, R.CancelRun(actor="alice"))


def minute_at(m: int) -> datetime:
    return T0.replace(second=0) + m * MINUTE
