"""Who may approve or discard a run, and what an approval must acknowledge. Pure.

The run aggregate's `decide` applies this rule to every `ApproveRun` and `DiscardRun`,
whoever writes them (the API, a chat bot, a tool), on the settings the run recorded at
admission (its snapshot: `{"value", "origin"}` entries; a run without a snapshot gets the
defaults), the caller the shell resolved (user, role, the groups they belong to) and the
plan's destructive addresses the run keeps:

- `four_eyes`: the run's creator may not approve it (discarding one's own run is fine),
  nor may a team's token (no person), nor a member of the team whose token created it.
- `approvers` (user names, `group:<name>` and `team:<name>` entries): only they may
  approve or discard, whatever their level (the route still needs write on the
  workspace: events/access.py). With none set (the default), any caller with write on
  the workspace (a token of role operator or higher) may: the rule of the seed. Role
  approver adds nothing over operator then; it matters only as a name to hand out, and
  the `approvers` setting is how to narrow who approves.
- The admin token (`superuser`) passes the approvers rule, never four-eyes.
- `confirm_destructive`: the approval lists in `acknowledged` every address the plan
  deletes or replaces (refused with `Unacknowledged`, which names the missing ones).
- A command without a caller comes from the system itself (the reaper's approval
  timeout discards): it is held to four-eyes (by its actor) and confirm_destructive only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import msgspec

from events.errors import Forbidden, IllegalTransition
from events.org import ROLES
from events.settings import SPECS
from events.values import ResourceChange, Snapshot

Action = Literal["approve", "discard"]
# With no approvers set, any operator of the organization may approve (issue 4).
DEFAULT_ROLE = "operator"
DESTRUCTIVE = frozenset({"delete", "replace"})


class Caller(msgspec.Struct, frozen=True, kw_only=True):
    """Who asks: a token's user and role; `superuser` for the admin token; `groups`, the
    organization's groups the user is a member of, and `teams` theirs (resolved by the
    shell); `level`, their level on the run's workspace (events/access.py) when the shell
    resolved it, which then decides instead of the role."""

    user: str
    role: str = ""
    superuser: bool = False
    groups: list[str] = []
    teams: list[str] = []
    level: str = ""


class Unacknowledged(IllegalTransition):
    """confirm_destructive is on and the approval leaves addresses unacknowledged."""

    def __init__(self, missing: Sequence[str], *, status: str) -> None:
        super().__init__(
            "confirm_destructive is on: acknowledge every address the plan deletes "
            f"or replaces; missing: {', '.join(missing)}",
            status=status,
        )
        self.missing = list(missing)


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


def groups_of(user: str, groups: Mapping[str, Sequence[str]]) -> list[str]:
    """The names of the groups `user` is a member of, sorted."""
    return sorted(name for name, people in groups.items() if user in people)


def check(
    action: Action,
    caller: Caller,
    *,
    creator: str,
    snapshot: Snapshot | None,
    groups: Mapping[str, Sequence[str]] | None = None,
) -> None:
    """Raise Forbidden, saying why, unless `caller` may `action` the run. With `groups`
    (the organization's), the caller's own are resolved from them."""
    if groups is not None:
        caller = msgspec.structs.replace(caller, groups=groups_of(caller.user, groups))
    check_caller(action, caller, actor=caller.user, creator=creator, snapshot=snapshot)


def check_caller(
    action: Action, caller: Caller | None, *, actor: str, creator: str, snapshot: Snapshot | None
) -> None:
    """`check`, for a command's `actor` and its `caller` (None: the system itself)."""
    if action == "approve" and setting(snapshot, "four_eyes"):
        _four_eyes(caller, actor=actor, creator=creator)
    if caller is None or caller.superuser:
        return
    approvers: list[str] = list(setting(snapshot, "approvers"))
    if approvers:
        if not _listed(caller, approvers):
            listed = ", ".join(approvers)
            raise Forbidden(f"{caller.user} is not among the workspace's approvers ({listed})")
        return
    if caller.level:
        if caller.level not in ("write", "admin"):
            raise Forbidden(
                f"{caller.user} has {caller.level} on the workspace and may not {action}: "
                "with no approvers set it needs write or above"
            )
        return
    if _rank(caller.role) < _rank(DEFAULT_ROLE):
        raise Forbidden(
            f"role {caller.role} may not {action}: with no approvers set it needs "
            f"{DEFAULT_ROLE} or above"
        )


def _four_eyes(caller: Caller | None, *, actor: str, creator: str) -> None:
    """Another person approves: not the creator, and no team token (a team is no person:
    its member could create a run with their own token and approve it with the team's,
    or the other way round), nor a member of the team whose token created the run."""
    if actor == creator:
        raise Forbidden(f"four_eyes is on: {creator} created this run and may not approve it")
    if caller is None or caller.superuser:
        return
    if actor.startswith(TEAM):
        raise Forbidden(
            f"four_eyes is on: {actor} is a team's token, no person, and may not approve"
        )
    if creator.startswith(TEAM) and creator[len(TEAM) :] in caller.teams:
        raise Forbidden(f"four_eyes is on: {creator} created this run and {actor} is of that team")


TEAM = "team:"  # a team token's user (events/org.py)


def _listed(caller: Caller, approvers: Sequence[str]) -> bool:
    """Whether the approvers name the caller, directly or through a group or team."""
    return (
        caller.user in approvers
        or any(f"group:{g}" in approvers for g in caller.groups)
        or any(f"team:{t}" in approvers for t in caller.teams)
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
    return unacknowledged(snapshot, destructive(changes), acknowledged)


def unacknowledged(
    snapshot: Snapshot | None, addresses: Iterable[str], acknowledged: Iterable[str]
) -> list[str]:
    """With `confirm_destructive` on, the destructive `addresses` not acknowledged."""
    if not setting(snapshot, "confirm_destructive"):
        return []
    seen = set(acknowledged)
    return [a for a in addresses if a not in seen]
