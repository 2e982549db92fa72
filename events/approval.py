"""Who may approve or discard a run, and what an approval must acknowledge. Pure.

The rule reads the settings the run recorded at admission (its snapshot: `{"value",
"origin"}` entries; a run without a snapshot gets the defaults) and the organization's
groups:

- `four_eyes`: the run's creator may not approve it (discarding one's own run is fine).
- `approvers` (user names and `group:<name>` entries): only they may approve or discard,
  whatever their role (the route still needs operator). With none set (the default),
  any token of the organization of role operator or higher (operator, approver, admin)
  may: the rule of the seed. Role approver adds nothing over operator then; it matters
  only as a name to hand out, and the `approvers` setting is how to narrow who approves.
- The admin token (`superuser`) passes the approvers rule, never four-eyes.
- `confirm_destructive`: the approval lists in `acknowledged` every address the plan
  deletes or replaces.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import msgspec

from events.errors import Forbidden
from events.org import ROLES
from events.settings import SPECS
from events.values import ResourceChange, Snapshot

Action = Literal["approve", "discard"]
# With no approvers set, any operator of the organization may approve (issue 4).
DEFAULT_ROLE = "operator"
DESTRUCTIVE = frozenset({"delete", "replace"})


class Caller(msgspec.Struct, frozen=True, kw_only=True):
    """Who asks: a token's user and role; `superuser` for the admin token."""

    user: str
    role: str
    superuser: bool = False


def setting(snapshot: Snapshot | None, name: str) -> Any:
    """The value of a setting the run recorded, else the setting's default."""
    entry = snapshot.settings.get(name) if snapshot is not None else None
    if isinstance(entry, dict):
        entry = entry.get("value")
    return SPECS[name].default if entry is None else entry


def members(approvers: Iterable[str], groups: Mapping[str, Sequence[str]]) -> set[str]:
    """Every user the approvers list names, directly or through a group."""
    people: set[str] = set()
    for entry in approvers:
        if entry.startswith("group:"):
            people.update(groups.get(entry[len("group:") :], ()))
        else:
            people.add(entry)
    return people


def check(
    action: Action,
    caller: Caller,
    *,
    creator: str,
    snapshot: Snapshot | None,
    groups: Mapping[str, Sequence[str]],
) -> None:
    """Raise Forbidden, saying why, unless `caller` may `action` the run."""
    if action == "approve" and setting(snapshot, "four_eyes") and caller.user == creator:
        raise Forbidden(f"four_eyes is on: {creator} created this run and may not approve it")
    if caller.superuser:
        return
    approvers: list[str] = list(setting(snapshot, "approvers"))
    if approvers:
        if caller.user not in members(approvers, groups):
            listed = ", ".join(approvers)
            raise Forbidden(f"{caller.user} is not among the workspace's approvers ({listed})")
        return
    if _rank(caller.role) < _rank(DEFAULT_ROLE):
        raise Forbidden(
            f"role {caller.role} may not {action}: with no approvers set it needs "
            f"{DEFAULT_ROLE} or above"
        )


def _rank(role: str) -> int:
    return ROLES.index(role) if role in ROLES else -1


def destructive(changes: Iterable[ResourceChange]) -> list[str]:
    """The addresses a plan deletes or replaces, in plan order."""
    return [c.address for c in changes if c.action in DESTRUCTIVE]


def missing(
    snapshot: Snapshot | None, changes: Iterable[ResourceChange], acknowledged: Iterable[str]
) -> list[str]:
    """With `confirm_destructive` on, the deletions and replacements not acknowledged."""
    if not setting(snapshot, "confirm_destructive"):
        return []
    seen = set(acknowledged)
    return [a for a in destructive(changes) if a not in seen]
