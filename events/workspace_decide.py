"""The workspace aggregate's `decide`: which events a command produces (see
events/workspace.py). A deleted workspace takes no command but a purge (and the release
and admission that tidy its queue); each other command has its own rule below."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import datetime
from typing import assert_never

import msgspec

from events.errors import (
    AlreadyExists,
    Deleted,
    Forbidden,
    IllegalTransition,
    Invalid,
    NotFound,
)
from events.folder import checked
from events.workspace_commands import (
    AdmitNext,
    ChangeConfig,
    CreateWorkspace,
    DeleteWorkspace,
    EnqueueRun,
    LockWorkspace,
    PurgeWorkspace,
    RecordStatePush,
    ReleaseRun,
    SetSettings,
    SetVariables,
    UnlockWorkspace,
    WorkspaceCommand,
)
from events.workspace_events import (
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
)
from events.workspace_state import CONFIG_MEMBERS, VCS_RUN_TYPES, WorkspaceState, changed

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_REMOTE_HELPER = re.compile(r"[A-Za-z0-9][A-Za-z0-9+.-]*::")


def repository_problem(repository: str) -> tuple[str, str]:
    """`(rule, why)` if no deployment may take `repository`, else `("", "")`: control
    characters, a leading `-` (an option to git), or git's `transport::address` form,
    which runs a remote helper (`ext::` runs any command). Which sources a deployment
    allows is the shell's to check (services/app/repositories.py)."""
    if not repository or _CONTROL.search(repository) or repository.startswith("-"):
        return "malformed", f"repository {repository!r} is not a git URL or path"
    if _REMOTE_HELPER.match(repository):
        return "remote-helper", f"repository {repository!r} names a git remote helper"
    return "", ""


def decide(
    state: WorkspaceState,
    command: WorkspaceCommand,
    *,
    now: datetime,
    new_id: Callable[[], str],
) -> list[WorkspaceEvent]:
    """Decide the workspace events of a command. AdmitNext may decide nothing (a run is
    active, the queue is empty, or the workspace is locked)."""
    if state.deleted and not isinstance(command, PurgeWorkspace | ReleaseRun | AdmitNext):
        raise Deleted(
            f"workspace {state.name} was deleted at {state.deleted_at}: "
            "an organization admin's purge frees its name"
        )
    match command:
        case ChangeConfig():
            return _change(state, command, now)
        case DeleteWorkspace():
            return [_delete(state, command, now)]
        case PurgeWorkspace():
            return [_purge(state, command, now)]
        case CreateWorkspace():
            return [_create(state, command, now)]
        case EnqueueRun():
            return [_enqueue(state, command, now)]
        case AdmitNext():
            return _admit(state, command, now)
        case ReleaseRun():
            return _release(state, command, now)
        case SetVariables():
            return [_set_variables(state, command, now)]
        case SetSettings():
            return [_set_settings(state, command, now)]
        case LockWorkspace():
            return [_lock(state, command, now)]
        case UnlockWorkspace():
            return [_unlock(state, command, now)]
        case RecordStatePush():
            return [_state_pushed(state, command, now)]
        case _:
            assert_never(command)


def _purge(state: WorkspaceState, command: PurgeWorkspace, now: datetime) -> WorkspacePurged:
    if not state.exists:
        raise NotFound("workspace does not exist")
    if not state.deleted:
        raise IllegalTransition(
            f"workspace {state.name} is not deleted: delete it first", status="live"
        )
    return WorkspacePurged(at=now, actor=command.actor)


def _create(state: WorkspaceState, command: CreateWorkspace, now: datetime) -> WorkspaceCreated:
    if state.exists:
        raise AlreadyExists(f"workspace {command.name} already exists")
    rule, why = repository_problem(command.config.repository)
    if rule:
        raise Invalid(f"{why} (rule: {rule})")
    return WorkspaceCreated(
        at=now,
        actor=command.actor,
        org=command.org,
        name=command.name,
        config=command.config,
        folder=command.folder,
    )


def _enqueue(state: WorkspaceState, command: EnqueueRun, now: datetime) -> RunEnqueued:
    if not state.exists:
        raise NotFound("workspace does not exist")
    if state.holds(command.run_id):
        raise Invalid(f"run {command.run_id} is already queued")
    return RunEnqueued(at=now, actor=command.actor, run_id=command.run_id)


def _admit(state: WorkspaceState, command: AdmitNext, now: datetime) -> list[WorkspaceEvent]:
    """The queue's head, unless a run is active, the queue is empty or it is locked."""
    if state.deleted or state.active or not state.queue or state.lock is not None:
        return []
    return [RunAdmitted(at=now, actor=command.actor, run_id=state.queue[0])]


def _release(state: WorkspaceState, command: ReleaseRun, now: datetime) -> list[WorkspaceEvent]:
    """Nothing for a run the workspace does not hold (released already, or never)."""
    if not state.holds(command.run_id):
        return []
    return [RunReleased(at=now, actor=command.actor, run_id=command.run_id, status=command.status)]


def _set_variables(state: WorkspaceState, command: SetVariables, now: datetime) -> VariablesSet:
    if not state.exists:
        raise NotFound("workspace does not exist")
    return VariablesSet(at=now, actor=command.actor, variables=dict(command.variables))


def _set_settings(state: WorkspaceState, command: SetSettings, now: datetime) -> SettingsSet:
    if not state.exists:
        raise NotFound("workspace does not exist")
    return SettingsSet(at=now, actor=command.actor, changes=checked(command.changes))


def _lock(state: WorkspaceState, command: LockWorkspace, now: datetime) -> WorkspaceLocked:
    if not state.exists:
        raise NotFound("workspace does not exist")
    if not command.reason.strip():
        raise Invalid("a lock needs a reason")
    if state.lock is not None:
        raise IllegalTransition(
            f"workspace {state.name} is already locked by {state.lock.holder} "
            f"since {state.lock.locked_at.isoformat()}: {state.lock.reason}",
            status="locked",
        )
    return WorkspaceLocked(at=now, actor=command.actor, reason=command.reason)


def _unlock(state: WorkspaceState, command: UnlockWorkspace, now: datetime) -> WorkspaceUnlocked:
    if not state.exists:
        raise NotFound("workspace does not exist")
    lock = state.lock
    if lock is None:
        raise IllegalTransition(f"workspace {state.name} is not locked", status="unlocked")
    if command.actor != lock.holder and not command.admin:
        raise Forbidden(
            f"workspace {state.name} is locked by {lock.holder}: only they or an "
            "organization admin may unlock it"
        )
    return WorkspaceUnlocked(at=now, actor=command.actor, holder=lock.holder, reason=lock.reason)


def _state_pushed(state: WorkspaceState, command: RecordStatePush, now: datetime) -> StatePushed:
    """Only the lock's holder writes state, and never under a run: a run admitted since
    the pusher read the workspace (or a lock taken over by an admin) refuses the push."""
    if not state.exists:
        raise NotFound("workspace does not exist")
    lock = state.lock
    if lock is None or lock.holder != command.actor:
        raise IllegalTransition(
            f"workspace {state.name} is not locked by {command.actor}: "
            "lock the workspace before writing its state",
            status="unlocked" if lock is None else "locked",
        )
    if state.active:
        raise IllegalTransition(
            f"run {state.active} is active on workspace {state.name}", status="busy"
        )
    if command.lock_since is not None and command.lock_since != lock.locked_at:
        raise IllegalTransition(
            f"workspace {state.name} was locked again since its state was read: "
            "read it and push again",
            status="relocked",
        )
    if state.pushed and command.previous != state.pushed:
        raise IllegalTransition(
            f"the state of workspace {state.name} changed since it was read "
            f"(another push put {state.pushed} in place)",
            status="moved",
        )
    fields = msgspec.structs.asdict(command)
    del fields["lock_since"]  # the decision's, not the record's
    return StatePushed(at=now, **fields)


def _change(state: WorkspaceState, command: ChangeConfig, now: datetime) -> list[WorkspaceEvent]:
    """The members that differ from the configuration now; none: nothing to record."""
    if not state.exists or state.config is None:
        raise NotFound("workspace does not exist")
    unknown = sorted(set(command.changes) - set(CONFIG_MEMBERS))
    if unknown:
        raise Invalid(f"not a workspace member that can change: {', '.join(unknown)}")
    if "repository" in command.changes:
        rule, why = repository_problem(str(command.changes["repository"]))
        if rule:
            raise Invalid(f"{why} (rule: {rule})")
    run_type = command.changes.get("vcs_run_type", "apply")
    if run_type not in VCS_RUN_TYPES:
        raise Invalid(f"vcs_run_type must be plan or apply, got {run_type!r}")
    try:
        new = changed(state.config, command.changes)
    except msgspec.ValidationError as e:
        raise Invalid(f"invalid workspace configuration: {e}") from e
    old = msgspec.to_builtins(state.config)
    now_ = msgspec.to_builtins(new)
    diff = {k: now_[k] for k in command.changes if k in now_ and now_[k] != old.get(k)}
    if not diff:
        return []
    return [ConfigChanged(at=now, actor=command.actor, changes=diff)]


def _delete(state: WorkspaceState, command: DeleteWorkspace, now: datetime) -> WorkspaceDeleted:
    if not state.exists:
        raise NotFound("workspace does not exist")
    if state.active:
        raise IllegalTransition(
            f"workspace {state.name} has run {state.active} active: cancel it or let it end first",
            status="busy",
        )
    if state.queue:
        raise IllegalTransition(
            f"workspace {state.name} has run {state.queue[0]} queued "
            f"({len(state.queue)} waiting): cancel them first",
            status="busy",
        )
    return WorkspaceDeleted(at=now, actor=command.actor)
