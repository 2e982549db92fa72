"""Resources rendered from a command's own result, in the read model's shape.

Used only when this replica's projection has not caught up with a write within the bound:
the write stands, so the client gets what the command decided rather than an error.
"""

from __future__ import annotations

from typing import Any

from events.org import OrgState
from events.run import RunState, Status
from events.workspace import WorkspaceState

Row = dict[str, Any]


def org(state: OrgState) -> Row:
    return {"name": state.name, "created_at": state.created_at}


def workspace(state: WorkspaceState, actor: str) -> Row:
    config = state.config
    return {
        "org": state.org,
        "name": state.name,
        "repository": config.repository if config else "",
        "branch": config.branch if config else "",
        "directory": config.directory if config else "",
        "variables": dict(config.variables) if config else {},
        "created_at": state.created_at,
        "created_by": actor,
        "active_run": state.active or None,
        "queue": list(state.queue),
    }


def run(state: RunState, seq: int) -> Row:
    failed = state.status == Status.FAILED
    return {
        "id": state.run_id,
        "org": state.org,
        "workspace": state.workspace,
        "type": state.run_type,
        "status": str(state.status),
        "created_by": state.created_by,
        "created_at": state.created_at,
        "updated_at": state.updated_at,
        "message": "" if failed else state.message,
        "commit": state.commit,
        "has_changes": state.has_changes,
        "plan_summary": state.plan_summary,
        "apply_summary": state.apply_summary,
        "plan_digest": state.plan_digest,
        "approved_by": state.approved_by,
        "acknowledged": list(state.acknowledged),
        "reason": state.reason,
        "error_message": state.message if failed else "",
        "phase": state.phase,
        "executor_id": state.executor_id,
        "seq": seq,
    }
