"""Reads the UI's pages need that the API has no answer for, each one statement on the
replica's read model (the same tables and row shapes as projections/readmodel.py), so a
page costs a few indexed reads however many runs the organization has.

They go through the read model's own connection and row mapping (`_all`, `_run`): this
module is their only user so far; they belong in ReadModel once another one appears.
"""

from __future__ import annotations

from typing import Any

import msgspec

from events.run import TERMINAL
from projections import readmodel
from projections.readmodel import ReadModel

# The runs not ended: the one each workspace holds, and those waiting in its queue.
_ACTIVE_IDS = (
    "SELECT active_run FROM workspaces WHERE org = ? AND active_run IS NOT NULL "
    "UNION SELECT run_id FROM ws_queue WHERE org = ?"
)


# A run that just ended may still be its workspace's active run until it is released.
_ENDED = ", ".join(f"'{s}'" for s in sorted(str(t) for t in TERMINAL))


def _cols(table: str) -> str:
    return ", ".join(f"{table}.{c.strip()}" for c in readmodel._RUN_COLS.split(","))


async def active_runs(
    read: ReadModel, org: str, limit: int
) -> tuple[list[dict[str, Any]], int, int]:
    """The organization's active runs, those awaiting approval first, then oldest first
    (at most `limit`); how many are active, and how many of them await approval."""
    rows = await read._all(  # one statement: the counts and the rows agree
        # CROSS JOIN keeps the active ids outermost: each run is one primary-key probe,
        # where `org = ? AND id IN (...)` had SQLite walk all the organization's runs.
        f"SELECT {_cols('runs')}, count(*) OVER () AS active, "
        "sum(runs.status = 'awaiting_approval') OVER () AS awaiting "
        f"FROM ({_ACTIVE_IDS}) AS a CROSS JOIN runs ON runs.id = a.active_run "
        f"WHERE runs.org = ? AND runs.status NOT IN ({_ENDED}) "
        "ORDER BY runs.status = 'awaiting_approval' DESC, runs.created_at, runs.id LIMIT ?",
        (org, org, org, limit),
    )
    if not rows:
        return [], 0, 0
    return [readmodel._run(r) for r in rows], int(rows[0]["active"]), int(rows[0]["awaiting"])


async def latest_runs(read: ReadModel, org: str) -> dict[str, dict[str, Any]]:
    """Each workspace's newest run: its id and status (one index probe per workspace,
    in one statement)."""
    newest = (
        "SELECT (SELECT r.id FROM runs r WHERE r.org = w.org AND r.workspace = w.name "
        "ORDER BY r.created_at DESC, r.id DESC LIMIT 1) FROM workspaces w WHERE w.org = ?"
    )
    rows = await read._all(f"SELECT id, workspace, status FROM runs WHERE id IN ({newest})", (org,))
    return {r["workspace"]: dict(r) for r in rows}


async def workspaces(read: ReadModel, org: str) -> list[dict[str, Any]]:
    """Every workspace of the organization by name: its lock, active run and how many
    runs wait in its queue (what the organization page lists, nothing decoded it skips)."""
    rows = await read._all(
        "SELECT w.name, w.active_run, w.lock_json, "
        "(SELECT count(*) FROM ws_queue q WHERE q.org = w.org AND q.workspace = w.name) AS waiting "
        "FROM workspaces w WHERE w.org = ? ORDER BY w.name",
        (org,),
    )
    return [
        {
            "name": r["name"],
            "active_run": r["active_run"],
            "waiting": r["waiting"],
            "lock": msgspec.json.decode(r["lock_json"]) if r["lock_json"] else None,
        }
        for r in rows
    ]
