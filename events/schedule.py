"""Schedules: runs a workspace starts on a cron, in a time zone. Pure.

A workspace's schedules are one aggregate on `rp.org.<org>.sched.<ws>` (their
definitions: `org.schedule_saved`, `org.schedule_deleted`), so the cap per workspace is
decided on one subject by an optimistic append, and listing them is one read. What each
schedule has fired is on a subject of its own, `rp.org.<org>.sched.<ws>.<id>`
(`org.schedule_fired`, `org.schedule_skipped`): one event per fire time handled, each
carrying the whole fire state (the last fire time handled, the last run made), so a
scheduler needs only the subject's last event, however long the schedule has run.

Fire times are the cron's in the schedule's time zone (zoneinfo), on the local wall
clock, so `0 9 * * *` is 09:00 summer and winter. A wall time that does not exist (the
hour skipped when clocks go forward) fires once, at the instant it maps to with the
offset before the change (02:30 becomes 03:30); one that exists twice (the hour repeated
when clocks go back) fires once, at its first occurrence. Fire times are strictly
increasing instants, so no instant fires twice.

The floor is one minute: a cron has exactly five fields (a sixth, seconds, is refused),
and `@reboot` means nothing to a control plane. A fire missed while no scheduler ran
(its fire time more than `LATE_AFTER` old when handled) is fired once (`missed:
"run_once"`, the default: a drift check or a nightly apply late is better than none)
or skipped and recorded (`"skip"`); never once per missed time.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, assert_never
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

import msgspec
from croniter import CroniterError, croniter

from events.base import Command, Event
from events.errors import AlreadyExists, Invalid, NotFound

RUN_TYPES = ("plan", "drift", "apply", "destroy")
MISSED = ("run_once", "skip")
MAX_SCHEDULES = 20  # per workspace: each is a timer every scheduler replica keeps
MAX_CRON = 100  # characters: the longest sensible five fields fit many times over
MAX_TEMPLATE = 63
MACROS = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")
# A fire time handled later than this after it was due was missed (no scheduler ran).
LATE_AFTER = timedelta(minutes=2)
MISSED_COUNTED = 1000  # missed fire times counted for the record, at most
# How far a wall time in a skipped hour can map past itself (the largest DST shift is
# 2 hours, Antarctica/Troll); wall times are walked from this far back.
DST_REACH = timedelta(hours=3)
_WINDOWS = tuple(timedelta(days=d) for d in (1 / 24, 1, 32, 367, 8 * 366 + 2, 10**5))
# Steps a next-fire search may take over wall times that map to instants already passed
# (the repeated hour when clocks go back: 60 of an every-minute cron).
_SEARCH = 4096

# Reasons a fire time is skipped.
WAITING = "waiting"  # a run of the schedule already waits (pending or queued)
MISSED_SKIPPED = "missed"  # missed while no scheduler ran, and the schedule says skip
REFUSED = "refused"  # the run could not be created (workspace gone, template removed)


class InvalidSchedule(Invalid):
    """A schedule's definition is malformed: `field` names what (cron, timezone, ...)."""

    code = "invalid-schedule"

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


class TooManySchedules(Invalid):
    code = "schedule-limit-exceeded"


class Schedule(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    org: str
    workspace: str
    cron: str
    timezone: str = "UTC"
    run_type: str
    template: str = ""
    enabled: bool = True
    missed: str = "run_once"
    since: datetime  # fire times count from here: its creation, or the last change of timing
    created_at: datetime
    created_by: str
    updated_at: datetime


class ScheduleSaved(Event, frozen=True, kw_only=True, tag="org.schedule_saved"):
    """The whole schedule as it now is (created or changed)."""

    schedule: Schedule


class ScheduleDeleted(Event, frozen=True, kw_only=True, tag="org.schedule_deleted"):
    schedule_id: str


class ScheduleFired(Event, frozen=True, kw_only=True, tag="org.schedule_fired"):
    """Fire time `fire_time` made run `run_id`; `missed` earlier fire times were passed
    over (no scheduler ran across them) and this one stands for them."""

    schedule_id: str
    fire_time: datetime
    run_id: str
    missed: int = 0


class ScheduleSkipped(Event, frozen=True, kw_only=True, tag="org.schedule_skipped"):
    """Fire time `fire_time` (and `missed` before it) made no run, for `reason`."""

    schedule_id: str
    fire_time: datetime
    reason: str  # WAITING | MISSED_SKIPPED | REFUSED
    waiting_run: str = ""  # WAITING: the schedule's run that still waits
    last_run: str = ""  # the schedule's last run, carried on
    missed: int = 0
    detail: str = ""


ScheduleEvent = ScheduleSaved | ScheduleDeleted | ScheduleFired | ScheduleSkipped


def schedules_subject(org: str, ws: str) -> str:
    return f"rp.org.{org}.sched.{ws}"


def fires_subject(org: str, ws: str, schedule_id: str) -> str:
    return f"rp.org.{org}.sched.{ws}.{schedule_id}"


ALL_SCHEDULES = "rp.org.*.sched.*"  # every workspace's definitions (not their fires)


# ---------------------------------------------------------------- definitions


class SaveSchedule(Command, frozen=True, kw_only=True):
    """Create (`create=True`) or change a schedule: fields left None are kept."""

    schedule_id: str
    org: str
    workspace: str
    create: bool = False
    cron: str | None = None
    timezone: str | None = None
    run_type: str | None = None
    template: str | None = None
    enabled: bool | None = None
    missed: str | None = None


class DeleteSchedule(Command, frozen=True, kw_only=True):
    schedule_id: str


class SchedulesState(msgspec.Struct, frozen=True, kw_only=True):
    """A workspace's schedules, by id."""

    schedules: dict[str, Schedule] = {}
    version: int = 0


def evolve(state: SchedulesState, event: ScheduleEvent) -> SchedulesState:
    s = msgspec.structs.replace(state, version=state.version + 1)
    match event:
        case ScheduleSaved():
            return msgspec.structs.replace(
                s, schedules={**state.schedules, event.schedule.id: event.schedule}
            )
        case ScheduleDeleted():
            rest = {k: v for k, v in state.schedules.items() if k != event.schedule_id}
            return msgspec.structs.replace(s, schedules=rest)
        case ScheduleFired() | ScheduleSkipped():
            return s  # on each schedule's own subject
        case _:
            assert_never(event)


def fold(events: Sequence[Any], state: SchedulesState | None = None) -> SchedulesState:
    state = state or SchedulesState()
    for e in events:
        state = evolve(state, e)
    return state


def decide(
    state: SchedulesState, cmd: SaveSchedule | DeleteSchedule, *, now: datetime
) -> list[ScheduleEvent]:
    match cmd:
        case SaveSchedule():
            return _save(state, cmd, now)
        case DeleteSchedule():
            if cmd.schedule_id not in state.schedules:
                raise NotFound(f"schedule {cmd.schedule_id} not found")
            return [ScheduleDeleted(at=now, actor=cmd.actor, schedule_id=cmd.schedule_id)]
        case _:
            assert_never(cmd)


_FIELDS = ("cron", "timezone", "run_type", "template", "enabled", "missed")
_TIMING = ("cron", "timezone", "enabled")  # a change of these restarts the count (`since`)


def _save(state: SchedulesState, cmd: SaveSchedule, now: datetime) -> list[ScheduleEvent]:
    before = state.schedules.get(cmd.schedule_id)
    if cmd.create:
        if before is not None:
            raise AlreadyExists(f"schedule {cmd.schedule_id} exists")
        if len(state.schedules) >= MAX_SCHEDULES:
            raise TooManySchedules(f"a workspace has at most {MAX_SCHEDULES} schedules")
        for field in ("cron", "run_type"):
            if getattr(cmd, field) is None:
                raise InvalidSchedule(f"a schedule needs {field}", field=field)
        before = Schedule(
            id=cmd.schedule_id,
            org=cmd.org,
            workspace=cmd.workspace,
            cron="",
            run_type="",
            since=now,
            created_at=now,
            created_by=cmd.actor,
            updated_at=now,
        )
    elif before is None:
        raise NotFound(f"schedule {cmd.schedule_id} not found")
    changes = {k: getattr(cmd, k) for k in _FIELDS if getattr(cmd, k) is not None}
    after = msgspec.structs.replace(before, **changes)
    check(after)
    if not cmd.create and after == before:
        return []
    timing = any(getattr(after, k) != getattr(before, k) for k in _TIMING)
    after = msgspec.structs.replace(after, updated_at=now, since=now if timing else after.since)
    return [ScheduleSaved(at=now, actor=cmd.actor, schedule=after)]


def check(s: Schedule) -> None:
    """InvalidSchedule, naming the field, unless the schedule is well formed."""
    check_cron(s.cron)
    zone(s.timezone)
    if s.run_type not in RUN_TYPES:
        raise InvalidSchedule(f"run_type is one of {', '.join(RUN_TYPES)}", field="run_type")
    if s.missed not in MISSED:
        raise InvalidSchedule(f"missed is one of {', '.join(MISSED)}", field="missed")
    if len(s.template) > MAX_TEMPLATE or not _printable(s.template) or " " in s.template:
        raise InvalidSchedule("template is a template's name", field="template")


def _printable(text: str) -> bool:
    return text.isascii() and all(32 <= ord(c) < 127 for c in text)


def check_cron(expr: str) -> None:
    """Five fields (minute hour day-of-month month day-of-week) or one of MACROS, that
    fire at least once: a seconds or a years field, `@reboot`, or a date that never
    comes (`0 0 30 2 *`) is refused."""
    if not expr or len(expr) > MAX_CRON or not _printable(expr):
        raise InvalidSchedule(f"cron is 1 to {MAX_CRON} printable ASCII characters", field="cron")
    if expr.startswith("@"):
        if expr not in MACROS:
            raise InvalidSchedule(f"cron macros are {', '.join(MACROS)}", field="cron")
        return
    if len(expr.split()) != 5:
        raise InvalidSchedule(
            "cron has five fields: minute hour day-of-month month day-of-week "
            "(once a minute at most: no seconds field)",
            field="cron",
        )
    try:
        croniter(expr, datetime(2000, 1, 1)).get_next(datetime)
    except CroniterError as e:  # its messages quote the expression: say it our way
        raise InvalidSchedule(f"cron is not valid: {_reason(e)}", field="cron") from e


def _reason(e: CroniterError) -> str:
    name = type(e).__name__
    if name == "CroniterBadDateError":
        return "it never fires"
    return "a field is out of range or not understood"


def zone(name: str) -> ZoneInfo:
    """The IANA time zone `name` (InvalidSchedule if there is none of that name)."""
    if not name or len(name) > 64 or not _printable(name) or name not in _zones():
        raise InvalidSchedule(
            "timezone is an IANA time zone name, e.g. Europe/Paris", field="timezone"
        )
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as e:
        raise InvalidSchedule("timezone is not known", field="timezone") from e


_ZONES: set[str] = set()


def _zones() -> set[str]:
    # Looked up in the list, never opened by a name the caller chose (a path).
    if not _ZONES:
        _ZONES.update(available_timezones())
    return _ZONES


# ---------------------------------------------------------------- fire times


def _instants(s: Schedule, after: datetime) -> Iterator[datetime]:
    """The schedule's fire times strictly after `after`, strictly increasing, as UTC.

    A wall time in a skipped hour maps later than itself (02:30 -> 03:30), so one before
    `after`'s may still fire after it: when clocks went forward within DST_REACH before
    `after`, wall times are walked from that much earlier. A wall time that maps to an
    instant not after the last one (the repeated hour's second pass, a skipped hour's
    shifted twin) is passed over."""
    tz = zone(s.timezone)
    it = croniter(s.cron, after.astimezone(tz).replace(tzinfo=None) - _sprung(tz, after))
    last, stale = after, 0
    while stale < _SEARCH:
        try:
            wall: datetime = it.get_next(datetime)
        except CroniterError:  # no next date at all (check_cron refuses such a cron)
            return
        at = wall.replace(tzinfo=tz, fold=0).astimezone(UTC)
        if at > last:
            last, stale = at, 0
            yield at
        else:
            stale += 1


def _sprung(tz: ZoneInfo, at: datetime) -> timedelta:
    """How far clocks went forward within DST_REACH before `at` (zero mostly)."""
    now, before = tz.utcoffset(at.astimezone(tz)), tz.utcoffset((at - DST_REACH).astimezone(tz))
    if now is None or before is None or now <= before:
        return timedelta(0)
    return now - before + timedelta(minutes=1)


def next_fires(s: Schedule, after: datetime, count: int = 1) -> list[datetime]:
    """The schedule's next `count` fire times strictly after `after`, as UTC instants."""
    return list(itertools.islice(_instants(s, after), count))


def fires_between(s: Schedule, start: datetime, end: datetime, most: int) -> list[datetime]:
    """Up to `most` fire times in (start, end], oldest first."""
    return list(
        itertools.islice(itertools.takewhile(lambda t: t <= end, _instants(s, start)), most)
    )


# ---------------------------------------------------------------- firing


class FireState(msgspec.Struct, frozen=True, kw_only=True):
    """What a schedule has fired: the last fire time handled, its last run."""

    last_fire: datetime | None = None
    last_run: str = ""
    seq: int = 0  # the fires subject's last sequence (0: nothing fired yet)


def fire_state(last: ScheduleFired | ScheduleSkipped | None, seq: int) -> FireState:
    match last:
        case None:
            return FireState(seq=seq)
        case ScheduleFired():
            return FireState(last_fire=last.fire_time, last_run=last.run_id, seq=seq)
        case ScheduleSkipped():
            return FireState(last_fire=last.fire_time, last_run=last.last_run, seq=seq)
        case _:
            assert_never(last)


class Due(msgspec.Struct, frozen=True, kw_only=True):
    """The fire time to handle now: `missed` earlier ones are passed over for it, and
    `skip` says to record it skipped (missed itself, on a schedule that says skip)."""

    fire_time: datetime
    missed: int
    skip: bool


def due(s: Schedule, fires: FireState, now: datetime) -> Due | None:
    """The one fire time to handle at `now`, or None: the latest fire time at or before
    `now` not handled yet (counting from `since`). Several due at once means no
    scheduler ran across them: they are one fire (`missed` counts the others, up to
    MISSED_COUNTED), never a burst. The latest is itself missed when older than
    LATE_AFTER; a `skip` schedule then records it skipped instead of firing it."""
    if not s.enabled:
        return None
    start = max(s.since, fires.last_fire) if fires.last_fire else s.since
    first = next_fires(s, start)
    if not first or first[0] > now:
        return None
    latest = _latest(s, start, now)
    missed = len(fires_between(s, start, latest, MISSED_COUNTED + 1)) - 1
    late = now - latest > LATE_AFTER
    return Due(fire_time=latest, missed=missed, skip=late and s.missed == "skip")


def _latest(s: Schedule, start: datetime, now: datetime) -> datetime:
    """The last fire time in (start, now], which holds one: looked for in a window back
    from `now` that widens (an hour, a day, a month, a year, 8 years for 29 February),
    so a long downtime costs a window's walk, not one step per missed fire."""
    for window in _WINDOWS:
        anchor = max(start, now - window)
        found = None
        for at in _instants(s, anchor):
            if at > now:
                break
            found = at
        if found is not None:
            return found
    raise AssertionError("due: a fire time lies in (start, now]")  # `first` was one
