"""The read model's queries of runs (`ReadModel.runs`): one, a page, a run's events,
steps, changes and resources, and the runs the web UI's pages show."""

from __future__ import annotations

from typing import Any

import aiosqlite
import msgspec

from events.run import TERMINAL, RunState
from projections import changes, liveness, state_versions
from projections.reader import Reader

_RUN_COLS = (
    "id, org, workspace, type, status, created_by, created_at, updated_at, message, "
    "commit_sha, has_changes, plan_add, plan_change, plan_destroy, apply_add, apply_change, "
    "apply_destroy, plan_digest, approved_by, acknowledged_json, reason, error_message, "
    "phase, executor_id, last_seq, cause_json, log_removed_at"
)
# The runs not ended: the one each workspace holds, and those waiting in its queue.
_ACTIVE_IDS = (
    "SELECT active_run FROM workspaces WHERE org = ? AND active_run IS NOT NULL "
    "UNION SELECT run_id FROM ws_queue WHERE org = ?"
)
# A run that just ended may still be its workspace's active run until it is released.
_ENDED = ", ".join(f"'{s}'" for s in sorted(str(t) for t in TERMINAL))
# A run that may have changed its workspace's resources: it applied, its apply finished
# (a custom step after it may have failed), or it failed while applying.
_APPLIED = "status = 'applied' OR apply_add IS NOT NULL OR (status = 'failed' AND phase = 'apply')"
_state = msgspec.json.Decoder(RunState)
_ENVELOPE = ("type", "at", "actor")
_MAX_LIMIT = 1000


class Runs:
    """Runs, each as a plain dict ready for JSON."""

    def __init__(self, read: Reader) -> None:
        self._read = read

    async def get(self, org: str, run_id: str, *, live: bool = False) -> dict[str, Any] | None:
        """The run, or None if it does not exist or belongs to another organization.

        With what it is pinned to: its snapshot, its commit's author and message; with
        `live`, also its `owner` and `deadline` as the board's fold has them
        (projections/liveness.py), read with the row.
        """
        # One statement: the pins from the same moment as the row (a statement is its
        # own snapshot), in one trip to the connection's thread (five were: BEGIN, the
        # row, two of pins, COMMIT).
        row = await self._read.row(
            f"SELECT {state_versions.PIN_COLUMNS}, {_selected(live)} "
            "WHERE runs.id = ? AND runs.org = ?",
            (run_id, org),
        )
        if row is None:
            return None
        pins = state_versions.pins_of_row(row)
        return _run(row) | pins | (liveness.of_row(row) if live else {})

    async def removed_at(self, org: str, run_id: str) -> str | None:
        """When retention removed the run's whole record (run.removed), or None."""
        row = await self._read.row(
            "SELECT removed_at FROM removed_runs WHERE id = ? AND org = ?", (run_id, org)
        )
        return None if row is None else str(row["removed_at"])

    async def workspace_of(self, org: str, run_id: str) -> str | None:
        """The run's workspace (what the access check needs of it), or None."""
        row = await self._read.row(
            "SELECT workspace FROM runs WHERE id = ? AND org = ?", (run_id, org)
        )
        return None if row is None else str(row["workspace"])

    async def find(
        self,
        org: str,
        *,
        workspace: str | None = None,
        status: list[str] | None = None,
        limit: int = 100,
        before: str | None = None,
        full: bool = True,
        live: bool = False,
    ) -> list[dict[str, Any]]:
        """Runs newest first. `before` is the id of the last run of the previous page.

        `full`: each as `get` answers it (with `live`, as `get(live=True)` does);
        otherwise only the runs table's own fields (the API's `fields=summary`)."""
        where, params = ["runs.org = ?"], [org]
        if workspace is not None:
            where.append("runs.workspace = ?")
            params.append(workspace)
        if status:
            where.append(f"runs.status IN ({', '.join('?' * len(status))})")
            params.extend(status)
        if before is not None:
            # An unknown cursor matches nothing, rather than restarting at the newest run.
            where.append(
                "(runs.created_at, runs.id) < "
                "(SELECT created_at, id FROM runs WHERE org = ? AND id = ?)"
            )
            params.extend([org, before])
        live = live and full
        sql = (
            f"SELECT {_selected(live)} WHERE {' AND '.join(where)} "
            "ORDER BY runs.created_at DESC, runs.id DESC LIMIT ?"
        )
        async with self._read.snapshot():  # the pins from the same moment as the rows
            found = await self._read.rows(sql, [*params, max(0, min(limit, _MAX_LIMIT))])
            rows = [_run(r) for r in found]
            if not full:
                return rows
            pins = await state_versions.runs_pins(self._read.rows, [r["id"] for r in rows])
        lives = [liveness.of_row(f) if live else {} for f in found]
        return [r | pins[r["id"]] | v for r, v in zip(rows, lives, strict=True)]

    async def open(self, org: str, ws: str, limit: int = 5) -> list[str]:
        """Runs of the workspace that have not ended (speculative plans included), oldest
        first."""
        rows = await self._read.rows(
            f"SELECT id FROM runs WHERE org = ? AND workspace = ? AND status NOT IN ({_ENDED}) "
            "ORDER BY created_at, id LIMIT ?",
            (org, ws, limit),
        )
        return [r["id"] for r in rows]

    async def applied_line(self, org: str, ws: str) -> list[str]:
        """The commits a new apply of the workspace must descend from not to undo one:
        that of its last run that applied (or failed while applying: it may have changed
        something), and those of its apply and destroy runs not ended, which apply before
        a run created now (a run of an uploaded configuration has none)."""
        last = await self._read.row(
            f"SELECT commit_sha FROM runs WHERE org = ? AND workspace = ? AND ({_APPLIED}) "
            "AND commit_sha IS NOT NULL ORDER BY created_at DESC, id DESC LIMIT 1",
            (org, ws),
        )
        coming = await self._read.rows(
            "SELECT commit_sha, state_json FROM runs WHERE org = ? AND workspace = ? "
            f"AND status NOT IN ({_ENDED}) AND type IN ('apply', 'destroy') LIMIT ?",
            (org, ws, _MAX_LIMIT),
        )
        commits = [last["commit_sha"]] if last is not None else []
        for r in coming:
            state = _state.decode(r["state_json"]) if r["state_json"] else None
            commit = r["commit_sha"] or (state.requested_commit if state else "")
            if commit and commit not in commits:
                commits.append(commit)
        return commits

    async def events(self, org: str, run_id: str) -> list[dict[str, Any]]:
        """The run's own events in stream order; `data` is the payload without the envelope."""
        rows = await self._read.rows(
            "SELECT seq, type, at, actor, data_json FROM events "
            "WHERE run_id = ? AND org = ? ORDER BY seq",
            (run_id, org),
        )
        return [_event(r) for r in rows]

    async def steps(self, org: str, run_id: str) -> list[dict[str, Any]]:
        """The run's steps in the order they started."""
        rows = await self._read.rows(
            "SELECT s.phase, s.step, s.status, s.started_at, s.ended_at, s.duration_ms, "
            "s.error, s.log_object, s.metrics_json FROM steps s JOIN runs r ON r.id = s.run_id "
            "WHERE s.run_id = ? AND r.org = ? ORDER BY s.started_seq, s.phase, s.step",
            (run_id, org),
        )
        return [_step(r) for r in rows]

    async def changes(self, org: str, run_id: str) -> dict[str, Any] | None:
        """The run's plan changes grouped for review; None if the org has no such run."""
        async with self._read.snapshot():
            return await changes.run_changes(self._read.rows, org, run_id)

    async def resources(self, org: str, run_id: str) -> list[dict[str, Any]]:
        """The apply's resources, each with its state and its stages in order."""
        async with self._read.snapshot():
            return await changes.run_resources(self._read.rows, org, run_id)

    # ------------------------------------------------------------ the web UI's pages

    async def active(self, org: str, limit: int) -> tuple[list[dict[str, Any]], int, int]:
        """The organization's active runs (the bar of every UI page), those awaiting
        approval first, then oldest first (at most `limit`); how many are active, and how
        many of them await approval. One statement, so the counts and the rows agree."""
        rows = await self._read.rows(
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
        return [_run(r) for r in rows], int(rows[0]["active"]), int(rows[0]["awaiting"])

    async def latest(self, org: str) -> dict[str, dict[str, Any]]:
        """Each workspace's newest run: its id and status (one index probe per workspace,
        in one statement)."""
        newest = (
            "SELECT (SELECT r.id FROM runs r WHERE r.org = w.org AND r.workspace = w.name "
            "ORDER BY r.created_at DESC, r.id DESC LIMIT 1) FROM workspaces w WHERE w.org = ?"
        )
        rows = await self._read.rows(
            f"SELECT id, workspace, status FROM runs WHERE id IN ({newest})", (org,)
        )
        return {r["workspace"]: dict(r) for r in rows}


def _summary(row: aiosqlite.Row, prefix: str) -> dict[str, int] | None:
    if row[f"{prefix}_add"] is None:
        return None
    return {k: row[f"{prefix}_{k}"] for k in ("add", "change", "destroy")}


def _cols(table: str) -> str:
    """The run columns, each named by `table` (for a statement that joins)."""
    return ", ".join(f"{table}.{c.strip()}" for c in _RUN_COLS.split(","))


def _run(row: aiosqlite.Row) -> dict[str, Any]:
    r = dict(row)
    return {
        "id": r["id"],
        "org": r["org"],
        "workspace": r["workspace"],
        "type": r["type"],
        "status": r["status"],
        "created_by": r["created_by"],
        "created_at": r["created_at"],
        "updated_at": r["updated_at"],
        "message": r["message"],
        "commit": r["commit_sha"],
        "has_changes": None if r["has_changes"] is None else bool(r["has_changes"]),
        "plan_summary": _summary(row, "plan"),
        "apply_summary": _summary(row, "apply"),
        "plan_digest": r["plan_digest"],
        "approved_by": r["approved_by"],
        "acknowledged": msgspec.json.decode(r["acknowledged_json"] or "[]"),
        "reason": r["reason"],
        "error_message": r["error_message"],
        "phase": r["phase"],
        "executor_id": r["executor_id"],
        "seq": r["last_seq"],
        "cause": msgspec.json.decode(r["cause_json"]) if r["cause_json"] else None,
        "log_removed_at": r["log_removed_at"],  # retention removed its stored logs then
    }


def _step(row: aiosqlite.Row) -> dict[str, Any]:
    out = dict(row)
    out["metrics"] = msgspec.json.decode(out.pop("metrics_json") or "{}")
    return out


def _event(row: aiosqlite.Row) -> dict[str, Any]:
    data = msgspec.json.decode(row["data_json"])
    for key in _ENVELOPE:
        data.pop(key, None)
    return {
        "seq": row["seq"],
        "type": row["type"],
        "at": row["at"],
        "actor": row["actor"],
        "data": data,
    }


def _selected(live: bool) -> str:
    """What a run is read from: its row, and with `live` its board entries joined."""
    if live:
        return f"{_cols('runs')}, {liveness.COLUMNS} FROM runs {liveness.JOIN}"
    return f"{_RUN_COLS} FROM runs"
