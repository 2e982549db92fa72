"""Folders and settings of an organization: the outer levels of inherited settings.

Folders live in the organization aggregate (subject `rp.org.<org>`), so one optimistic
append keeps folder names unique per organization. A folder's parent must exist before
it, which makes cycles impossible; nesting stops at MAX_DEPTH. The pieces here are pure
helpers the organization's `decide` and `evolve` delegate to (events/org.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

import msgspec

from events import settings
from events.base import Command, Event
from events.errors import AlreadyExists, Invalid, NotFound

MAX_DEPTH = 8


class Folder(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    parent: str = ""
    settings: dict[str, Any] = {}


class FolderCreated(Event, frozen=True, kw_only=True, tag="org.folder_created"):
    name: str
    parent: str = ""


class OrgSettingsSet(Event, frozen=True, kw_only=True, tag="org.settings_set"):
    """The organization's own settings changed: `changes` maps a name to its new value,
    or to null where the value was unset."""

    changes: dict[str, Any]


class FolderSettingsSet(Event, frozen=True, kw_only=True, tag="org.folder_settings_set"):
    """A folder's own settings changed; `changes` as in OrgSettingsSet."""

    folder: str
    changes: dict[str, Any]


class CreateFolder(Command, frozen=True, kw_only=True):
    name: str
    parent: str = ""


class SetOrgSettings(Command, frozen=True, kw_only=True):
    changes: dict[str, Any]


class SetFolderSettings(Command, frozen=True, kw_only=True):
    folder: str
    changes: dict[str, Any]


def path(folders: Mapping[str, Folder], name: str) -> list[str]:
    """The folders from the outermost down to `name` (empty for no folder)."""
    chain: list[str] = []
    while name and name not in chain:  # parents exist first, so no cycle; stay safe anyway
        chain.append(name)
        name = folders[name].parent if name in folders else ""
    return chain[::-1]


def create(folders: Mapping[str, Folder], cmd: CreateFolder, now: datetime) -> FolderCreated:
    """Decide a new folder: a unique name, an existing parent, nesting within MAX_DEPTH."""
    if cmd.name in folders:
        raise AlreadyExists(f"folder {cmd.name} already exists")
    if cmd.parent and cmd.parent not in folders:
        raise NotFound(f"parent folder {cmd.parent} does not exist")
    if len(path(folders, cmd.parent)) >= MAX_DEPTH:
        raise Invalid(f"folders nest at most {MAX_DEPTH} deep")
    return FolderCreated(at=now, actor=cmd.actor, name=cmd.name, parent=cmd.parent)


def set_folder(
    folders: Mapping[str, Folder], cmd: SetFolderSettings, now: datetime
) -> list[FolderSettingsSet]:
    if cmd.folder not in folders:
        raise NotFound(f"folder {cmd.folder} does not exist")
    changes = checked(cmd.changes)
    return [FolderSettingsSet(at=now, actor=cmd.actor, folder=cmd.folder, changes=changes)]


def set_org(cmd: SetOrgSettings, now: datetime) -> list[OrgSettingsSet]:
    return [OrgSettingsSet(at=now, actor=cmd.actor, changes=checked(cmd.changes, org=True))]


def checked(changes: Mapping[str, Any], *, org: bool = False) -> dict[str, Any]:
    """A valid, non-empty settings patch (every problem named), else Invalid."""
    if not changes:
        raise Invalid("give at least one setting to change")
    return settings.validate(changes, org=org)


def added(folders: Mapping[str, Folder], event: FolderCreated) -> dict[str, Folder]:
    return {**folders, event.name: Folder(name=event.name, parent=event.parent)}


def changed(folders: Mapping[str, Folder], event: FolderSettingsSet) -> dict[str, Folder]:
    old = folders[event.folder]
    new = msgspec.structs.replace(old, settings=settings.merge(old.settings, event.changes))
    return {**folders, event.folder: new}


def levels(
    org_settings: Mapping[str, Any], folders: Mapping[str, Folder], folder: str
) -> list[tuple[str, Mapping[str, Any]]]:
    """The levels above a workspace in `folder`, outermost first, each with its origin."""
    out: list[tuple[str, Mapping[str, Any]]] = [("org", org_settings)]
    out += [(f"folder:{name}", folders[name].settings) for name in path(folders, folder)]
    return out
