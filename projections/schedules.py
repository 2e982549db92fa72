"""What schedules fired: the fold and the query.

`schedule_fires` (`projections/schema.py`): one row per `org.schedule_fired` or
`org.schedule_skipped`, keyed by its schedule and stream sequence, so a schedule's
history lists newest first (the definitions themselves are read from their subject,
services/processes/schedules/store.py: no row for them).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiosqlite

from events import schedule as sc
from projections.working import Meta, Working, iso

Query = Callable[[str, Sequence[Any]], Awaitable[list[aiosqlite.Row]]]
MAX_FIRES = 100  # the newest a list answers
_COLS = "fire_time, outcome, run_id, reason, waiting_run, missed, detail, at"


def project_schedule(w: Working, meta: Meta, event: sc.ScheduleEvent) -> None:
    match event:
        case sc.ScheduleFired() | sc.ScheduleSkipped():
            w.insert("schedule_fires", _fire_row(meta, event))
        case sc.ScheduleSaved() | sc.ScheduleDeleted():
            pass  # read from their subject; kept in the audit history


def _fire_row(meta: Meta, e: sc.ScheduleFired | sc.ScheduleSkipped) -> dict[str, Any]:
    parts = meta.subject.split(".")  # rp.org.<org>.sched.<ws>.<id>
    fired = isinstance(e, sc.ScheduleFired)
    return {
        "schedule_id": e.schedule_id,
        "seq": meta.seq,
        "org": parts[2],
        "workspace": parts[4],
        "fire_time": iso(e.fire_time),
        "outcome": "fired" if fired else "skipped",
        "run_id": e.run_id if isinstance(e, sc.ScheduleFired) else None,
        "reason": None if isinstance(e, sc.ScheduleFired) else e.reason,
        "waiting_run": None if isinstance(e, sc.ScheduleFired) else e.waiting_run or None,
        "missed": e.missed,
        "detail": None if isinstance(e, sc.ScheduleFired) else e.detail or None,
        "at": iso(e.at),
    }


async def fires(q: Query, org: str, ws: str, schedule_id: str) -> list[dict[str, Any]]:
    """The schedule's fire records, newest first (at most MAX_FIRES)."""
    sql = (
        f"SELECT {_COLS} FROM schedule_fires WHERE schedule_id = ? AND org = ? AND workspace = ?"
        f" ORDER BY seq DESC LIMIT {MAX_FIRES}"
    )
    rows = await q(sql, (schedule_id, org, ws))
    return [{k: r[k] for k in _COLS.split(", ")} for r in rows]
