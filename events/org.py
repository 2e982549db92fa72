"""The organization aggregate: its existence, the tokens scoped to it, its folders, its
own settings and its groups of users (events/folder.py and events/groups.py hold those
pieces).

Tokens are stored as SHA-256 digests only; the clear token is shown once, to its creator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, assert_never

import msgspec

from events import folder as fo
from events import groups as gr
from events import policies as po
from events import settings as st
from events import templates as te
from events.base import Command, Event
from events.errors import AlreadyExists, Invalid, NotFound

ROLES = ("viewer", "operator", "approver", "admin")


class OrgCreated(Event, frozen=True, kw_only=True, tag="org.created"):
    name: str


class TokenIssued(Event, frozen=True, kw_only=True, tag="org.token_issued"):
    token_id: str
    token_hash: str
    user: str
    role: str


OrgEvent = (
    OrgCreated
    | TokenIssued
    | fo.FolderCreated
    | fo.OrgSettingsSet
    | fo.FolderSettingsSet
    | gr.GroupSet
    | te.TemplateSaved
    | te.TemplateDeleted
    | po.PolicySaved
    | po.PolicyDeleted
)


class CreateOrg(Command, frozen=True, kw_only=True):
    name: str


class IssueToken(Command, frozen=True, kw_only=True):
    token_id: str
    token_hash: str
    user: str
    role: str = "admin"


OrgCommand = (
    CreateOrg
    | IssueToken
    | fo.CreateFolder
    | fo.SetOrgSettings
    | fo.SetFolderSettings
    | gr.CreateGroup
    | gr.SetGroupMembers
    | te.SaveTemplate
    | te.DeleteTemplate
    | po.SavePolicy
    | po.DeletePolicy
)


class OrgState(msgspec.Struct, frozen=True, kw_only=True):
    name: str = ""
    created_at: datetime | None = None
    tokens: tuple[str, ...] = ()
    settings: dict[str, Any] = {}  # the organization's own, not the effective ones
    folders: dict[str, fo.Folder] = {}  # by name, in creation order
    groups: dict[str, tuple[str, ...]] = {}  # members by group name
    templates: dict[str, te.Template] = {}  # the organization's own, by name
    policies: dict[str, po.PolicySet] = {}  # by name, each with its scope
    version: int = 0

    @property
    def exists(self) -> bool:
        return bool(self.name)


INITIAL = OrgState()


def evolve(state: OrgState, event: OrgEvent) -> OrgState:
    s = msgspec.structs.replace(state, version=state.version + 1)
    match event:
        case OrgCreated():
            return msgspec.structs.replace(s, name=event.name, created_at=event.at)
        case TokenIssued():
            return msgspec.structs.replace(s, tokens=(*s.tokens, event.token_id))
        case fo.FolderCreated():
            return msgspec.structs.replace(s, folders=fo.added(s.folders, event))
        case fo.OrgSettingsSet():
            return msgspec.structs.replace(s, settings=st.merge(s.settings, event.changes))
        case fo.FolderSettingsSet():
            return msgspec.structs.replace(s, folders=fo.changed(s.folders, event))
        case gr.GroupSet():
            return msgspec.structs.replace(s, groups=gr.applied(s.groups, event))
        case te.TemplateSaved() | te.TemplateDeleted():
            return msgspec.structs.replace(s, templates=te.applied(s.templates, event))
        case po.PolicySaved() | po.PolicyDeleted():
            return msgspec.structs.replace(s, policies=po.applied(s.policies, event))
        case _:
            assert_never(event)


def fold(events: Sequence[OrgEvent], state: OrgState = INITIAL) -> OrgState:
    for e in events:
        state = evolve(state, e)
    return state


def decide(
    state: OrgState, command: OrgCommand, *, now: datetime, new_id: Callable[[], str]
) -> list[OrgEvent]:
    who = command.actor
    match command:
        case CreateOrg():
            if state.exists:
                raise AlreadyExists(f"organization {command.name} already exists")
            return [OrgCreated(at=now, actor=who, name=command.name)]
        case IssueToken():
            if not state.exists:
                raise NotFound("organization does not exist")
            if command.role not in ROLES:
                raise Invalid(f"unknown role {command.role!r}; one of {', '.join(ROLES)}")
            return [
                TokenIssued(
                    at=now,
                    actor=who,
                    token_id=command.token_id,
                    token_hash=command.token_hash,
                    user=command.user,
                    role=command.role,
                )
            ]
        case fo.CreateFolder() | fo.SetOrgSettings() | fo.SetFolderSettings():
            if not state.exists:
                raise NotFound("organization does not exist")
            return _decide_folders(state, command, now)
        case gr.CreateGroup():
            _exists(state)
            return [gr.create(state.groups, command, now)]
        case gr.SetGroupMembers():
            _exists(state)
            return [gr.set_members(state.groups, command, now)]
        case te.SaveTemplate():
            _exists(state)
            return list(te.save(state.templates, command, now))
        case te.DeleteTemplate():
            _exists(state)
            return list(te.delete(state.templates, command, now))
        case po.SavePolicy():
            _exists(state)
            return list(po.save(state.policies, command, state.folders, now))
        case po.DeletePolicy():
            _exists(state)
            return list(po.delete(state.policies, command, now))
        case _:
            assert_never(command)


def _exists(state: OrgState) -> None:
    if not state.exists:
        raise NotFound("organization does not exist")


def _decide_folders(
    state: OrgState,
    command: fo.CreateFolder | fo.SetOrgSettings | fo.SetFolderSettings,
    now: datetime,
) -> list[OrgEvent]:
    match command:
        case fo.CreateFolder():
            return [fo.create(state.folders, command, now)]
        case fo.SetOrgSettings():
            return list(fo.set_org(command, now))
        case fo.SetFolderSettings():
            return list(fo.set_folder(state.folders, command, now))
        case _:
            assert_never(command)
