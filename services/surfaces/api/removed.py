"""Reads of a run that is not in the read model: 410 `run-removed` when retention removed
its whole record (services/processes/retention.py, `removed_runs`), else 404."""

from __future__ import annotations

from events.run import RunState
from projections.working import iso
from services.surfaces.api.context import Api
from services.surfaces.api.problems import Problem, removed_text, run_removed


async def missing_run(api: Api, org: str, run_id: str) -> Problem:
    """The problem a read of run `run_id` of `org` answers when it has no row: 410 if
    retention removed it (of this organization only: another's is 404 as any other)."""
    at = await api.read.runs.removed_at(org, run_id)
    if at is not None:
        return run_removed(run_id, at)
    return Problem("not-found", f"run {run_id} not found")


def removed_detail(state: RunState) -> str:
    """The text of a removed run's 410 (`state.removed_at` set), for the TFE API too."""
    return removed_text(state.run_id, iso(state.removed_at) if state.removed_at else "")
