"""The change review and per-resource apply states: folds, prefetch and queries.

Rows (`projections/schema.py`):

- `changes`: one per resource of `run.plan_finished`'s `changes`, in plan order;
- `resource_states`: one per stage of each resource during the apply. When the run
  becomes `apply_queued` (approved, or planned without approval) every planned resource
  gets a `pending` stage 0 — no event says so, it follows from the plan. Each
  `run.resource_state` then moves the resource's last stage, or opens the next stage (the
  second half of a replacement). When the run ends, a stage still `pending` becomes
  `not_applied` and one still `applying` becomes `failed`: nobody will report it again.

A sensitive value reaches none of these rows: the executor masks them before the event.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import datetime
from typing import Any, NamedTuple

import aiosqlite
import msgspec

from events.codec import AnyEvent
from events.run import (
    ApplyFinished,
    PlanFinished,
    ResourceStateChanged,
    RunApproved,
    RunCanceled,
    RunEvent,
    RunFailed,
    RunState,
    Status,
)
from events.values import CHANGE_GROUPS, ResourceChange
from projections.schema import CHANGES, RESOURCE_STATES, Row, Table
from projections.working import Meta, Working, iso

_json = msgspec.json.Encoder(order="sorted")
_CHUNK = 400  # pairs per IN (VALUES ...) list, under SQLite's variable limit
_NO_PENDING = ("read",)  # a data source read at apply time is no change to wait for
_OPEN = ("applying", "done")  # a stage a report of the same action still moves


# ---------------------------------------------------------------- folds


def project_changes(
    w: Working, meta: Meta, before: RunState, after: RunState, event: RunEvent
) -> None:
    """Fold a run event into `changes` and `resource_states`."""
    run_id = meta.run_id
    assert run_id is not None, "project_run folds run subjects only"
    match event:
        case PlanFinished():
            for position, change in enumerate(event.changes):
                w.put("changes", _change_row(run_id, position, change))
        case ResourceStateChanged():
            w.put("resource_states", _stage_row(w, run_id, event))
        case _:
            pass
    if after.status == Status.APPLY_QUEUED and before.status != Status.APPLY_QUEUED:
        _all_pending(w, run_id, event.at)
    elif after.terminal and not before.terminal:
        _close_stages(w, run_id, event.at, after)


def _change_row(run_id: str, position: int, change: ResourceChange) -> Row:
    return {
        "run_id": run_id,
        "position": position,
        "address": change.address,
        "type": change.type,
        "module": change.module or None,
        "action": change.action,
        "attributes_json": _json.encode(change.attributes).decode(),
        "replace_paths_json": _json.encode(change.replace_paths).decode(),
    }


def _state_row(
    run_id: str, address: str, stage: int, action: str, state: str, error: str | None, at: str
) -> Row:
    return {
        "run_id": run_id,
        "address": address,
        "stage": stage,
        "action": action,
        "state": state,
        "error": error,
        "updated_at": at,
    }


def _all_pending(w: Working, run_id: str, at: datetime) -> None:
    for change in w.rows_of("changes", run_id):
        if change["action"] not in _NO_PENDING:
            w.put(
                "resource_states",
                _state_row(
                    run_id, change["address"], 0, change["action"], "pending", None, iso(at)
                ),
            )


def stages_of(w: Working, run_id: str, address: str) -> list[Row]:
    """The resource's stages known to the batch, in order."""
    rows: list[Row] = []
    while (row := w.get("resource_states", (run_id, address, len(rows)))) is not None:
        rows.append(row)
    return rows


def _stage_row(w: Working, run_id: str, event: ResourceStateChanged) -> Row:
    """The stage a report moves: the last one (pending, or the same action still open),
    else the next one."""
    stages = stages_of(w, run_id, event.address)
    last = stages[-1] if stages else None
    moves_last = last is not None and (
        last["state"] == "pending" or (last["action"] == event.action and last["state"] in _OPEN)
    )
    stage = len(stages) - 1 if moves_last else len(stages)
    error = event.error or None
    return _state_row(run_id, event.address, stage, event.action, event.state, error, iso(event.at))


def _close_stages(w: Working, run_id: str, at: datetime, run: RunState) -> None:
    """The run ended: nothing will move its resources again."""
    ended = f"the run ended ({run.status}{': ' + run.reason if run.reason else ''})"
    for row in w.rows_of("resource_states", run_id):
        if row["state"] == "pending":
            w.put("resource_states", row | {"state": "not_applied", "updated_at": iso(at)})
        elif row["state"] == "applying":
            error = f"{ended} before this change finished"
            w.put(
                "resource_states", row | {"state": "failed", "error": error, "updated_at": iso(at)}
            )


# ---------------------------------------------------------------- prefetch


class Wanted(NamedTuple):
    """Which rows of `changes` and `resource_states` a batch's folds may read."""

    plans: list[str]  # runs whose changes are read (they may become apply_queued)
    ends: list[str]  # runs all of whose stages are read (they may end)
    moved: list[tuple[str, str]]  # (run, address) whose stages are read, runs not in ends


def wanted(items: Iterable[tuple[Meta, AnyEvent | None, Any, Any]]) -> Wanted:
    """A run's changes where it may become apply_queued, all its stages where it may end,
    a resource's stages where it moved."""
    plans: set[str] = set()
    ends: set[str] = set()
    moved: set[tuple[str, str]] = set()
    for meta, event, *_ in items:
        if meta.run_id is None:
            continue
        if isinstance(event, RunApproved | PlanFinished):
            plans.add(meta.run_id)
        elif isinstance(event, RunFailed | RunCanceled | ApplyFinished):
            ends.add(meta.run_id)
        elif isinstance(event, ResourceStateChanged):
            moved.add((meta.run_id, event.address))
    return Wanted(sorted(plans), sorted(ends), sorted(p for p in moved if p[0] not in ends))


async def prefetch(
    db: aiosqlite.Connection, w: Working, items: Iterable[tuple[Meta, AnyEvent | None, Any, Any]]
) -> None:
    """Load the rows the batch's folds read (`wanted`)."""
    want = wanted(items)
    await _load_runs(db, w, CHANGES, want.plans)
    await _load_runs(db, w, RESOURCE_STATES, want.ends)
    await _load_resources(db, w, want.moved)


async def _load_runs(db: aiosqlite.Connection, w: Working, table: Table, runs: list[str]) -> None:
    for i in range(0, len(runs), _CHUNK):
        chunk = runs[i : i + _CHUNK]
        sql = f"{table.select} WHERE run_id IN ({', '.join('?' * len(chunk))})"
        await _load_rows(db, w, table, sql, chunk)


async def _load_resources(
    db: aiosqlite.Connection, w: Working, pairs: list[tuple[str, str]]
) -> None:
    for i in range(0, len(pairs), _CHUNK):
        chunk = pairs[i : i + _CHUNK]
        values = ", ".join("(?, ?)" for _ in chunk)
        sql = f"{RESOURCE_STATES.select} WHERE (run_id, address) IN (VALUES {values})"
        await _load_rows(db, w, RESOURCE_STATES, sql, [v for pair in chunk for v in pair])


async def _load_rows(
    db: aiosqlite.Connection, w: Working, table: Table, sql: str, params: list[Any]
) -> None:
    async with db.execute(sql, params) as cur:
        for row in await cur.fetchall():
            w.load(table.name, dict(zip(table.names, row, strict=True)))


# ---------------------------------------------------------------- queries

Query = Callable[[str, Sequence[Any]], Awaitable[list[aiosqlite.Row]]]


async def run_changes(query: Query, org: str, run_id: str) -> dict[str, Any] | None:
    """The plan's changes grouped for review (delete, replace, update, create), with
    counts; None if the organization has no such run."""
    if not await query("SELECT 1 FROM runs WHERE id = ? AND org = ?", (run_id, org)):
        return None
    rows = await query(
        "SELECT address, type, module, action, attributes_json, replace_paths_json "
        "FROM changes WHERE run_id = ? ORDER BY position",
        (run_id,),
    )
    return review([_change_item(r) for r in rows])


def _change_item(row: aiosqlite.Row) -> dict[str, Any]:
    return {
        "address": row["address"],
        "type": row["type"],
        "module": row["module"],
        "action": row["action"],
        "attributes": msgspec.json.decode(row["attributes_json"] or "[]"),
        "replace_paths": msgspec.json.decode(row["replace_paths_json"] or "[]"),
    }


def review(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Group change items in review order; the summary counts replacements apart."""
    groups = [
        {"action": action, "title": title, "items": [i for i in items if i["action"] == action]}
        for action, title in CHANGE_GROUPS
    ]
    summary = {g["action"]: len(g["items"]) for g in groups}
    parts = [f"{n} {action}" for action, n in summary.items() if n]
    return {
        "summary": summary,
        "summary_text": " · ".join(parts) or "no changes",
        "groups": [{**g, "count": len(g["items"])} for g in groups if g["items"]],
    }


async def run_resources(query: Query, org: str, run_id: str) -> list[dict[str, Any]]:
    """Each resource of the apply with its current state and its stages in order, in plan
    order (resources the plan did not list, such as data sources, last)."""
    planned = await query(
        "SELECT c.address, c.action FROM changes c JOIN runs r ON r.id = c.run_id "
        "WHERE c.run_id = ? AND r.org = ? ORDER BY c.position",
        (run_id, org),
    )
    stages = await query(
        "SELECT s.address, s.action, s.state, s.error FROM resource_states s "
        "JOIN runs r ON r.id = s.run_id WHERE s.run_id = ? AND r.org = ? "
        "ORDER BY s.address, s.stage",
        (run_id, org),
    )
    by_address: dict[str, list[aiosqlite.Row]] = {}
    for row in stages:
        by_address.setdefault(row["address"], []).append(row)
    actions = {r["address"]: r["action"] for r in planned}
    order = [a for a in actions if a in by_address] + sorted(set(by_address) - set(actions))
    return [_resource(a, actions.get(a), by_address[a]) for a in order]


def _resource(address: str, planned: str | None, stages: list[aiosqlite.Row]) -> dict[str, Any]:
    errors = [s["error"] for s in stages if s["error"]]
    return {
        "address": address,
        "action": planned or stages[0]["action"],
        "state": current_state(planned, [s["state"] for s in stages]),
        "error": errors[-1] if errors else None,
        "stages": [{"action": s["action"], "state": s["state"]} for s in stages],
    }


def current_state(planned: str | None, states: list[str]) -> str:
    """A resource's state from its stages': failed if one failed, else the last one's,
    except that a replacement with one stage done is still applying."""
    if "failed" in states:
        return "failed"
    if planned == "replace" and states == ["done"]:
        return "applying"
    return states[-1]
