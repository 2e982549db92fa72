"""Queries over the read model, answering plain dicts ready for JSON.

A `ReadModel` has its own connection, apart from the projector's writer: in WAL mode it
reads the last committed batch while the next one is being written, and it never sees a
batch half-applied. Answers that need two tables read both in one snapshot.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import aiosqlite
import msgspec

from events.run import TERMINAL
from projections import changes, liveness, notifications, schedules, state_versions, vcs
from projections.schema import TABLES

_RUN_COLS = (
    "id, org, workspace, type, status, created_by, created_at, updated_at, message, "
    "commit_sha, has_changes, plan_add, plan_change, plan_destroy, apply_add, apply_change, "
    "apply_destroy, plan_digest, approved_by, acknowledged_json, reason, error_message, "
    "phase, executor_id, last_seq, cause_json"
)
_WS_COLS = (
    "org, name, repository, branch, directory, variables_json, created_at, created_by, active_run"
    ", heartbeat_timeout, dispatch_timeout, managed_state, lock_json, vcs_connection, triggers_json"
    ", deleted_at"
)
# A token's row with its revocation and last use (each apart: projections/schema.py).
_TOKEN_COLS = (
    "t.token_id, t.user, t.role, t.created_at, t.created_by, t.expires_at, u.last_used_at"
    ", r.revoked_at"
)
_TOKEN_JOIN = (
    "tokens t LEFT JOIN token_revocations r ON r.token_id = t.token_id"
    " LEFT JOIN token_uses u ON u.token_id = t.token_id"
)
# The runs not ended: the one each workspace holds, and those waiting in its queue.
_ACTIVE_IDS = (
    "SELECT active_run FROM workspaces WHERE org = ? AND active_run IS NOT NULL "
    "UNION SELECT run_id FROM ws_queue WHERE org = ?"
)
# A run that just ended may still be its workspace's active run until it is released.
_ENDED = ", ".join(f"'{s}'" for s in sorted(str(t) for t in TERMINAL))
_ENVELOPE = ("type", "at", "actor")
_MAX_LIMIT = 1000


class ReadModel:
    """Read-only queries of one read-model database."""

    def __init__(self, db: aiosqlite.Connection) -> None:
        self.db = db
        self._lock = asyncio.Lock()  # one snapshot at a time, no query inside another's
        self._holder: asyncio.Task[Any] | None = None  # the task whose snapshot is open

    @classmethod
    async def open(cls, path: Path) -> ReadModel:
        """A read-only connection to a database the projector created."""
        db = await aiosqlite.connect(path, isolation_level=None)
        db.row_factory = aiosqlite.Row
        await db.execute("PRAGMA query_only = ON")
        await db.execute("PRAGMA busy_timeout = 5000")
        return cls(db)

    async def close(self) -> None:
        await self.db.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # ------------------------------------------------------------ plumbing

    # A query runs to its last row in one call on the connection's thread, cancelled or
    # not: a cursor left part-read (its caller cancelled between execute and fetch) would
    # hold its read snapshot, and the connection's next query would read that old state.

    async def _all(self, sql: str, params: Sequence[Any] = ()) -> list[aiosqlite.Row]:
        if self._holding():  # a query of the snapshot this task holds
            return list(await self.db.execute_fetchall(sql, params))
        async with self._lock:  # never inside another caller's snapshot: it may be older
            return list(await self.db.execute_fetchall(sql, params))

    async def _one(self, sql: str, params: Sequence[Any] = ()) -> aiosqlite.Row | None:
        rows = await self._all(sql, params)
        return rows[0] if rows else None

    def _holding(self) -> bool:
        return self._holder is not None and self._holder is asyncio.current_task()

    @asynccontextmanager
    async def _snapshot(self) -> AsyncIterator[None]:
        """One read transaction; serialized, since the connection is shared by callers:
        a query of another caller waits for its end (within it, it would read the
        snapshot's older state, whatever RP-Min-Seq it waited for).

        A cancelled await does not withdraw its statement: aiosqlite runs what it has
        queued, in order. So BEGIN is queued inside the `try`, and its COMMIT always
        queued after it, even when the caller was cancelled waiting for the BEGIN (a
        BEGIN left open would pin every later read of the connection to an old snapshot,
        and refuse the next BEGIN)."""
        if self._holding():  # already within this task's snapshot
            yield
            return
        async with self._lock:
            self._holder = asyncio.current_task()
            try:
                await self.db.execute("BEGIN")
                yield
            finally:
                self._holder = None
                try:
                    await self.db.execute("COMMIT")
                except sqlite3.OperationalError:
                    if self.db.in_transaction:
                        await self.db.execute("ROLLBACK")
                        raise
                    # the BEGIN itself failed: its error is the one to see

    # ------------------------------------------------------------ organizations

    async def get_org(self, org: str) -> dict[str, Any] | None:
        row = await self._one(
            "SELECT name, created_at, created_by FROM orgs WHERE name = ?", (org,)
        )
        return dict(row) if row else None

    async def token(self, token_hash: str) -> dict[str, Any] | None:
        """Who a token (given by its SHA-256 hex digest) belongs to, with its lifecycle:
        `revoked_at`, `expires_at` and `last_used_at` (each null if not so)."""
        row = await self._one(
            f"SELECT t.org, {_TOKEN_COLS} FROM {_TOKEN_JOIN} WHERE t.token_hash = ?",
            (token_hash,),
        )
        return dict(row) if row else None

    async def list_tokens(self, org: str) -> list[dict[str, Any]]:
        """The organization's tokens not revoked, oldest first: never a hash."""
        rows = await self._all(
            f"SELECT {_TOKEN_COLS} FROM {_TOKEN_JOIN} WHERE t.org = ? AND r.token_id IS NULL"
            " ORDER BY t.created_at, t.token_id",
            (org,),
        )
        return [{k: row[k] for k in row.keys() if k != "revoked_at"} for row in rows]

    # ------------------------------------------------------------ chat-ops

    async def slack_orgs(self, team_id: str) -> list[str]:
        """The organizations whose Slack app names this team (usually one), by name."""
        rows = await self._all(
            "SELECT org FROM slack_apps WHERE team_id = ? ORDER BY org", (team_id,)
        )
        return [r["org"] for r in rows]

    async def slack_app(self, org: str) -> dict[str, Any] | None:
        row = await self._one(
            "SELECT team_id, bot_token, configured_at, configured_by FROM slack_apps WHERE org = ?",
            (org,),
        )
        return None if row is None else dict(row) | {"bot_token": bool(row["bot_token"])}

    async def slack_users(self, org: str) -> list[dict[str, Any]]:
        rows = await self._all(
            "SELECT slack_id, user, mapped_at, mapped_by FROM slack_users WHERE org = ?"
            " ORDER BY slack_id",
            (org,),
        )
        return [dict(r) for r in rows]

    # ------------------------------------------------------------ workspaces

    async def get_workspace(self, org: str, ws: str) -> dict[str, Any] | None:
        async with self._snapshot():
            row = await self._one(
                f"SELECT {_WS_COLS} FROM workspaces WHERE org = ? AND name = ?", (org, ws)
            )
            if row is None:
                return None
            queue = await self._all(
                "SELECT run_id FROM ws_queue WHERE org = ? AND workspace = ? ORDER BY position",
                (org, ws),
            )
        return _workspace(row, [q["run_id"] for q in queue])

    async def list_workspaces(self, org: str, *, deleted: bool = False) -> list[dict[str, Any]]:
        """Every workspace of the organization, by name, each with its queue; those
        deleted (not purged) only with `deleted`."""
        live = "" if deleted else " AND deleted_at IS NULL"
        async with self._snapshot():
            rows = await self._all(
                f"SELECT {_WS_COLS} FROM workspaces WHERE org = ?{live} ORDER BY name", (org,)
            )
            queued = await self._all(
                "SELECT workspace, run_id FROM ws_queue WHERE org = ? ORDER BY workspace, position",
                (org,),
            )
        queues: dict[str, list[str]] = {}
        for q in queued:
            queues.setdefault(q["workspace"], []).append(q["run_id"])
        return [_workspace(r, queues.get(r["name"], [])) for r in rows]

    async def open_runs(self, org: str, ws: str, limit: int = 5) -> list[str]:
        """Runs of the workspace that have not ended (speculative plans included), oldest
        first."""
        rows = await self._all(
            f"SELECT id FROM runs WHERE org = ? AND workspace = ? AND status NOT IN ({_ENDED}) "
            "ORDER BY created_at, id LIMIT ?",
            (org, ws, limit),
        )
        return [r["id"] for r in rows]

    # ------------------------------------------------------------ runs

    async def get_run(self, org: str, run_id: str, *, live: bool = False) -> dict[str, Any] | None:
        """The run, or None if it does not exist or belongs to another organization.

        With what it is pinned to: its snapshot, its commit's author and message; with
        `live`, also its `owner` and `deadline` as the board's fold has them
        (projections/liveness.py), read with the row.
        """
        async with self._snapshot():  # the pins from the same moment as the row
            row = await self._one(
                f"SELECT {_selected(live)} WHERE runs.id = ? AND runs.org = ?", (run_id, org)
            )
            if row is None:
                return None
            pins = await state_versions.run_pins(self._all, run_id)
        return _run(row) | pins | (liveness.of_row(row) if live else {})

    async def state_versions(self, org: str, ws: str) -> list[dict[str, Any]]:
        """The workspace's state versions, newest first."""
        return await state_versions.state_versions(self._all, org, ws)

    async def notifications(self, org: str, ws: str | None) -> list[dict[str, Any]]:
        """Notification configurations of the organization (`ws` None) or a workspace."""
        return await notifications.list_configs(self._all, org, ws)

    async def notification(self, org: str, config_id: str) -> dict[str, Any] | None:
        return await notifications.get_config(self._all, org, config_id)

    async def vcs_connections(self, org: str) -> list[dict[str, Any]]:
        return await vcs.list_connections(self._all, org)

    async def vcs_connection(self, org: str, connection_id: str) -> dict[str, Any] | None:
        return await vcs.get_connection(self._all, org, connection_id)

    async def vcs_bindings(
        self, org: str, connection_id: str, repo_keys: Sequence[str], **narrow: Any
    ) -> list[dict[str, Any]]:
        """The workspaces bound to the connection on one of these repositories that a
        change may concern (`projections.vcs.bindings`)."""
        return await vcs.bindings(self._all, org, connection_id, repo_keys, **narrow)

    async def notify_attempts(self, org: str, config_id: str) -> list[dict[str, Any]]:
        return await notifications.attempts(self._all, org, config_id)

    async def schedule_fires(self, org: str, ws: str, schedule_id: str) -> list[dict[str, Any]]:
        return await schedules.fires(self._all, org, ws, schedule_id)

    async def list_runs(
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

        `full`: each as `get_run` answers it (with `live`, as `get_run(live=True)` does);
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
        async with self._snapshot():  # the pins from the same moment as the rows
            found = await self._all(sql, [*params, max(0, min(limit, _MAX_LIMIT))])
            rows = [_run(r) for r in found]
            if not full:
                return rows
            pins = await state_versions.runs_pins(self._all, [r["id"] for r in rows])
        lives = [liveness.of_row(f) if live else {} for f in found]
        return [r | pins[r["id"]] | v for r, v in zip(rows, lives, strict=True)]

    async def run_events(self, org: str, run_id: str) -> list[dict[str, Any]]:
        """The run's own events in stream order; `data` is the payload without the envelope."""
        rows = await self._all(
            "SELECT seq, type, at, actor, data_json FROM events "
            "WHERE run_id = ? AND org = ? ORDER BY seq",
            (run_id, org),
        )
        return [_event(r) for r in rows]

    async def run_steps(self, org: str, run_id: str) -> list[dict[str, Any]]:
        """The run's steps in the order they started."""
        rows = await self._all(
            "SELECT s.phase, s.step, s.status, s.started_at, s.ended_at, s.duration_ms, "
            "s.error, s.log_object, s.metrics_json FROM steps s JOIN runs r ON r.id = s.run_id "
            "WHERE s.run_id = ? AND r.org = ? ORDER BY s.started_seq, s.phase, s.step",
            (run_id, org),
        )
        return [_step(r) for r in rows]

    async def run_changes(self, org: str, run_id: str) -> dict[str, Any] | None:
        """The run's plan changes grouped for review; None if the org has no such run."""
        async with self._snapshot():
            return await changes.run_changes(self._all, org, run_id)

    async def run_resources(self, org: str, run_id: str) -> list[dict[str, Any]]:
        """The apply's resources, each with its state and its stages in order."""
        async with self._snapshot():
            return await changes.run_resources(self._all, org, run_id)

    # ------------------------------------------------------------ whole model

    # ------------------------------------------------------------ the web UI's pages

    async def active_runs(self, org: str, limit: int) -> tuple[list[dict[str, Any]], int, int]:
        """The organization's active runs (the bar of every UI page), those awaiting
        approval first, then oldest first (at most `limit`); how many are active, and how
        many of them await approval. One statement, so the counts and the rows agree."""
        rows = await self._all(
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

    async def latest_runs(self, org: str) -> dict[str, dict[str, Any]]:
        """Each workspace's newest run: its id and status (one index probe per workspace,
        in one statement)."""
        newest = (
            "SELECT (SELECT r.id FROM runs r WHERE r.org = w.org AND r.workspace = w.name "
            "ORDER BY r.created_at DESC, r.id DESC LIMIT 1) FROM workspaces w WHERE w.org = ?"
        )
        rows = await self._all(
            f"SELECT id, workspace, status FROM runs WHERE id IN ({newest})", (org,)
        )
        return {r["workspace"]: dict(r) for r in rows}

    async def workspace_summaries(self, org: str) -> list[dict[str, Any]]:
        """Every workspace of the organization by name: its folder, lock, active run and
        how many runs wait in its queue (what the organization page lists; nothing it
        skips is decoded, and no workspace is loaded from the event store)."""
        rows = await self._all(
            "SELECT w.name, w.folder, w.active_run, w.lock_json, "
            "(SELECT count(*) FROM ws_queue q WHERE q.org = w.org AND q.workspace = w.name) "
            "AS waiting FROM workspaces w WHERE w.org = ? AND w.deleted_at IS NULL "
            "ORDER BY w.name",
            (org,),
        )
        return [
            {
                "name": r["name"],
                "folder": r["folder"] or "",
                "active_run": r["active_run"],
                "waiting": r["waiting"],
                "lock": msgspec.json.decode(r["lock_json"]) if r["lock_json"] else None,
            }
            for r in rows
        ]

    async def dump(self) -> dict[str, list[tuple[Any, ...]]]:
        """Every table's rows sorted by primary key: two equal dumps are equal read models."""
        async with self._snapshot():
            return {t.name: [tuple(r) for r in await self._all(t.select_sorted)] for t in TABLES}


def _workspace(row: aiosqlite.Row, queue: list[str]) -> dict[str, Any]:
    out = dict(row)
    out["variables"] = msgspec.json.decode(out.pop("variables_json") or "{}")
    out["managed_state"] = bool(out["managed_state"])
    lock = out.pop("lock_json")
    out["lock"] = msgspec.json.decode(lock) if lock else None
    out["queue"] = queue
    out["vcs_connection"] = out["vcs_connection"] or ""
    out.update(msgspec.json.decode(out.pop("triggers_json") or "{}"))
    return out


def _summary(row: aiosqlite.Row, prefix: str) -> dict[str, int] | None:
    if row[f"{prefix}_add"] is None:
        return None
    return {k: row[f"{prefix}_{k}"] for k in ("add", "change", "destroy")}


def _selected(live: bool) -> str:
    """What a run is read from: its row, and with `live` its board entries joined."""
    if live:
        return f"{_cols('runs')}, {liveness.COLUMNS} FROM runs {liveness.JOIN}"
    return f"{_RUN_COLS} FROM runs"


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
