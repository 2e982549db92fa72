"""Notification configurations and their delivery attempts: the fold and the queries.

- `notifications` (`projections/schema.py`): one row per configuration, the whole row
  rewritten by each `org.notify_config_saved` (it carries the whole configuration), removed
  by `org.notify_config_deleted`; never a token (events carry only `has_token`);
- `notify_attempts`: one row per `org.notify_delivery_attempted`, keyed by its configuration
  and stream sequence, so a configuration's attempts list in the order they were made.

No fold reads a row back: nothing to prefetch.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiosqlite
import msgspec

from events import notification as nt
from projections.working import Meta, Working, iso

Query = Callable[[str, Sequence[Any]], Awaitable[list[aiosqlite.Row]]]
_json = msgspec.json.Encoder()
_CONFIG_COLS = (
    "id, org, workspace, name, destination, url, triggers_json, enabled, has_token, "
    "created_at, created_by, updated_at"
)
_ATTEMPT_COLS = (
    "delivery_id, attempt, trig, run_id, at, status_code, excerpt, error, outcome, next_retry_at"
)
MAX_ATTEMPTS = 1000


def project_notification(w: Working, meta: Meta, event: nt.NotificationEvent) -> None:
    match event:
        case nt.ConfigSaved():
            w.put("notifications", _config_row(event))
        case nt.ConfigDeleted():
            w.delete("notifications", (event.config_id,))
        case nt.DeliveryAttempted():
            w.insert("notify_attempts", _attempt_row(meta, event))
        case nt.DeliveryScheduled():
            pass  # its attempts are the rows; the body stays in the log


def _config_row(event: nt.ConfigSaved) -> dict[str, Any]:
    c = event.config
    return {
        "id": c.id,
        "org": c.org,
        "workspace": c.workspace or None,
        "name": c.name,
        "destination": c.destination,
        "url": c.url,
        "triggers_json": _json.encode(c.triggers).decode(),
        "enabled": int(c.enabled),
        "has_token": int(c.has_token),
        "created_at": iso(c.created_at),
        "created_by": c.created_by,
        "updated_at": iso(event.at),
    }


def _attempt_row(meta: Meta, e: nt.DeliveryAttempted) -> dict[str, Any]:
    return {
        "config_id": e.config_id,
        "seq": meta.seq,
        "org": meta.org,
        "delivery_id": e.delivery_id,
        "attempt": e.attempt,
        "trig": e.trigger,
        "run_id": e.run_id or None,
        "at": iso(e.at),
        "status_code": e.status_code or None,
        "excerpt": e.excerpt,
        "error": e.error or None,
        "outcome": e.outcome,
        "next_retry_at": iso(e.next_retry_at) if e.next_retry_at else None,
    }


def _config(row: aiosqlite.Row) -> dict[str, Any]:
    return {
        "id": row["id"],
        "name": row["name"],
        "destination": row["destination"],
        "url": row["url"],
        "triggers": msgspec.json.decode(row["triggers_json"]),
        "enabled": bool(row["enabled"]),
        "has_token": bool(row["has_token"]),
        "workspace": row["workspace"],
        "created_at": row["created_at"],
        "created_by": row["created_by"],
        "updated_at": row["updated_at"],
    }


async def list_configs(q: Query, org: str, ws: str | None) -> list[dict[str, Any]]:
    """The organization's own configurations (`ws` None), or one workspace's."""
    if ws is None:
        sql = f"SELECT {_CONFIG_COLS} FROM notifications WHERE org = ? AND workspace IS NULL"
        rows = await q(sql + " ORDER BY id", (org,))
    else:
        sql = f"SELECT {_CONFIG_COLS} FROM notifications WHERE org = ? AND workspace = ?"
        rows = await q(sql + " ORDER BY id", (org, ws))
    return [_config(r) for r in rows]


async def get_config(q: Query, org: str, config_id: str) -> dict[str, Any] | None:
    sql = f"SELECT {_CONFIG_COLS} FROM notifications WHERE org = ? AND id = ?"
    rows = await q(sql, (org, config_id))
    return _config(rows[0]) if rows else None


async def attempts(q: Query, org: str, config_id: str) -> list[dict[str, Any]]:
    """Every attempt of the configuration's deliveries, newest first (bounded)."""
    sql = (
        f"SELECT {_ATTEMPT_COLS} FROM notify_attempts WHERE config_id = ? AND org = ?"
        f" ORDER BY seq DESC LIMIT {MAX_ATTEMPTS}"
    )
    rows = await q(sql, (config_id, org))
    return [
        {
            "delivery_id": r["delivery_id"],
            "attempt": r["attempt"],
            "trigger": r["trig"],
            "run_id": r["run_id"],
            "at": r["at"],
            "response_code": r["status_code"],
            "response_excerpt": r["excerpt"],
            "error": r["error"],
            "outcome": r["outcome"],
            "next_retry_at": r["next_retry_at"],
        }
        for r in rows
    ]
