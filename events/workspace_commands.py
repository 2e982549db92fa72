"""The workspace aggregate's commands (see events/workspace.py for the aggregate)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from events.base import Command
from events.values import Workspace


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
    reason: str = ""  # a rollback's: why
    rollback_of: str = ""  # a rollback's: the version (object) it copies
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
