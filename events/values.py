"""Value types carried inside run events: workspace snapshot, plan changes, resource states."""

from __future__ import annotations

from typing import Any

import msgspec

from events.policies import PolicySet

SENSITIVE = "(sensitive)"

# The order the change review lists groups in, and each group's heading.
CHANGE_GROUPS = (
    ("delete", "will be deleted"),
    ("replace", "will be replaced"),
    ("update", "will be updated"),
    ("create", "will be created"),
)
RESOURCE_STATES = ("pending", "applying", "done", "failed", "not_applied")


class Workspace(msgspec.Struct, frozen=True, kw_only=True):
    """What the run needs to know of its workspace, snapshotted at creation.

    `secret_variables` holds names only: secret values never enter an event.
    """

    repository: str
    branch: str = "main"
    directory: str = "."
    variables: dict[str, str] = {}
    secret_variables: list[str] = []
    heartbeat_timeout: int = 600
    dispatch_timeout: int = 0
    managed_state: bool = True


class PlanSummary(msgspec.Struct, frozen=True, kw_only=True):
    add: int = 0
    change: int = 0
    destroy: int = 0


class AttributeChange(msgspec.Struct, frozen=True, kw_only=True):
    """One attribute that changes; sensitive values are the string "(sensitive)"."""

    name: str
    before: Any = None
    after: Any = None
    forces_replacement: bool = False


class ResourceChange(msgspec.Struct, frozen=True, kw_only=True):
    """One resource in the plan, from `terraform show -json`'s resource_changes."""

    address: str
    type: str
    name: str = ""
    module: str = ""
    action: str  # create | update | delete | replace | read | no-op
    attributes: list[AttributeChange] = []
    replace_paths: list[str] = []


class VariableRef(msgspec.Struct, frozen=True, kw_only=True):
    """A variable's name and where its value came from; never the value of a secret."""

    name: str
    origin: str = "workspace"
    sensitive: bool = False


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    """What the run is pinned to before any executor sees it."""

    commit: str = ""
    variables: list[VariableRef] = []
    settings: dict[str, Any] = {}
    policies: list[PolicySet] = []  # the policy sets the plan is checked against


# Settings the run's executor and reaper read from its workspace configuration.
PINNED_TIMEOUTS = ("heartbeat_timeout", "dispatch_timeout")


def pinned_config(config: Workspace | None, snapshot: Snapshot | None) -> Workspace | None:
    """The configuration a run executes under: the timeouts its snapshot's effective
    settings resolved (`{"value", "origin"}` entries; older snapshots held bare values)."""
    if config is None or snapshot is None:
        return config
    found: dict[str, int] = {}
    for name in PINNED_TIMEOUTS:
        entry = snapshot.settings.get(name)
        value = entry.get("value") if isinstance(entry, dict) else entry
        if isinstance(value, int) and not isinstance(value, bool):
            found[name] = value
    return msgspec.structs.replace(config, **found) if found else config
