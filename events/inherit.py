"""Resolve effective settings along organization -> folders -> workspace. Pure.

Origins: "default", "org", "folder:<name>" (the innermost folder that sets a value wins)
and "workspace". A workspace's configuration fields `heartbeat_timeout` and
`dispatch_timeout`, when given a value other than their default at creation, count as
that workspace's own settings; its settings (PATCH .../settings) override them.
"""

from __future__ import annotations

from typing import Any

from events import settings
from events.folder import levels
from events.org import OrgState
from events.values import PINNED_TIMEOUTS, Workspace
from events.workspace import WorkspaceState

Resolved = dict[str, dict[str, Any]]


def config_settings(config: Workspace | None) -> dict[str, Any]:
    """The timeouts a workspace's configuration sets to other than their default."""
    if config is None:
        return {}
    own = {name: getattr(config, name) for name in PINNED_TIMEOUTS}
    return {k: v for k, v in own.items() if v != settings.SPECS[k].default}


def workspace_own(ws: WorkspaceState) -> dict[str, Any]:
    """The settings the workspace itself sets, its configuration's timeouts included."""
    return {**config_settings(ws.config), **ws.settings}


def for_org(org: OrgState) -> Resolved:
    return settings.effective([("org", org.settings)])


def for_folder(org: OrgState, folder: str) -> Resolved:
    return settings.effective(levels(org.settings, org.folders, folder))


def for_workspace(org: OrgState, ws: WorkspaceState) -> Resolved:
    """Every setting's effective value for the workspace, with its origin."""
    path = levels(org.settings, org.folders, ws.folder)
    return settings.effective([*path, ("workspace", workspace_own(ws))])
