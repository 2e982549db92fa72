"""A workspace's schedules on the event store: load, decide, append; and fire states.

The definitions of a workspace's schedules are one aggregate (events/schedule.py), read
and written like any other: load, the pure `decide`, an append checked against the
subject's last sequence, retried on a conflict. A schedule's fire state is the last
event on its fires subject, read from the stream's leader: what a firing is decided on
must be at least as new as every fire already recorded.
"""

from __future__ import annotations

from events import schedule as sc
from events.errors import Conflict
from infra.eventstore import LATEST, Append
from services.app.aggregates import SCHEDULES
from services.app.commands import App


async def load(
    app: App, org: str, ws: str, *, latest: bool = False, min_seq: int = 0
) -> tuple[sc.SchedulesState, int]:
    """The workspace's schedules and the subject's last sequence. `latest`: as the
    stream's leader has them now (what a firing is decided on); `min_seq`: at least as
    new as that stream sequence (a reader's own last write)."""
    need = LATEST if latest else min_seq
    found = await app.load(SCHEDULES, sc.schedules_subject(org, ws), min_seq=need)
    return found.state, found.seq


async def command(
    app: App, org: str, ws: str, cmd: sc.SaveSchedule | sc.DeleteSchedule
) -> tuple[sc.SchedulesState, int]:
    """Decide and append a schedule command (`Repository.execute`); the new state and the
    last sequence."""
    done = await app.execute(SCHEDULES, sc.schedules_subject(org, ws), cmd)
    return done.state, done.seq


async def fire_state(app: App, org: str, ws: str, schedule_id: str) -> sc.FireState:
    """The schedule's last fire record, as the stream's leader has it (two reads: its
    last sequence, then that one event, however many fires came before)."""
    subject = sc.fires_subject(org, ws, schedule_id)
    seq = await app.store.last_seq_of(subject)
    if not seq:
        return sc.fire_state(None, 0)
    envs = await app.store.read(subject, after=seq - 1, min_seq=seq)
    last = envs[-1].event if envs else None
    if not isinstance(last, sc.ScheduleFired | sc.ScheduleSkipped):
        raise Conflict(f"the fires subject of schedule {schedule_id} holds {type(last).__name__}")
    return sc.fire_state(last, envs[-1].seq)


async def record(
    app: App, org: str, ws: str, fires: sc.FireState, event: sc.ScheduleFired | sc.ScheduleSkipped
) -> int:
    """Append a fire record after `fires` (Conflict if another scheduler recorded one
    first: that one stands)."""
    subject = sc.fires_subject(org, ws, event.schedule_id)
    append = Append(subject=subject, event=event, expected=fires.seq, msg_id=app.ids())
    return await app.store.append([append])
