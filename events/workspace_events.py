"""The workspace aggregate's events (see events/workspace.py for the aggregate)."""

from __future__ import annotations

from typing import Any

from events.base import Event
from events.values import Workspace


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
    whether the CLI said `-force` (another lineage, or a serial not above the current).

    A rollback (`POST .../state-versions/{id}/rollback`, services/surfaces/api/rollback.py)
    is a push of runplane's own: `cause` "rollback", `rollback_of` the earlier version's
    object it copies (with the next serial), `reason` the admin's why."""

    serial: int
    lineage: str
    digest: str  # sha256 of the clear state
    object: str
    size: int
    previous: str = ""
    forced: bool = False
    cause: str = "cli"
    reason: str = ""
    rollback_of: str = ""


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
