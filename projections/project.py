"""Folds: one decoded event, with its place in the stream, into rows of the read model.

No I/O here. Every `project_*` reads and writes rows of a `Working` set: the shell
(`projections/batch.py`) prefetches the rows a batch touches, runs the folds and `finish`,
and writes the changed rows back with the checkpoint in one transaction. Folding into
rows rather than issuing SQL per event keeps a batch to a handful of `executemany` calls
(a run's row is written once per batch, however many events it had), and keeps each fold
a plain function of (rows, event).

Run statuses come from the core's own `events.run.evolve`: each run row carries its
`RunState` (column `state_json`), so the read model can never disagree with the writers
about what an event means. Everything written derives from the event and its stream
metadata, never the clock, so a replay writes the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from functools import cache
from typing import Any, assert_never, get_args

import msgspec

from events import members as mb
from events import run as run_agg
from events import teams as tm
from events import workspace as ws_agg
from events.audit_stream import AuditDestinationEvent
from events.chat import ChatEvent
from events.codec import AnyEvent
from events.folder import FolderCreated, FolderSettingsSet, OrgSettingsSet
from events.groups import GroupSet
from events.notification import NotificationEvent
from events.org import OrgCreated, OrgEvent, TokenIssued, TokenRevoked, TokenUsed
from events.policies import PolicyDeleted, PolicySaved
from events.run import RunEvent, RunState, StepFinished, StepStarted, Workspace
from events.run_triggers import RunTriggerEvent
from events.schedule import ScheduleEvent
from events.sso import SsoEvent
from events.stack_run_events import StackRunEvent
from events.stacks import StackEvent
from events.templates import TemplateDeleted, TemplateSaved
from events.vcs import VcsEvent
from events.vcs_report import VcsReportEvent
from events.workspace import (
    ConfigChanged,
    RunAdmitted,
    RunEnqueued,
    RunReleased,
    SettingsSet,
    StatePushed,
    VariablesSet,
    WorkspaceCreated,
    WorkspaceDeleted,
    WorkspaceEvent,
    WorkspaceLocked,
    WorkspacePurged,
    WorkspaceUnlocked,
    changed,
)
from events.workspace_state import WorkspaceState
from projections.changes import project_changes
from projections.chat import project_chat
from projections.notifications import project_notification
from projections.schedules import project_schedule
from projections.schema import BY_NAME, Row
from projections.stacks import project_stack
from projections.state_versions import project_state_version
from projections.vcs import forget_binding, project_binding, project_vcs
from projections.working import Meta, RunView, Unprojectable, Working, iso, opt

_json = msgspec.json.Encoder(order="sorted")
# ---------------------------------------------------------------- folds


_ORG_EVENTS = get_args(OrgEvent)
_WS_EVENTS = get_args(WorkspaceEvent)


def project_event(w: Working, meta: Meta, event: AnyEvent, raw: bytes) -> None:
    """Record the event in the audit history, then fold it into its aggregate's rows."""
    w.audit.append(_event_row(meta, event, raw))
    FOLDS[type(event)](w, meta, event)


_AUDIT_COLUMNS = (
    "seq",
    "subject",
    "org",
    "workspace",
    "run_id",
    "type",
    "at",
    "actor",
    "data_json",
    "stored_at",
)
assert BY_NAME["events"].names == _AUDIT_COLUMNS, "_event_row builds rows in this order"


def _event_row(meta: Meta, event: AnyEvent, raw: bytes) -> tuple[Any, ...]:
    """The audit row, in the column order of `schema.EVENTS` (`_AUDIT_COLUMNS`)."""
    return (
        meta.seq,
        meta.subject,
        meta.org,
        meta.workspace,
        meta.run_id,
        _tag_of(type(event)),
        iso(event.at),
        event.actor,
        raw.decode(),  # the event exactly as stored, unknown fields included
        meta.stored_at,
    )


@cache
def _tag_of(cls: type) -> str:
    return str(cls.__struct_config__.tag)  # type: ignore[attr-defined]  # a tagged Struct


def project_org(w: Working, meta: Meta, event: OrgEvent) -> None:
    match event:
        case OrgCreated():
            w.insert(
                "orgs", {"name": event.name, "created_at": iso(event.at), "created_by": event.actor}
            )
        case TokenIssued():
            w.insert(
                "tokens",
                {
                    "token_hash": event.token_hash,
                    "token_id": event.token_id,
                    "org": meta.org,
                    "user": event.user,
                    "role": event.role,
                    "created_at": iso(event.at),
                    "created_by": event.actor,
                    "expires_at": iso(event.expires_at) if event.expires_at else None,
                },
            )
        case TokenRevoked():
            row = {"org": meta.org, "revoked_at": iso(event.at), "revoked_by": event.actor}
            w.insert("token_revocations", {"token_id": event.token_id, **row})
        case TokenUsed():
            w.insert("token_uses", {"token_id": event.token_id, "last_used_at": iso(event.at)})
        case (
            FolderCreated()
            | OrgSettingsSet()
            | FolderSettingsSet()
            | GroupSet()
            | TemplateSaved()
            | TemplateDeleted()
            | PolicySaved()
            | PolicyDeleted()
        ):
            pass  # read from the organization aggregate itself (services/surfaces/api/settings.py)
        case (
            mb.UserAdded()
            | mb.UserSuspended()
            | mb.UserReactivated()
            | mb.UserLinked()
            | tm.TeamSet()
            | tm.TeamDeleted()
            | tm.TeamMembersSet()
            | tm.UserTeamsSynced()
            | tm.AccessGranted()
            | tm.AccessRevoked()
        ):
            pass  # read from the organization aggregate too (events/access.py decides on it)
        case _:
            assert_never(event)


def project_workspace(w: Working, meta: Meta, event: WorkspaceEvent) -> None:
    """Workspace rows and the FIFO queue, as `events.workspace.evolve` keeps them."""
    if isinstance(event, WorkspaceCreated):
        w.put("workspaces", _workspace_row(event))
        project_binding(w, event.org, event.name, event.config)
        return
    key = (meta.org, meta.workspace)
    ws = w.get("workspaces", key)
    if ws is None:
        raise Unprojectable(f"workspace {meta.org}/{meta.workspace} was never created")
    match event:
        case RunEnqueued() | RunAdmitted() | RunReleased():
            project_queue(w, meta, ws, event)
        case VariablesSet():
            w.put("workspaces", ws | {"variables_json": _json.encode(event.variables).decode()})
        case WorkspaceLocked():
            lock = {"holder": event.actor, "reason": event.reason, "locked_at": iso(event.at)}
            w.put("workspaces", ws | {"lock_json": _json.encode(lock).decode()})
        case WorkspaceUnlocked():
            w.put("workspaces", ws | {"lock_json": None})
        case SettingsSet():
            pass  # read from the workspace aggregate itself (services/surfaces/api/settings.py)
        case ConfigChanged():
            cfg = changed(_config_of(ws), event.changes)
            w.put("workspaces", ws | _config_columns(cfg))
            project_binding(w, ws["org"], ws["name"], cfg)
        case WorkspaceDeleted():
            w.put("workspaces", ws | {"deleted_at": iso(event.at)})
            forget_binding(w, ws["org"], ws["name"])  # its webhooks start nothing more
        case WorkspacePurged():
            w.delete("workspaces", key)  # the name is free; the audit rows stay
            w.purge_runs(ws["org"], ws["name"])
        case StatePushed():
            project_state_version(w, meta, event)  # a row of its versions, as a run's
        case _:
            assert_never(event)


def _config_of(ws: Row) -> Workspace:
    """The configuration members a workspace row keeps (what `ConfigChanged` changes)."""
    fields = {"repository": ws["repository"], "branch": ws["branch"]}
    fields |= {"directory": ws["directory"], "vcs_connection": ws["vcs_connection"] or ""}
    fields |= msgspec.json.decode(ws["triggers_json"] or "{}")
    return msgspec.convert(fields, Workspace)


def _config_columns(cfg: Workspace) -> Row:
    """The columns of the members `ConfigChanged` may change."""
    where = {"repository": cfg.repository, "branch": cfg.branch, "directory": cfg.directory}
    return where | vcs_columns(cfg)


def _workspace_row(event: WorkspaceCreated) -> Row:
    cfg = event.config
    return {
        "org": event.org,
        "name": event.name,
        "repository": cfg.repository,
        "branch": cfg.branch,
        "directory": cfg.directory,
        "variables_json": _json.encode(cfg.variables).decode(),
        "created_at": iso(event.at),
        "created_by": event.actor,
        "active_run": None,
        "heartbeat_timeout": cfg.heartbeat_timeout,
        "dispatch_timeout": cfg.dispatch_timeout,
        "managed_state": int(cfg.managed_state),
        "lock_json": None,
        "folder": event.folder,
        **vcs_columns(cfg),
        "deleted_at": None,
    }


def project_queue(
    w: Working, meta: Meta, ws: Row, event: RunEnqueued | RunAdmitted | RunReleased
) -> None:
    """The queue and active run as the core's `events.workspace.evolve` moves them, on a
    state of just what the event can touch: its run's place in the queue (a row, at the
    stream sequence of its enqueue) and the active run. The run is queued before any
    event but its enqueue (the core enqueues a run once); a row gone already stays gone."""
    key = (meta.org, meta.workspace, event.run_id)
    queued = () if isinstance(event, RunEnqueued) else (event.run_id,)
    before = WorkspaceState(queue=queued, active=ws["active_run"] or "")
    after = ws_agg.evolve(before, event)
    if event.run_id in after.queue and event.run_id not in before.queue:
        row = {"org": meta.org, "workspace": meta.workspace, "run_id": event.run_id}
        w.put("ws_queue", row | {"position": meta.seq})
    elif event.run_id in before.queue and event.run_id not in after.queue:
        w.delete("ws_queue", key)
    if after.active != before.active:
        w.put("workspaces", ws | {"active_run": after.active or None})


def vcs_columns(cfg: Workspace) -> Row:
    """The workspace's VCS binding as the read model keeps it (projections/schema.py)."""
    triggers = {
        "trigger_paths": cfg.trigger_paths,
        "trigger_any_change": cfg.trigger_any_change,
        "trigger_tags": cfg.trigger_tags,
        "vcs_run_type": cfg.vcs_run_type,
    }
    return {"vcs_connection": cfg.vcs_connection, "triggers_json": _json.encode(triggers).decode()}


def project_run(w: Working, meta: Meta, event: RunEvent) -> None:
    """Fold with the core's `evolve`; the run's row is derived at the end of the batch."""
    run_id = meta.run_id
    if run_id is None:
        raise Unprojectable(f"run event on a non-run subject {meta.subject}")
    view = w.run(run_id)
    if isinstance(event, run_agg.RunCreated):
        if view is not None:
            raise Unprojectable(f"run {run_id} created twice")
        view = w.runs[run_id] = RunView(run_agg.INITIAL, event.message, None, meta.seq)
    elif view is None:
        raise Unprojectable(f"run {run_id} was never created")
    if isinstance(event, run_agg.RunRemoved):  # retention: the whole record goes
        w.remove_run(run_id)
        s = view.state
        tomb = {"id": run_id, "org": s.org, "workspace": s.workspace, "seq": meta.seq}
        w.put("removed_runs", tomb | {"removed_at": iso(event.at)})
        return
    before = view.state
    view.state = run_agg.evolve(before, event)
    view.last_seq, view.dirty = meta.seq, True
    if isinstance(event, run_agg.RunFailed):
        view.error_message = opt(event.message)
    project_steps(w, meta, before, view.state, event)
    project_changes(w, meta, before, view.state, event)
    project_state_version(w, meta, event)


def finish(w: Working) -> None:
    """Write the row of every run the batch folded, from its final state."""
    for view in w.runs.values():
        if view.dirty:
            w.put("runs", run_row(view))


def run_row(view: RunView) -> Row:
    s = view.state
    plan, applied = s.plan_summary, s.apply_summary
    return {
        "id": s.run_id,
        "org": s.org,
        "workspace": s.workspace,
        "type": s.run_type,
        "status": str(s.status),
        "created_by": s.created_by,
        "created_at": iso(s.created_at) if s.created_at else None,
        "updated_at": iso(s.updated_at) if s.updated_at else None,
        "message": view.message,
        "commit_sha": opt(s.commit),
        "has_changes": None if plan is None else int(s.has_changes),
        "plan_add": plan.add if plan else None,
        "plan_change": plan.change if plan else None,
        "plan_destroy": plan.destroy if plan else None,
        "apply_add": applied.add if applied else None,
        "apply_change": applied.change if applied else None,
        "apply_destroy": applied.destroy if applied else None,
        "plan_digest": opt(s.plan_digest),
        "approved_by": opt(s.approved_by),
        "acknowledged_json": _json.encode(s.acknowledged).decode(),
        "reason": opt(s.reason),
        "error_message": view.error_message,
        "phase": opt(s.phase or s.waiting_phase),  # the phase running, or waiting
        "lease_id": opt(s.lease_id),
        "executor_id": opt(s.executor_id),
        "last_seq": view.last_seq,
        "cause_json": _json.encode(s.cause).decode() if s.cause is not None else None,
        "state_json": _json.encode(s).decode(),
        "log_removed_at": iso(s.log_removed_at) if s.log_removed_at else None,
    }


def project_steps(
    w: Working, meta: Meta, before: RunState, after: RunState, event: RunEvent
) -> None:
    """Steps of the current phase; a run that ends leaves no step 'running'."""
    match event:
        case StepStarted():
            w.put("steps", _step_started(meta, before.phase, event))
        case StepFinished():
            prev = w.get("steps", (meta.run_id, before.phase, event.step))
            w.put("steps", _step_finished(meta, before.phase, event, prev))
        case _ if after.terminal and not before.terminal:
            _close_running_steps(w, meta.run_id, event, str(after.status), after.reason)


def _step_started(meta: Meta, phase: str, event: StepStarted) -> Row:
    return {
        "run_id": meta.run_id,
        "phase": phase,
        "step": event.step,
        "status": "running",
        "started_at": iso(event.at),
        "ended_at": None,
        "duration_ms": None,
        "error": None,
        "log_object": None,
        "started_seq": meta.seq,
        "metrics_json": None,
    }


def _step_finished(meta: Meta, phase: str, event: StepFinished, prev: Row | None) -> Row:
    # Prefer the control plane's own start time; the executor's is the fallback.
    started = prev["started_at"] if prev else iso(event.started_at)
    return {
        "run_id": meta.run_id,
        "phase": phase,
        "step": event.step,
        "status": "ok" if event.ok else "failed",
        "started_at": started,
        "ended_at": iso(event.at),
        "duration_ms": _ms_between(started, event.at),
        "error": opt(event.error),
        "log_object": opt(event.log_object),
        "started_seq": prev["started_seq"] if prev else meta.seq,
        "metrics_json": _step_metrics(event),
    }


def _step_metrics(event: StepFinished) -> str | None:
    """The step's metrics, and what its processes used where it was measured (events
    from before `cpu_seconds` and the rest have none: left out)."""
    used = {
        "cpu_seconds": event.cpu_seconds,
        "peak_memory_bytes": event.peak_memory_bytes,
        "wall_seconds": event.wall_seconds,
    }
    out = {**event.metrics, **{k: v for k, v in used.items() if v is not None}}
    return _json.encode(out).decode() if out else None


def _close_running_steps(
    w: Working, run_id: str | None, event: RunEvent, status: str, reason: str
) -> None:
    """A run failed under a step (executor gone, timeout): that step failed too."""
    for row in w.rows_of("steps", run_id):
        if row["status"] == "running":
            w.put(
                "steps",
                row
                | {
                    "status": "failed",
                    "ended_at": iso(event.at),
                    "duration_ms": _ms_between(row["started_at"], event.at),
                    "error": f"run {status}" + (f": {reason}" if reason else ""),
                },
            )


def _ms_between(started_iso: str, ended: datetime) -> int:
    delta = ended - datetime.fromisoformat(started_iso)
    return delta // timedelta(milliseconds=1)


def _audit_only(w: Working, meta: Meta, event: Any) -> None:
    """An event kept in the audit history (`project_event`) and folded into no table."""


# The fold of each event type, looked up by its exact type: every member of the codec's
# `AnyEvent` has one (tests/test_projection_fold.py), so a new event type is one line here.
FOLDS: dict[type, Callable[[Working, Meta, Any], None]] = {
    **{t: project_org for t in _ORG_EVENTS},
    **{t: project_workspace for t in _WS_EVENTS},
    **{t: project_run for t in get_args(RunEvent)},
    **{t: project_notification for t in get_args(NotificationEvent)},
    **{t: project_chat for t in get_args(ChatEvent)},
    **{t: project_vcs for t in get_args(VcsEvent)},
    # run triggers: the audit history only (the API reads the graph's own subject)
    **{t: _audit_only for t in get_args(RunTriggerEvent)},
    **{t: project_schedule for t in get_args(ScheduleEvent)},
    # single sign-on: the audit history only (the API reads the configuration's own subject)
    **{t: _audit_only for t in get_args(SsoEvent)},
    # a pull request's report: the audit history only (the reporter reads its own subject)
    **{t: _audit_only for t in get_args(VcsReportEvent)},
    # audit destinations: the audit history only (the streamer reads their own subjects)
    **{t: _audit_only for t in get_args(AuditDestinationEvent)},
    **{t: project_stack for t in get_args(StackEvent)},
    # stack runs: the audit history only (the API reads each run's own subject)
    **{t: _audit_only for t in get_args(StackRunEvent)},
}
