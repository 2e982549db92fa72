"""Resources rendered from a command's own result, in the read model's shape.

Used only when this replica's projection has not caught up with a write within the bound:
the write stands, so the client gets what the command decided rather than an error. Like
the read model, "not set" is null and times are ISO 8601 UTC with a Z; a test holds the
two shapes equal.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import msgspec

from events import runsteps
from events.org import OrgState
from events.run import PlanSummary, RunState
from events.workspace import Lock, WorkspaceState

Row = dict[str, Any]


def _time(dt: datetime | None) -> str | None:
    if dt is None:
        return None
    return dt.astimezone(UTC).replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"


def _summary(summary: PlanSummary | None) -> Row | None:
    if summary is None:
        return None
    return {"add": summary.add, "change": summary.change, "destroy": summary.destroy}


def org(state: OrgState, actor: str) -> Row:
    return {"name": state.name, "created_at": _time(state.created_at), "created_by": actor}


def workspace(state: WorkspaceState, actor: str) -> Row:
    config = state.config
    assert config is not None, "a created workspace has its configuration"
    return {
        "org": state.org,
        "name": state.name,
        "repository": config.repository,
        "branch": config.branch,
        "directory": config.directory,
        "variables": dict(config.variables),
        "created_at": _time(state.created_at),
        "created_by": actor,
        "active_run": state.active or None,
        "heartbeat_timeout": config.heartbeat_timeout,
        "dispatch_timeout": config.dispatch_timeout,
        "managed_state": config.managed_state,
        "lock": _lock(state.lock),
        "queue": list(state.queue),
        "vcs_connection": config.vcs_connection,
        "trigger_paths": list(config.trigger_paths),
        "trigger_any_change": config.trigger_any_change,
        "trigger_tags": list(config.trigger_tags),
        "vcs_run_type": config.vcs_run_type,
        "deleted_at": _time(state.deleted_at),
    }


def _lock(lock: Lock | None) -> Row | None:
    if lock is None:
        return None
    return {"holder": lock.holder, "reason": lock.reason, "locked_at": _time(lock.locked_at)}


def run(state: RunState, seq: int) -> Row:
    planned = state.plan_summary is not None
    return {
        "id": state.run_id,
        "org": state.org,
        "workspace": state.workspace,
        "type": state.run_type,
        "status": str(state.status),
        "created_by": state.created_by,
        "created_at": _time(state.created_at),
        "updated_at": _time(state.updated_at),
        "message": state.message,
        "commit": state.commit or None,
        "has_changes": state.has_changes if planned else None,
        "plan_summary": _summary(state.plan_summary),
        "apply_summary": _summary(state.apply_summary),
        "plan_digest": state.plan_digest or None,
        "approved_by": state.approved_by or None,
        "acknowledged": list(state.acknowledged),
        "reason": state.reason or None,
        "error_message": state.error_message or None,
        "phase": state.phase or state.waiting_phase or None,  # running, or waiting
        "executor_id": state.executor_id or None,
        "seq": seq,
        "cause": msgspec.to_builtins(state.cause) if state.cause is not None else None,
        "log_removed_at": _time(state.log_removed_at),
        "snapshot": msgspec.to_builtins(state.snapshot) if state.snapshot else None,
        "speculative": state.speculative,
        "policies": msgspec.to_builtins(state.policies),
        "overridden": list(state.overridden),
        **runsteps.view(state),  # template, steps (each with its status), current_step
        # Known from the run's plan event only, which a command's result does not carry.
        "commit_author": None,
        "commit_message": None,
        # What its steps used: known from the steps' rows (projections/state_versions.py).
        "usage": None,
        # Known from the heartbeat board only (projections/liveness.py).
        "owner": None,
        "deadline": None,
    }
