"""Groups of users within an organization: the pieces the organization's `decide` and
`evolve` delegate to (events/org.py). Users are the `user` of the organization's tokens.

A group is written whole: `org.group_set` carries its name and every member, both when it
is created and when its members are replaced.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import datetime

from events.base import Command, Event
from events.errors import AlreadyExists, Invalid, NotFound
from events.users import MAX_USER as MAX_USER  # the API documents the bound with it
from events.users import check_user

MAX_MEMBERS = 1000
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


class GroupSet(Event, frozen=True, kw_only=True, tag="org.group_set"):
    """A group was created or its members replaced; `members` is the whole list."""

    name: str
    members: list[str]


class CreateGroup(Command, frozen=True, kw_only=True):
    name: str
    members: list[str] = []


class SetGroupMembers(Command, frozen=True, kw_only=True):
    name: str
    members: list[str]


def _members(members: Sequence[str]) -> list[str]:
    """The members, checked, each once, in the order given."""
    if len(members) > MAX_MEMBERS:
        raise Invalid(f"a group has at most {MAX_MEMBERS} members")
    return list(dict.fromkeys(check_user(m) for m in members))


def create(groups: Mapping[str, Sequence[str]], cmd: CreateGroup, now: datetime) -> GroupSet:
    """Decide a new group: a valid, unused name and valid members."""
    if not _NAME.fullmatch(cmd.name):
        raise Invalid("a group name is lowercase letters, digits and dashes (at most 63)")
    if cmd.name in groups:
        raise AlreadyExists(f"group {cmd.name} already exists")
    return GroupSet(at=now, actor=cmd.actor, name=cmd.name, members=_members(cmd.members))


def set_members(
    groups: Mapping[str, Sequence[str]], cmd: SetGroupMembers, now: datetime
) -> GroupSet:
    """Decide a group's new members (the whole list)."""
    if cmd.name not in groups:
        raise NotFound(f"group {cmd.name} does not exist")
    return GroupSet(at=now, actor=cmd.actor, name=cmd.name, members=_members(cmd.members))


def applied(groups: Mapping[str, tuple[str, ...]], event: GroupSet) -> dict[str, tuple[str, ...]]:
    return {**groups, event.name: tuple(event.members)}
