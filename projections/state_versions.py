"""State versions and what a run is pinned to: the fold and the queries.

- `state_versions` (`projections/schema.py`): one row per `run.state_version` event (a
  run wrote it) and per `ws.state_pushed` event (a user's CLI pushed it: `pushed_by`,
  no run), keyed by the event's stream sequence, so a workspace's versions list newest
  first;
- a run's pins are read from rows that exist already: its snapshot from the run's
  `RunState` (`runs.state_json`), its commit's author and message from its last
  `run.plan_finished` in the audit history.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiosqlite
import msgspec

from events import runsteps
from events.run import PlanFinished, RunState, StateVersionCreated
from events.workspace import StatePushed
from projections.working import Meta, Working, iso

Query = Callable[[str, Sequence[Any]], Awaitable[list[aiosqlite.Row]]]

_state = msgspec.json.Decoder(RunState)
_plan = msgspec.json.Decoder(PlanFinished)
_NO_STEPS: dict[str, Any] = {"template": None, "steps": [], "current_step": None}
_COLUMNS = (
    "serial, lineage, digest, object, size, run_id, created_at, recovered, pushed_by, forced, "
    "rollback_of, reason"
)


def project_state_version(w: Working, meta: Meta, event: object) -> None:
    """A `run.state_version` or `ws.state_pushed` event becomes a row of its workspace's
    versions."""
    own: dict[str, Any]
    if isinstance(event, StateVersionCreated):
        own = {"run_id": meta.run_id, "recovered": int(event.recovered), "pushed_by": None}
        own |= {"rollback_of": None, "reason": None}
    elif isinstance(event, StatePushed):
        own = {"run_id": None, "recovered": 0, "pushed_by": event.actor}
        own |= {"rollback_of": event.rollback_of or None, "reason": event.reason or None}
    else:
        return
    w.insert(
        "state_versions",
        {
            "org": meta.org,
            "workspace": meta.workspace,
            "seq": meta.seq,
            "serial": event.serial,
            "lineage": event.lineage,
            "digest": event.digest,
            "object": event.object,
            "size": event.size,
            "created_at": iso(event.at),
            "forced": int(isinstance(event, StatePushed) and event.forced),
            **own,
        },
    )


async def state_versions(query: Query, org: str, ws: str) -> list[dict[str, Any]]:
    """The workspace's state versions, newest first."""
    rows = await query(
        f"SELECT {_COLUMNS} FROM state_versions WHERE org = ? AND workspace = ? ORDER BY seq DESC",
        (org, ws),
    )
    return [
        {**dict(r), "recovered": bool(r["recovered"]), "forced": bool(r["forced"])} for r in rows
    ]


def pins_of_row(row: aiosqlite.Row) -> dict[str, Any]:
    """The run's snapshot (null before admission), whether it is a speculative plan, and
    its commit's author and message, from a row read with `PIN_COLUMNS`: what
    `runs_pins` answers for it."""
    state = _state.decode(row["pin_state_json"]) if row["pin_state_json"] else None
    plan = _plan.decode(row["pin_plan_json"]) if row["pin_plan_json"] else None
    used = [_step_usage(x) for x in _json_list(row["pin_usage_json"])]
    return _pins(state, plan) | {"usage": _usage(used)}


async def runs_pins(query: Query, run_ids: list[str]) -> dict[str, dict[str, Any]]:
    """`pins_of_row` of each run in two queries, whatever their number (a list's page)."""
    if not run_ids:
        return {}
    marks = ", ".join("?" * len(run_ids))
    runs = await query(  # the measured steps with the row: no round trip more per read
        f"SELECT id, state_json, {_MEASURED} AS usage_json FROM runs WHERE id IN ({marks})",
        run_ids,
    )
    plans = await query(  # in stream order: the last one of each run wins
        f"SELECT run_id, data_json FROM events WHERE run_id IN ({marks}) "
        "AND type = 'run.plan_finished' ORDER BY seq",
        run_ids,
    )
    states = {r["id"]: _state.decode(r["state_json"]) for r in runs if r["state_json"]}
    last_plans = {r["run_id"]: _plan.decode(r["data_json"]) for r in plans}
    used = {r["id"]: [_step_usage(x) for x in _json_list(r["usage_json"])] for r in runs}
    return {
        rid: _pins(states.get(rid), last_plans.get(rid)) | {"usage": _usage(used.get(rid, []))}
        for rid in run_ids
    }


_USAGE = ("cpu_seconds", "peak_memory_bytes", "wall_seconds")


# A run's measured steps in start order, as one JSON array (read with its row).
_MEASURED = (
    "(SELECT json_group_array(json(j)) FROM (SELECT json_object('phase', phase, 'step', "
    "step, 'metrics', json(metrics_json)) AS j FROM steps WHERE steps.run_id = runs.id "
    "AND metrics_json IS NOT NULL ORDER BY started_seq))"
)
_json_list = msgspec.json.Decoder(list[dict[str, Any]]).decode

# What a run's pins are read from, as columns of a statement on `runs` (`pins_of_row`):
# its state, its measured steps and its last `run.plan_finished`, so that one run's
# answer is one statement (one trip to the read model's thread, one implicit snapshot).
PIN_COLUMNS = (
    f"runs.state_json AS pin_state_json, {_MEASURED} AS pin_usage_json, "
    "(SELECT data_json FROM events WHERE events.run_id = runs.id "
    "AND events.type = 'run.plan_finished' ORDER BY seq DESC LIMIT 1) AS pin_plan_json"
)


def _step_usage(step: dict[str, Any]) -> dict[str, Any]:
    metrics = step["metrics"]
    return {"phase": step["phase"], "step": step["step"], **{k: metrics.get(k) for k in _USAGE}}


def _usage(steps: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What the run's steps used (executor/usage.py): CPU and wall seconds summed, the
    highest peak of memory, and each step's; None while no step measured any."""
    measured = [s for s in steps if s["wall_seconds"] is not None]
    if not measured:
        return None

    def known(key: str) -> list[Any]:
        return [s[key] for s in measured if s[key] is not None]

    cpu, peaks = known("cpu_seconds"), known("peak_memory_bytes")
    return {
        "cpu_seconds": round(sum(cpu), 3) if cpu else None,
        "peak_memory_bytes": max(peaks) if peaks else None,
        "wall_seconds": round(sum(s["wall_seconds"] for s in measured), 3),
        "steps": measured,
    }


def _pins(state: RunState | None, plan: PlanFinished | None) -> dict[str, Any]:
    snapshot = state.snapshot if state is not None else None
    return {
        "snapshot": msgspec.to_builtins(snapshot) if snapshot is not None else None,
        "speculative": state.speculative if state is not None else False,
        # Each policy set's result on the plan, and the soft failures an approval overrode.
        "policies": msgspec.to_builtins(state.policies) if state is not None else [],
        "overridden": list(state.overridden) if state is not None else [],
        # The template's steps, each with its status (events/runsteps.py).
        **(runsteps.view(state) if state is not None else _NO_STEPS),
        "commit_author": plan.commit_author or None if plan else None,
        "commit_message": plan.commit_message or None if plan else None,
    }
