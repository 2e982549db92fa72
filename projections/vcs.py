"""VCS connections and the workspaces bound to them: the fold and the queries.

- `vcs_connections` (`projections/schema.py`): one row per connection, rewritten whole by
  each `org.vcs_connection_saved`, removed by `org.vcs_connection_deleted`; never a secret
  or a token (events carry only `has_secret` / `has_token`);
- `vcs_bindings`: one row per workspace that names a VCS connection, keyed by the
  connection and the repository's path (`events.vcs.repo_key`), so a webhook finds the
  workspaces of its repository with one indexed read, however many workspaces the
  deployment has. Written from the workspace's configuration (`project_binding`).
"""

from __future__ import annotations

import posixpath
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiosqlite
import msgspec

from events import vcs
from events.values import Workspace
from projections.working import Meta, Working, iso

Query = Callable[[str, Sequence[Any]], Awaitable[list[aiosqlite.Row]]]
_json = msgspec.json.Encoder()
_CONN_COLS = (
    "id, org, name, provider, api_url, has_secret, has_token, created_at, created_by, updated_at"
)
_BINDING_COLS = (
    "org, workspace, connection, repo_key, branch, directory, trigger_paths_json, "
    "trigger_any_change, trigger_tags_json, run_type"
)
MAX_BINDINGS = 10_000  # rows one webhook reads at most
MAX_PREFIXES = 500  # directories named in one query; beyond, every row is read and judged


def project_vcs(w: Working, meta: Meta, event: vcs.VcsEvent) -> None:
    match event:
        case vcs.ConnectionSaved():
            c = event.connection
            w.put(
                "vcs_connections",
                {
                    "id": c.id,
                    "org": c.org,
                    "name": c.name,
                    "provider": c.provider,
                    "api_url": c.api_url,
                    "has_secret": int(c.has_secret),
                    "has_token": int(c.has_token),
                    "created_at": iso(c.created_at),
                    "created_by": c.created_by,
                    "updated_at": iso(event.at),
                },
            )
        case vcs.ConnectionDeleted():
            w.delete("vcs_connections", (event.connection_id,))
        case vcs.DeliveryAccepted():
            w.put("vcs_deliveries", _delivery_row(meta, event))
        case vcs.PushClaimed():
            pass  # the audit history holds it; the webhook reads its own subject


def _delivery_row(meta: Meta, e: vcs.DeliveryAccepted) -> dict[str, Any]:
    record = {
        "repository": e.repository,
        "ref": e.ref,
        "commit": e.commit,
        "runs": e.runs,
        "stale": e.stale,
        "duplicate_of": e.duplicate_of,
    }
    return {
        "connection": e.connection_id,
        "seq": meta.seq,
        "org": meta.org,
        "delivery": e.delivery,
        "at": iso(e.at),
        "event": e.event,
        "ignored": e.ignored,
        "record_json": _json.encode(record).decode(),
    }


def project_binding(w: Working, org: str, workspace: str, cfg: Workspace) -> None:
    """The workspace's row in `vcs_bindings` as its configuration says (none if it names
    no connection). Whatever event changes a workspace's repository, branch, directory,
    triggers or connection calls this with the configuration after it."""
    if not cfg.vcs_connection:
        forget_binding(w, org, workspace)
        return
    w.put(
        "vcs_bindings",
        {
            "org": org,
            "workspace": workspace,
            "connection": cfg.vcs_connection,
            "repo_key": vcs.repo_key(cfg.repository),
            "branch": cfg.branch,
            "directory": cfg.directory,
            "dir_prefix": None
            if cfg.trigger_paths or cfg.trigger_any_change
            else dir_prefix(cfg.directory),
            "trigger_paths_json": _json.encode(cfg.trigger_paths).decode(),
            "trigger_any_change": int(cfg.trigger_any_change),
            "trigger_tags_json": _json.encode(cfg.trigger_tags).decode(),
            "run_type": cfg.vcs_run_type,
        },
    )


def forget_binding(w: Working, org: str, workspace: str) -> None:
    """The workspace starts no more runs from webhooks (it was deleted)."""
    w.delete("vcs_bindings", (org, workspace))


def _connection(row: aiosqlite.Row) -> dict[str, Any]:
    return {
        "id": row["id"],
        "name": row["name"],
        "provider": row["provider"],
        "api_url": row["api_url"],
        "has_secret": bool(row["has_secret"]),
        "has_token": bool(row["has_token"]),
        "created_at": row["created_at"],
        "created_by": row["created_by"],
        "updated_at": row["updated_at"],
    }


async def list_connections(q: Query, org: str) -> list[dict[str, Any]]:
    rows = await q(f"SELECT {_CONN_COLS} FROM vcs_connections WHERE org = ? ORDER BY id", (org,))
    return [_connection(r) for r in rows]


async def get_connection(q: Query, org: str, connection_id: str) -> dict[str, Any] | None:
    sql = f"SELECT {_CONN_COLS} FROM vcs_connections WHERE org = ? AND id = ?"
    rows = await q(sql, (org, connection_id))
    return _connection(rows[0]) if rows else None


def dir_prefix(directory: str) -> str:
    """A workspace directory as a path prefix: `./infra/` gives `infra`, `.` gives ""."""
    d = posixpath.normpath(directory or ".").strip("/")
    return "" if d == "." else d


def ancestors(files: Sequence[str]) -> set[str]:
    """Every directory that holds one of `files` (`a/b/c.tf`: `a`, `a/b`)."""
    out: set[str] = set()
    for f in files:
        parts = f.split("/")[:-1]
        out.update("/".join(parts[: i + 1]) for i in range(len(parts)))
    return out


async def bindings(
    q: Query,
    org: str,
    connection_id: str,
    repo_keys: Sequence[str],
    *,
    branch: str | None,
    files: Sequence[str] | None,
    tags: bool = False,
) -> list[dict[str, Any]]:
    """The workspaces of `org` bound to the connection on one of the repository keys that
    may concern a change: on `branch` (None: any), and, when `files` is given (a push
    whose file list is complete), only those whose directory holds a changed file or
    that judge by trigger paths or any change; with `tags`, only those with tag patterns.
    What is left is judged by `services.processes.vcs.matching`; this only keeps a push from
    reading every workspace of a busy repository."""
    keys = sorted({k for k in repo_keys if k})
    if not keys:
        return []
    where = [f"connection = ? AND repo_key IN ({', '.join('?' * len(keys))}) AND org = ?"]
    params: list[Any] = [connection_id, *keys, org]
    if branch is not None:
        where.append("branch = ?")
        params.append(branch)
    if tags:
        where.append("trigger_tags_json != '[]'")
    dirs = sorted(ancestors(files)) if files is not None else []
    if files is not None and len(dirs) <= MAX_PREFIXES:
        marks = ", ".join("?" * len(dirs))
        where.append(f"(dir_prefix IS NULL OR dir_prefix = '' OR dir_prefix IN ({marks}))")
        params += dirs
    sql = (
        f"SELECT {_BINDING_COLS} FROM vcs_bindings WHERE {' AND '.join(where)}"
        f" ORDER BY workspace LIMIT {MAX_BINDINGS}"
    )
    rows = await q(sql, params)
    return [
        {
            "workspace": r["workspace"],
            "branch": r["branch"],
            "directory": r["directory"],
            "trigger_paths": _list(r["trigger_paths_json"]),
            "trigger_any_change": bool(r["trigger_any_change"]),
            "trigger_tags": _list(r["trigger_tags_json"]),
            "run_type": r["run_type"],
        }
        for r in rows
    ]


def _list(raw: str) -> list[str]:
    return [] if raw == "[]" else msgspec.json.decode(raw, type=list[str])


MAX_DELIVERIES = 100  # listed at once


async def deliveries(
    q: Query, org: str, connection_id: str, *, before: int | None, limit: int
) -> list[dict[str, Any]]:
    """The connection's recorded deliveries, newest first (`before`: a `seq` of the
    previous page), each with what it started or why it started nothing."""
    where, params = "org = ? AND connection = ?", list[Any]([org, connection_id])
    if before is not None:
        where += " AND seq < ?"
        params.append(before)
    rows = await q(
        "SELECT seq, delivery, at, event, ignored, record_json FROM vcs_deliveries "
        f"WHERE {where} ORDER BY seq DESC LIMIT ?",
        [*params, max(1, min(limit, MAX_DELIVERIES))],
    )
    out = []
    for r in rows:
        record = msgspec.json.decode(r["record_json"])
        runs = [
            dict(zip(("workspace", "run_id"), x.split("/", 1), strict=True)) for x in record["runs"]
        ]
        out.append(
            {
                "seq": r["seq"],
                "delivery": r["delivery"],
                "at": r["at"],
                "event": r["event"],
                "ignored": r["ignored"],
                **record,
                "runs": runs,
            }
        )
    return out


def _run_of(recorded: str) -> dict[str, str]:
    workspace, _, run_id = recorded.partition("/")
    return {"workspace": workspace, "run_id": run_id}


async def repositories(q: Query, org: str, workspaces: Sequence[str]) -> dict[str, str]:
    """The repository each of the workspaces names (the one its runs check out)."""
    names = sorted(set(workspaces))
    if not names:
        return {}
    marks = ", ".join("?" * len(names))
    sql = f"SELECT name, repository FROM workspaces WHERE org = ? AND name IN ({marks})"
    return {r["name"]: r["repository"] or "" for r in await q(sql, [org, *names])}
