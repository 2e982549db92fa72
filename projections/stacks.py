"""Stacks as last defined: the fold and the queries (events/stacks.py).

`stacks` (projections/schema.py): one row per live stack, keyed by organization and name,
holding the whole definition the last event carried (each event carries all of it, so
the fold reads no row back); a deleted stack's row goes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiosqlite
import msgspec

from events import stacks as sk
from projections.working import Meta, Working, iso

Query = Callable[[str, Sequence[Any]], Awaitable[list[aiosqlite.Row]]]
_encode = msgspec.json.Encoder(order="sorted").encode
_decode = msgspec.json.Decoder(sk.Definition).decode


def project_stack(w: Working, meta: Meta, event: sk.StackEvent) -> None:
    match event:
        case sk.StackCreated() | sk.StackChanged():
            row = {
                "org": meta.org,
                "name": event.name,
                "definition_json": _encode(event.definition).decode(),
                "changed_at": iso(event.at),
                "changed_by": event.actor,
                "seq": meta.seq,
            }
            w.put("stacks", row)
        case sk.StackDeleted():
            w.delete("stacks", (meta.org, event.name))


def view(row: aiosqlite.Row | dict[str, Any]) -> dict[str, Any]:
    """A stack's row as the API shows it."""
    d = _decode(row["definition_json"])
    return {
        "name": row["name"],
        "workspaces": d.workspaces,
        "edges": [{"source": e.source, "target": e.target} for e in d.edges],
        "failure_policy": d.failure_policy,
        "levels": sk.levels(d),
        "changed_at": row["changed_at"],
        "changed_by": row["changed_by"],
    }


async def list_stacks(q: Query, org: str) -> list[dict[str, Any]]:
    """The organization's stacks, by name."""
    sql = "SELECT * FROM stacks WHERE org = ? ORDER BY name"
    return [view(r) for r in await q(sql, (org,))]


async def count_stacks(q: Query, org: str) -> int:
    """How many stacks the organization has."""
    rows = await q("SELECT COUNT(*) AS n FROM stacks WHERE org = ?", (org,))
    return int(rows[0]["n"]) if rows else 0
