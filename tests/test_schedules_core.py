"""Schedules, the pure core (events/schedule.py): what a cron may be, the fire times it
makes in a time zone across daylight saving changes, the cap per workspace, and which
fire time is due (one, however many were missed)."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events import schedule as sc
from events.codec import decode, encode
from events.errors import NotFound

AT = datetime(2026, 1, 1, tzinfo=UTC)
NY = ZoneInfo("America/New_York")


def _schedule(cron: str = "* * * * *", **kw: Any) -> sc.Schedule:
    fields: dict[str, Any] = {
        "id": "s1",
        "org": "acme",
        "workspace": "net",
        "cron": cron,
        "run_type": "plan",
        "since": AT,
        "created_at": AT,
        "created_by": "alice",
        "updated_at": AT,
        **kw,
    }
    return sc.Schedule(**fields)


def _create(state: sc.SchedulesState, sid: str = "s1", **kw: Any) -> sc.SchedulesState:
    fields = {"cron": "0 * * * *", "run_type": "drift", **kw}
    cmd = sc.SaveSchedule(
        actor="alice", schedule_id=sid, org="acme", workspace="net", create=True, **fields
    )
    return sc.fold(sc.decide(state, cmd, now=AT), state)


# ---------------------------------------------------------------- what a cron may be

HOSTILE = [
    "* * * * * *",  # a seconds field: more often than once a minute
    "*/1 * * * * * *",  # seconds and years
    "@reboot",
    "@every 1s",
    "",
    " ",
    "* * * *",
    "61 * * * *",
    "*/0 * * * *",
    "0 0 30 2 *",  # never fires
    "٣ * * * *",  # a non-ASCII digit
    "* * * * *\n* * * * *",
    "* * * * *\x00",
    "H * * * *",
    "1" * 5000,
    "* " * 2000,
    ",".join(["1"] * 60) + " * * * *",  # 119 characters
]


@pytest.mark.parametrize("cron", HOSTILE, ids=lambda c: repr(c[:20]))
def test_a_hostile_or_too_frequent_cron_is_refused_naming_the_field(cron: str) -> None:
    with pytest.raises(sc.InvalidSchedule) as e:
        sc.check(_schedule(cron))
    assert e.value.field == "cron"
    assert len(str(e.value)) < 200  # said in our words: the input is never echoed back


@pytest.mark.parametrize(
    "cron", ["* * * * *", "*/5 9-17 * * 1-5", "0 0 L * *", "0 3 * * 1#2", "@hourly", "@daily"]
)
def test_five_fields_and_the_usual_macros_are_accepted(cron: str) -> None:
    sc.check(_schedule(cron))


@pytest.mark.parametrize(
    "tz", ["Mars/Olympus", "../../etc/passwd", "", "UTC\x00", "Europe/Paris " * 10]
)
def test_an_unknown_time_zone_is_refused(tz: str) -> None:
    with pytest.raises(sc.InvalidSchedule) as e:
        sc.check(_schedule(timezone=tz))
    assert e.value.field == "timezone"


def test_run_type_missed_and_template_are_checked() -> None:
    for kw, field in (
        ({"run_type": "import"}, "run_type"),
        ({"missed": "burst"}, "missed"),
        ({"template": "a b"}, "template"),
    ):
        with pytest.raises(sc.InvalidSchedule) as e:
            sc.check(_schedule(**kw))
        assert e.value.field == field


# ---------------------------------------------------------------- definitions


def test_a_workspace_has_at_most_max_schedules() -> None:
    state = sc.SchedulesState()
    for i in range(sc.MAX_SCHEDULES):
        state = _create(state, f"s{i}")
    with pytest.raises(sc.TooManySchedules):
        _create(state, "one-more")
    gone = sc.fold(sc.decide(state, sc.DeleteSchedule(actor="a", schedule_id="s0"), now=AT), state)
    assert len(_create(gone, "one-more").schedules) == sc.MAX_SCHEDULES


def test_a_change_of_timing_restarts_the_count_and_another_change_does_not() -> None:
    state = _create(sc.SchedulesState())
    later = AT + timedelta(days=3)

    def patch(**kw: Any) -> sc.Schedule:
        cmd = sc.SaveSchedule(actor="bob", schedule_id="s1", org="acme", workspace="net", **kw)
        (saved,) = sc.decide(state, cmd, now=later)
        assert isinstance(saved, sc.ScheduleSaved)
        return saved.schedule

    assert patch(cron="*/5 * * * *").since == later
    assert patch(enabled=False).since == later
    assert patch(run_type="plan").since == AT  # what it runs, not when
    assert (
        sc.decide(
            state,
            sc.SaveSchedule(actor="b", schedule_id="s1", org="acme", workspace="net"),
            now=later,
        )
        == []
    )
    with pytest.raises(NotFound):
        sc.decide(state, sc.DeleteSchedule(actor="a", schedule_id="nope"), now=AT)


def test_schedule_events_round_trip_through_the_codec_under_their_tags() -> None:
    s = _schedule()
    for e in (
        sc.ScheduleSaved(at=AT, actor="a", schedule=s),
        sc.ScheduleDeleted(at=AT, actor="a", schedule_id="s1"),
        sc.ScheduleFired(
            at=AT, actor="schedule", schedule_id="s1", fire_time=AT, run_id="r", missed=3
        ),
        sc.ScheduleSkipped(
            at=AT, actor="schedule", schedule_id="s1", fire_time=AT, reason=sc.WAITING
        ),
    ):
        assert decode(encode(e)) == e
        assert msgspec.json.decode(encode(e))["type"].startswith("org.schedule_")


# ---------------------------------------------------------------- fire times


def _local(ts: list[datetime]) -> list[str]:
    return [t.astimezone(NY).strftime("%m-%d %H:%M%z") for t in ts]


def test_a_daily_time_in_the_hour_clocks_skip_fires_once_shifted_forward() -> None:
    s = _schedule("30 2 * * *", timezone="America/New_York")
    got = sc.next_fires(s, datetime(2026, 3, 6, tzinfo=UTC), 4)
    assert _local(got) == [
        "03-06 02:30-0500",
        "03-07 02:30-0500",
        "03-08 03:30-0400",
        "03-09 02:30-0400",
    ]


def test_a_daily_time_in_the_hour_clocks_repeat_fires_once_at_its_first_occurrence() -> None:
    s = _schedule("30 1 * * *", timezone="America/New_York")
    got = sc.next_fires(s, datetime(2026, 10, 31, 12, tzinfo=UTC), 3)
    assert _local(got) == ["11-01 01:30-0400", "11-02 01:30-0500", "11-03 01:30-0500"]


@pytest.mark.parametrize(
    "start", [datetime(2026, 3, 8, 5, tzinfo=UTC), datetime(2026, 11, 1, 4, tzinfo=UTC)]
)
def test_every_minute_across_a_change_fires_strictly_later_each_time_no_instant_twice(
    start: datetime,
) -> None:
    s = _schedule("* * * * *", timezone="America/New_York")
    got = sc.next_fires(s, start, 240)
    assert got == sorted(set(got)) and len(got) == 240
    gaps = {b - a for a, b in itertools.pairwise(got)}
    # spring: every real minute once; autumn: the repeated hour's second pass is not fired
    assert gaps <= {timedelta(minutes=1), timedelta(minutes=61)}


def test_the_next_fire_after_the_spring_change_still_finds_the_shifted_time() -> None:
    """From 03:10 EDT on the change day, 02:30 (which became 03:30) is still to come."""
    s = _schedule("30 2 * * *", timezone="America/New_York")
    assert _local(sc.next_fires(s, datetime(2026, 3, 8, 7, 10, tzinfo=UTC))) == ["03-08 03:30-0400"]


# ---------------------------------------------------------------- what is due


def test_nothing_is_due_before_the_first_fire_time_after_since() -> None:
    s = _schedule("0 * * * *")
    assert sc.due(s, sc.FireState(), AT + timedelta(minutes=59)) is None
    d = sc.due(s, sc.FireState(), AT + timedelta(hours=1, seconds=3))
    assert d == sc.Due(fire_time=AT + timedelta(hours=1), missed=0, skip=False)
    handled = sc.FireState(last_fire=AT + timedelta(hours=1), last_run="r", seq=9)
    assert sc.due(s, handled, AT + timedelta(hours=1, minutes=30)) is None


def test_a_week_missed_is_one_fire_of_the_latest_time_never_a_burst() -> None:
    s = _schedule("* * * * *")
    last = AT + timedelta(days=10)
    now = last + timedelta(days=7, seconds=20)
    d = sc.due(s, sc.FireState(last_fire=last, seq=5), now)
    assert d is not None
    assert d.fire_time == now.replace(second=0) and not d.skip
    assert d.missed == sc.MISSED_COUNTED  # counted up to the bound, for the record
    hourly = _schedule("0 * * * *")
    d = sc.due(hourly, sc.FireState(last_fire=AT, seq=5), AT + timedelta(hours=5, minutes=10))
    assert d == sc.Due(fire_time=AT + timedelta(hours=5), missed=4, skip=False)


def test_a_skip_schedule_skips_a_missed_fire_but_fires_one_on_time() -> None:
    s = _schedule("0 * * * *", missed="skip")
    late = sc.due(s, sc.FireState(last_fire=AT, seq=1), AT + timedelta(hours=3, minutes=10))
    assert late is not None and late.skip and late.missed == 2
    on_time = sc.due(s, sc.FireState(last_fire=AT, seq=1), AT + timedelta(hours=1, seconds=30))
    assert on_time is not None and not on_time.skip


def test_a_disabled_schedule_is_never_due() -> None:
    assert sc.due(_schedule(enabled=False), sc.FireState(), AT + timedelta(days=1)) is None


# ---------------------------------------------------------------- every fire once

# Each zone's 2026 clock changes (UTC), and a day of none.
CHANGES = [
    ("America/New_York", datetime(2026, 3, 8, 7, tzinfo=UTC)),  # forward an hour
    ("America/New_York", datetime(2026, 11, 1, 6, tzinfo=UTC)),  # back an hour
    ("Europe/London", datetime(2026, 3, 29, 1, tzinfo=UTC)),
    ("Europe/London", datetime(2026, 10, 25, 1, tzinfo=UTC)),
    ("Australia/Lord_Howe", datetime(2026, 4, 4, 15, tzinfo=UTC)),  # back half an hour
    ("Australia/Lord_Howe", datetime(2026, 10, 3, 15, 30, tzinfo=UTC)),  # forward half
    ("UTC", datetime(2026, 6, 1, 12, tzinfo=UTC)),
]


@settings(max_examples=150, deadline=None)
@given(
    cron=st.sampled_from(["* * * * *", "*/7 * * * *", "0,30 1-3 * * *", "15 2 * * *"]),
    change=st.sampled_from(CHANGES),
    back=st.integers(min_value=0, max_value=240),
    gaps=st.lists(st.integers(min_value=1, max_value=59), min_size=1, max_size=600),
)
def test_ticks_closer_than_a_minute_handle_every_fire_time_once_and_none_late(
    cron: str, change: tuple[str, datetime], back: int, gaps: list[int]
) -> None:
    """Whatever the cron, the zone (DST changes of an hour and of half an hour
    included) and the ticks (under a minute apart, as the loop's are), each fire time
    after `since` is handled exactly once, in order, none counted missed nor skipped."""
    tz, at = change
    start = at - timedelta(minutes=back)  # up to 4 hours before the change
    s = _schedule(cron, timezone=tz, missed="skip", since=start)
    fires, handled, now = sc.FireState(), [], start
    for gap in gaps:
        now += timedelta(seconds=gap)
        d = sc.due(s, fires, now)
        if d is not None:
            assert (d.missed, d.skip) == (0, False), d
            handled.append(d.fire_time)
            fires = sc.FireState(last_fire=d.fire_time, seq=len(handled))
    assert handled == sc.fires_between(s, start, now, 10_000)
