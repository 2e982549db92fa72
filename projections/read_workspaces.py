"""The read model's queries of workspaces (`ReadModel.workspaces`): one with its queue,
an organization's, what its page lists, and a workspace's state versions and schedule
fires."""

from __future__ import annotations

from typing import Any

import aiosqlite
import msgspec

from projections import schedules, state_versions
from projections.reader import Reader

_WS_COLS = (
    "org, name, repository, branch, directory, variables_json, created_at, created_by, active_run"
    ", heartbeat_timeout, dispatch_timeout, managed_state, lock_json, vcs_connection, triggers_json"
    ", deleted_at"
)


class Workspaces:
    """Workspaces, each as a plain dict ready for JSON."""

    def __init__(self, read: Reader) -> None:
        self._read = read

    async def get(self, org: str, ws: str) -> dict[str, Any] | None:
        async with self._read.snapshot():
            row = await self._read.row(
                f"SELECT {_WS_COLS} FROM workspaces WHERE org = ? AND name = ?", (org, ws)
            )
            if row is None:
                return None
            queue = await self._read.rows(
                "SELECT run_id FROM ws_queue WHERE org = ? AND workspace = ? ORDER BY position",
                (org, ws),
            )
        return _workspace(row, [q["run_id"] for q in queue])

    async def folder_of(self, org: str, ws: str) -> str | None:
        """The workspace's folder ("" for none; the access check's question), or None."""
        row = await self._read.row(
            "SELECT folder FROM workspaces WHERE org = ? AND name = ?", (org, ws)
        )
        return None if row is None else str(row["folder"] or "")

    async def folders(self, org: str) -> dict[str, str]:
        """Every workspace's folder ("" for none), by name: what a list's access filter
        needs of them."""
        rows = await self._read.rows("SELECT name, folder FROM workspaces WHERE org = ?", (org,))
        return {str(r["name"]): str(r["folder"] or "") for r in rows}

    async def find(self, org: str, *, deleted: bool = False) -> list[dict[str, Any]]:
        """Every workspace of the organization, by name, each with its queue; those
        deleted (not purged) only with `deleted`."""
        live = "" if deleted else " AND deleted_at IS NULL"
        async with self._read.snapshot():
            rows = await self._read.rows(
                f"SELECT {_WS_COLS} FROM workspaces WHERE org = ?{live} ORDER BY name", (org,)
            )
            queued = await self._read.rows(
                "SELECT workspace, run_id FROM ws_queue WHERE org = ? ORDER BY workspace, position",
                (org,),
            )
        queues: dict[str, list[str]] = {}
        for q in queued:
            queues.setdefault(q["workspace"], []).append(q["run_id"])
        return [_workspace(r, queues.get(r["name"], [])) for r in rows]

    async def summaries(self, org: str) -> list[dict[str, Any]]:
        """Every workspace of the organization by name: its folder, lock, active run and
        how many runs wait in its queue (what the organization page lists; nothing it
        skips is decoded, and no workspace is loaded from the event store)."""
        rows = await self._read.rows(
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

    async def state_versions(self, org: str, ws: str) -> list[dict[str, Any]]:
        """The workspace's state versions, newest first."""
        return await state_versions.state_versions(self._read.rows, org, ws)

    async def schedule_fires(self, org: str, ws: str, schedule_id: str) -> list[dict[str, Any]]:
        return await schedules.fires(self._read.rows, org, ws, schedule_id)


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
