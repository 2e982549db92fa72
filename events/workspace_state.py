"""The workspace aggregate's state, and the members of its configuration that change
(see events/workspace.py)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec

from events.values import Workspace


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
