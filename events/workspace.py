"""The workspace aggregate: its configuration and its FIFO run queue.

The queue lives here so that admission is one optimistic append on the workspace subject:
two schedulers racing to admit can never both win, and the order of `ws.run_enqueued`
events on the subject *is* the FIFO order.

A workspace's configuration changes by `ws.config_changed` (runs already created keep
the configuration they copied). It goes by `ws.deleted`, decided only while no run holds
it or waits in its queue; a run created as it was deleted finds its enqueue refused (the
same subject, an optimistic append: one of the two wins), and its creator cancels it.
A deleted workspace keeps its history and takes no command but `PurgeWorkspace`; its
name is free again only after `ws.purged`, which folds to a workspace never created (the
subject's events stay: the stream denies deletes).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, assert_never

import msgspec

from events.base import Command, Event
from events.errors import (
    AlreadyExists,
    Deleted,
    Forbidden,
    IllegalTransition,
    Invalid,
    NotFound,
)
from events.folder import checked
from events.run import Workspace
from events.settings import merge


class WorkspaceCreated(Event, frozen=True, kw_only=True, tag="ws.created"):
    org: str
    name: str
    config: Workspace
    folder: str = ""  # the folder it inherits settings from; "" for the organization


class RunEnqueued(Event, frozen=True, kw_only=True, tag="ws.run_enqueued"):
    run_id: str


class RunAdmitted(Event, frozen=True, kw_only=True, tag="ws.run_admitted"):
    run_id: str


class RunReleased(Event, frozen=True, kw_only=True, tag="ws.run_released"):
    """A run left the queue or gave the workspace back: it reached a terminal status."""

    run_id: str
    status: str


class VariablesSet(Event, frozen=True, kw_only=True, tag="ws.variables_set"):
    """The workspace's plain variables were replaced; runs already created keep theirs."""

    variables: dict[str, str]


class SettingsSet(Event, frozen=True, kw_only=True, tag="ws.settings_set"):
    """The workspace's own settings changed: a name to its new value, null where unset."""

    changes: dict[str, Any]


class WorkspaceLocked(Event, frozen=True, kw_only=True, tag="ws.locked"):
    """A person (the actor) locked the workspace: runs still queue, none is admitted."""

    reason: str


class WorkspaceUnlocked(Event, frozen=True, kw_only=True, tag="ws.unlocked"):
    """The lock was lifted by the actor: its holder, or an org admin breaking it."""

    holder: str = ""  # whose lock it was
    reason: str = ""  # the lock's reason, kept with the unlock for the history


class ConfigChanged(Event, frozen=True, kw_only=True, tag="ws.config_changed"):
    """Members of the workspace's configuration (`CONFIG_MEMBERS`) changed: each to its
    new value. Runs already created keep the configuration they copied."""

    changes: dict[str, Any]


class WorkspaceDeleted(Event, frozen=True, kw_only=True, tag="ws.deleted"):
    """The workspace is gone from lists and starts no run; its history stays."""


class WorkspacePurged(Event, frozen=True, kw_only=True, tag="ws.purged"):
    """A deleted workspace's name is free again: the state folds to one never created
    (services/surfaces/api/workspaces.py says what else a purge removes)."""


class StatePushed(Event, frozen=True, kw_only=True, tag="ws.state_pushed"):
    """The holder of the workspace's lock (the actor) replaced its state from outside a
    run: `terraform state push` (and `state rm` / `mv`, every state write of the CLI's
    backend) through the TFE API (services/surfaces/tfe/state_push.py). The version is sealed in
    `rp-state` as `object`; `previous` is the version it replaced ("" for none), `forced`
    whether the CLI said `-force` (another lineage, or a serial not above the current)."""

    serial: int
    lineage: str
    digest: str  # sha256 of the clear state
    object: str
    size: int
    previous: str = ""
    forced: bool = False
    cause: str = "cli"


WorkspaceEvent = (
    WorkspaceCreated
    | RunEnqueued
    | RunAdmitted
    | RunReleased
    | VariablesSet
    | SettingsSet
    | WorkspaceLocked
    | WorkspaceUnlocked
    | ConfigChanged
    | WorkspaceDeleted
    | WorkspacePurged
    | StatePushed
)


class CreateWorkspace(Command, frozen=True, kw_only=True):
    org: str
    name: str
    config: Workspace
    folder: str = ""


class EnqueueRun(Command, frozen=True, kw_only=True):
    run_id: str


class AdmitNext(Command, frozen=True, kw_only=True):
    pass


class ReleaseRun(Command, frozen=True, kw_only=True):
    run_id: str
    status: str


class SetVariables(Command, frozen=True, kw_only=True):
    variables: dict[str, str]


class SetSettings(Command, frozen=True, kw_only=True):
    changes: dict[str, Any]


class LockWorkspace(Command, frozen=True, kw_only=True):
    reason: str


class UnlockWorkspace(Command, frozen=True, kw_only=True):
    admin: bool = False  # an org admin may lift anyone's lock; others only their own


class ChangeConfig(Command, frozen=True, kw_only=True):
    changes: dict[str, Any]  # members of CONFIG_MEMBERS to their new values


class DeleteWorkspace(Command, frozen=True, kw_only=True):
    pass


class PurgeWorkspace(Command, frozen=True, kw_only=True):
    pass


class RecordStatePush(Command, frozen=True, kw_only=True):
    """Record a state version pushed by the actor, who must hold the workspace's lock
    while no run is active on it (the shell has sealed the version already)."""

    serial: int
    lineage: str
    digest: str
    object: str
    size: int
    previous: str = ""
    forced: bool = False
    cause: str = "cli"
    # When the lock the pusher read the head under was taken (None: not known): a push
    # that stalled past an unlock, a run and a new lock of the same holder would
    # otherwise be taken with a `previous` from before that run.
    lock_since: datetime | None = None


WorkspaceCommand = (
    ChangeConfig
    | DeleteWorkspace
    | PurgeWorkspace
    | CreateWorkspace
    | EnqueueRun
    | AdmitNext
    | ReleaseRun
    | SetVariables
    | SetSettings
    | LockWorkspace
    | UnlockWorkspace
    | RecordStatePush
)


class Lock(msgspec.Struct, frozen=True, kw_only=True):
    """Who holds a workspace's lock, why, and since when."""

    holder: str
    reason: str
    locked_at: datetime


class WorkspaceState(msgspec.Struct, frozen=True, kw_only=True):
    org: str = ""
    name: str = ""
    config: Workspace | None = None
    created_at: datetime | None = None
    queue: tuple[str, ...] = ()
    active: str = ""
    lock: Lock | None = None  # while set, no run is admitted
    folder: str = ""
    settings: dict[str, Any] = {}  # its own settings (events/inherit.py resolves them)
    version: int = 0
    deleted_at: datetime | None = None  # set once deleted: no command but a purge
    purges: int = 0  # how often the name was purged (each time it starts afresh)
    # The version the last `ws.state_pushed` of the lock held now put in place ("" none):
    # while the lock is held and no run active, only pushes move the state head, so a
    # push must continue from it (two pushes decided on one head cannot both land).
    pushed: str = ""

    @property
    def exists(self) -> bool:
        """Whether it was created (and not purged since): deleted ones exist too."""
        return self.config is not None

    @property
    def deleted(self) -> bool:
        return self.deleted_at is not None

    def holds(self, run_id: str) -> bool:
        """Whether the run is on this workspace: waiting in its queue, or active."""
        return run_id in self.queue or run_id == self.active


INITIAL = WorkspaceState()


def evolve(state: WorkspaceState, event: WorkspaceEvent) -> WorkspaceState:
    s = msgspec.structs.replace(state, version=state.version + 1)
    match event:
        case WorkspaceCreated():
            return msgspec.structs.replace(
                s,
                org=event.org,
                name=event.name,
                config=event.config,
                created_at=event.at,
                folder=event.folder,
            )
        case RunEnqueued():
            return msgspec.structs.replace(s, queue=(*s.queue, event.run_id))
        case RunAdmitted():
            queue = tuple(r for r in s.queue if r != event.run_id)
            return msgspec.structs.replace(s, queue=queue, active=event.run_id)
        case RunReleased():
            queue = tuple(r for r in s.queue if r != event.run_id)
            active = "" if s.active == event.run_id else s.active
            return msgspec.structs.replace(s, queue=queue, active=active)
        case VariablesSet():
            assert s.config is not None, "variables of a workspace that was never created"
            config = msgspec.structs.replace(s.config, variables=dict(event.variables))
            return msgspec.structs.replace(s, config=config)
        case SettingsSet():
            return msgspec.structs.replace(s, settings=merge(s.settings, event.changes))
        case WorkspaceLocked():
            lock = Lock(holder=event.actor, reason=event.reason, locked_at=event.at)
            return msgspec.structs.replace(s, lock=lock, pushed="")
        case WorkspaceUnlocked():
            return msgspec.structs.replace(s, lock=None, pushed="")
        case ConfigChanged():
            assert s.config is not None, "a change of a workspace that was never created"
            return msgspec.structs.replace(s, config=changed(s.config, event.changes))
        case WorkspaceDeleted():
            return msgspec.structs.replace(s, deleted_at=event.at)
        case WorkspacePurged():
            return WorkspaceState(version=s.version, purges=s.purges + 1)
        case StatePushed():
            return msgspec.structs.replace(s, pushed=event.object)
        case _:
            assert_never(event)


# What `ChangeConfig` may change; the rest is set otherwise (variables, settings) or
# only at creation.
CONFIG_MEMBERS = (
    "repository",
    "branch",
    "directory",
    "trigger_paths",
    "trigger_any_change",
    "trigger_tags",
    "vcs_run_type",
    "vcs_connection",
)
VCS_MEMBERS = CONFIG_MEMBERS[3:]  # what a VCS connection's webhooks go by
VCS_RUN_TYPES = ("plan", "apply")


def changed(config: Workspace, changes: dict[str, Any]) -> Workspace:
    """The configuration with `changes` applied, typed as a `Workspace` (members an
    older `Workspace` does not know are ignored, as decoding would)."""
    merged = msgspec.to_builtins(config) | changes
    return msgspec.convert(merged, Workspace)


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


def fold(events: Sequence[WorkspaceEvent], state: WorkspaceState = INITIAL) -> WorkspaceState:
    for e in events:
        state = evolve(state, e)
    return state


def decide(
    state: WorkspaceState,
    command: WorkspaceCommand,
    *,
    now: datetime,
    new_id: Callable[[], str],
) -> list[WorkspaceEvent]:
    """Decide the workspace events of a command. AdmitNext may decide nothing (a run is
    active, the queue is empty, or the workspace is locked)."""
    who = command.actor
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
            if not state.exists:
                raise NotFound("workspace does not exist")
            if not state.deleted:
                raise IllegalTransition(
                    f"workspace {state.name} is not deleted: delete it first", status="live"
                )
            return [WorkspacePurged(at=now, actor=who)]
        case CreateWorkspace():
            if state.exists:
                raise AlreadyExists(f"workspace {command.name} already exists")
            rule, why = repository_problem(command.config.repository)
            if rule:
                raise Invalid(f"{why} (rule: {rule})")
            return [
                WorkspaceCreated(
                    at=now,
                    actor=who,
                    org=command.org,
                    name=command.name,
                    config=command.config,
                    folder=command.folder,
                )
            ]
        case EnqueueRun():
            if not state.exists:
                raise NotFound("workspace does not exist")
            if state.holds(command.run_id):
                raise Invalid(f"run {command.run_id} is already queued")
            return [RunEnqueued(at=now, actor=who, run_id=command.run_id)]
        case AdmitNext():
            if state.deleted or state.active or not state.queue or state.lock is not None:
                return []
            return [RunAdmitted(at=now, actor=who, run_id=state.queue[0])]
        case ReleaseRun():
            if not state.holds(command.run_id):
                return []
            return [RunReleased(at=now, actor=who, run_id=command.run_id, status=command.status)]
        case SetVariables():
            if not state.exists:
                raise NotFound("workspace does not exist")
            return [VariablesSet(at=now, actor=who, variables=dict(command.variables))]
        case SetSettings():
            if not state.exists:
                raise NotFound("workspace does not exist")
            return [SettingsSet(at=now, actor=who, changes=checked(command.changes))]
        case LockWorkspace():
            return [_lock(state, command, now)]
        case UnlockWorkspace():
            return [_unlock(state, command, now)]
        case RecordStatePush():
            return [_state_pushed(state, command, now)]
        case _:
            assert_never(command)


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
