"""The workspace aggregate: its configuration and its FIFO run queue.

The queue lives here so that admission is one optimistic append on the workspace subject:
two schedulers racing to admit can never both win, and the order of `ws.run_enqueued`
events on the subject *is* the FIFO order.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, assert_never

import msgspec

from events.base import Command, Event
from events.errors import AlreadyExists, Forbidden, IllegalTransition, Invalid, NotFound
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


WorkspaceEvent = (
    WorkspaceCreated
    | RunEnqueued
    | RunAdmitted
    | RunReleased
    | VariablesSet
    | SettingsSet
    | WorkspaceLocked
    | WorkspaceUnlocked
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


WorkspaceCommand = (
    CreateWorkspace
    | EnqueueRun
    | AdmitNext
    | ReleaseRun
    | SetVariables
    | SetSettings
    | LockWorkspace
    | UnlockWorkspace
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

    @property
    def exists(self) -> bool:
        return self.config is not None

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
            return msgspec.structs.replace(s, lock=lock)
        case WorkspaceUnlocked():
            return msgspec.structs.replace(s, lock=None)
        case _:
            assert_never(event)


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_REMOTE_HELPER = re.compile(r"[A-Za-z0-9][A-Za-z0-9+.-]*::")


def repository_problem(repository: str) -> tuple[str, str]:
    """`(rule, why)` if no deployment may take `repository`, else `("", "")`: control
    characters, a leading `-` (an option to git), or git's `transport::address` form,
    which runs a remote helper (`ext::` runs any command). Which sources a deployment
    allows is the shell's to check (services/repositories.py)."""
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
    match command:
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
            if state.active or not state.queue or state.lock is not None:
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
