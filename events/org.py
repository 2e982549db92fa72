"""The organization aggregate: its existence, the tokens scoped to it, its folders, its
own settings and its groups of users (events/folder.py and events/groups.py hold those
pieces).

Tokens are stored as SHA-256 digests only; the clear token is shown once, to its creator.
A token may carry an expiry (checked by the api against its clock, never here) and is
revoked by an event. Its use is recorded by the api (`org.token_used`) at most once per
`USE_EVERY`, on a subject of its own (`uses_subject`), not the organization's: the
aggregate's history, read by every settings or policy decision, does not grow with use.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any, assert_never

import msgspec

from events import folder as fo
from events import groups as gr
from events import members as mb
from events import policies as po
from events import settings as st
from events import teams as tm
from events import templates as te
from events.base import Command, Event
from events.errors import AlreadyExists, Invalid, NotFound
from events.users import check_user

ROLES = ("viewer", "operator", "approver", "admin")
# How stale a token's "last used" may be: a replica records a use only when the last one it
# knows of (its own, or the read model's) is older than this. At most ~96 events a day for
# a token in constant use (a few more when replicas race), none for an idle one.
USE_EVERY = timedelta(minutes=15)


class OrgCreated(Event, frozen=True, kw_only=True, tag="org.created"):
    name: str


TOKEN_KINDS = ("", "user", "team")  # "": an organization token of a role (as before users)
MAX_TOKEN_NAME = 100  # characters of a token's name


class TokenIssued(Event, frozen=True, kw_only=True, tag="org.token_issued"):
    token_id: str
    token_hash: str
    user: str
    role: str
    expires_at: datetime | None = None  # None: never expires
    kind: str = ""  # TOKEN_KINDS; events of before users have none: an organization token
    owner: str = ""  # the user id of a personal token, the team of a team token
    level: str = ""  # a personal token's own ceiling ("": its user's access, whole)
    name: str = ""  # what its owner calls it ("": none given, events of before names)


class TokenOwner(msgspec.Struct, frozen=True, kw_only=True):
    """Whom a personal or team token belongs to (organization tokens have none)."""

    kind: str
    owner: str
    level: str = ""
    name: str = ""  # the token's name, shown to its owner (services/surfaces/ui/tokens.py)


class TokenRevoked(Event, frozen=True, kw_only=True, tag="org.token_revoked"):
    token_id: str


class TokenUsed(Event, frozen=True, kw_only=True, tag="org.token_used"):
    """The token authenticated a request at `at` (its `actor` is the token's user).
    Stored on `uses_subject`, never on the organization's own subject."""

    token_id: str


def uses_subject(org: str, token_id: str) -> str:
    """Where a token's uses are recorded: under `rp.org.>`, apart from the aggregate."""
    return f"rp.org.{org}.uses.{token_id}"


OrgEvent = (
    OrgCreated
    | TokenIssued
    | TokenRevoked
    | TokenUsed
    | fo.FolderCreated
    | fo.OrgSettingsSet
    | fo.FolderSettingsSet
    | gr.GroupSet
    | mb.UserAdded
    | mb.UserSuspended
    | mb.UserReactivated
    | mb.UserLinked
    | tm.TeamSet
    | tm.TeamDeleted
    | tm.TeamMembersSet
    | tm.UserTeamsSynced
    | tm.AccessGranted
    | tm.AccessRevoked
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
    user: str = ""  # an organization token's user; a personal token's is its user's email
    role: str = "admin"  # an organization token's; "" for personal and team tokens
    expires_at: datetime | None = None
    kind: str = ""
    owner: str = ""
    level: str = ""
    name: str = ""


class SignInUser(Command, frozen=True, kw_only=True):
    """A person signed in through single sign-on (services/app/identity.py)."""

    email: str
    name: str = ""
    groups: list[str] = []
    issuer: str
    subject: str
    rules: list[tuple[str, str]] = []  # single sign-on's (group, team) rules


class RevokeToken(Command, frozen=True, kw_only=True):
    token_id: str


OrgCommand = (
    CreateOrg
    | IssueToken
    | RevokeToken
    | fo.CreateFolder
    | fo.SetOrgSettings
    | fo.SetFolderSettings
    | gr.CreateGroup
    | gr.SetGroupMembers
    | mb.InviteUser
    | mb.SuspendUser
    | mb.ReactivateUser
    | SignInUser
    | tm.SetTeam
    | tm.DeleteTeam
    | tm.SetTeamMembers
    | tm.GrantAccess
    | tm.ForgetWorkspace
    | te.SaveTemplate
    | te.DeleteTemplate
    | po.SavePolicy
    | po.DeletePolicy
)


class OrgState(msgspec.Struct, frozen=True, kw_only=True):
    name: str = ""
    created_at: datetime | None = None
    tokens: tuple[str, ...] = ()  # ids of every token issued, in issue order
    revoked: frozenset[str] = frozenset()  # ids of the revoked ones
    settings: dict[str, Any] = {}  # the organization's own, not the effective ones
    folders: dict[str, fo.Folder] = {}  # by name, in creation order
    groups: dict[str, tuple[str, ...]] = {}  # members by group name
    members: dict[str, mb.Member] = {}  # the organization's users, by id
    teams: dict[str, tm.Team] = {}  # by name (owners only once an admin gave it members)
    owners: dict[str, TokenOwner] = {}  # personal and team tokens, by token id
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
            s = msgspec.structs.replace(s, tokens=(*s.tokens, event.token_id))
            if not event.kind:
                return s
            owner = TokenOwner(
                kind=event.kind, owner=event.owner, level=event.level, name=event.name
            )
            return msgspec.structs.replace(s, owners={**s.owners, event.token_id: owner})
        case TokenRevoked():
            return msgspec.structs.replace(s, revoked=s.revoked | {event.token_id})
        case TokenUsed():
            return s  # not on the organization's subject (uses_subject): nothing to fold
        case fo.FolderCreated():
            return msgspec.structs.replace(s, folders=fo.added(s.folders, event))
        case fo.OrgSettingsSet():
            return msgspec.structs.replace(s, settings=st.merge(s.settings, event.changes))
        case fo.FolderSettingsSet():
            return msgspec.structs.replace(s, folders=fo.changed(s.folders, event))
        case gr.GroupSet():
            return msgspec.structs.replace(s, groups=gr.applied(s.groups, event))
        case mb.UserAdded() | mb.UserSuspended() | mb.UserReactivated() | mb.UserLinked():
            return msgspec.structs.replace(s, members=mb.applied(s.members, event))
        case (
            tm.TeamSet()
            | tm.TeamDeleted()
            | tm.TeamMembersSet()
            | tm.UserTeamsSynced()
            | tm.AccessGranted()
            | tm.AccessRevoked()
        ):
            return msgspec.structs.replace(s, teams=tm.applied(s.teams, event))
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
        case IssueToken() | RevokeToken():
            _exists(state)
            return _decide_tokens(state, command, now)
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
        case (
            mb.InviteUser()
            | mb.SuspendUser()
            | mb.ReactivateUser()
            | SignInUser()
            | tm.SetTeam()
            | tm.DeleteTeam()
            | tm.SetTeamMembers()
            | tm.GrantAccess()
            | tm.ForgetWorkspace()
        ):
            _exists(state)
            return _decide_people(state, command, now)
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


def _decide_tokens(
    state: OrgState, command: IssueToken | RevokeToken, now: datetime
) -> list[OrgEvent]:
    match command:
        case IssueToken():
            return [_issue(state, command, now)]
        case RevokeToken():
            _known_token(state, command.token_id)
            if command.token_id in state.revoked:
                return []  # revoked already: a retried DELETE changes nothing
            return [TokenRevoked(at=now, actor=command.actor, token_id=command.token_id)]
        case _:
            assert_never(command)


def _issue(state: OrgState, command: IssueToken, now: datetime) -> TokenIssued:
    user, role = _token_user(state, command)
    if command.expires_at is not None and command.expires_at <= now:
        raise Invalid(f"expires_at {command.expires_at.isoformat()} is not in the future")
    if len(command.name) > MAX_TOKEN_NAME or not command.name.isprintable():
        raise Invalid(f"a token's name is at most {MAX_TOKEN_NAME} printable characters")
    return TokenIssued(
        at=now,
        actor=command.actor,
        token_id=command.token_id,
        token_hash=command.token_hash,
        user=user,
        role=role,
        expires_at=command.expires_at,
        kind=command.kind,
        owner=command.owner,
        level=command.level,
        name=command.name,
    )


def _token_user(state: OrgState, command: IssueToken) -> tuple[str, str]:
    """The user and role a token is issued as, by its kind: an organization token's
    own; a personal token's user, active; a team token's team, existing."""
    match command.kind:
        case "":
            if command.role not in ROLES:
                raise Invalid(f"unknown role {command.role!r}; one of {', '.join(ROLES)}")
            return check_user(command.user), command.role
        case "user":
            member = mb.known(state.members, command.owner)
            if not member.active:
                raise mb.Suspended(f"{member.email} is suspended in this organization")
            if command.level not in ("", *tm.LEVELS[1:]):
                raise Invalid(f"a token's level is one of {', '.join(tm.LEVELS[1:])}")
            return member.email, ""
        case "team":
            if command.owner not in tm.with_owners(state.teams) or command.level:
                raise NotFound(f"team {command.owner} not found")
            return f"team:{command.owner}", ""
        case _:
            raise Invalid(f"unknown token kind {command.kind!r}; user, team or none")


def _decide_people(state: OrgState, command: OrgCommand, now: datetime) -> list[OrgEvent]:
    """Users, teams and grants (events/members.py, events/teams.py)."""
    match command:
        case mb.InviteUser():
            return [mb.invite(state.members, command, now)]
        case mb.SuspendUser():
            suspended = list(mb.suspend(state.members, command, now))
            return [*suspended, *_revoke_personal(state, command, now)] if suspended else []
        case mb.ReactivateUser():
            return list(mb.reactivate(state.members, command, now))
        case SignInUser():
            return _sign_in(state, command, now)
        case tm.SetTeam():
            return [tm.set_team(state.teams, command, now)]
        case tm.DeleteTeam():
            return [tm.delete_team(state.teams, command, now), *_revoke_team(state, command, now)]
        case tm.SetTeamMembers():
            return [tm.set_members(state.teams, state.members, command, now)]
        case tm.GrantAccess():
            return list(tm.grant(state.teams, state.folders, command, now))
        case tm.ForgetWorkspace():
            return list(tm.forget(state.teams, command, now))
        case _:
            raise Invalid(f"not a people command: {type(command).__name__}")


def _revoke_team(state: OrgState, command: tm.DeleteTeam, now: datetime) -> list[OrgEvent]:
    """A deleted team's tokens go with it (a team made again later gets none of them)."""
    live = [
        t for t, o in state.owners.items()
        if o.kind == "team" and o.owner == command.name and t not in state.revoked
    ]  # fmt: skip
    return [TokenRevoked(at=now, actor=command.actor, token_id=t) for t in live]


def _revoke_personal(state: OrgState, command: mb.SuspendUser, now: datetime) -> list[OrgEvent]:
    """A suspension ends the user's personal tokens (those made by the API, the tokens
    page, single sign-on's sessions, `terraform login`, `runplane login --sso`): revoked,
    so a reactivation brings none back. Team and organization tokens the user made are
    their team's and organization's (as HCP Terraform's): they stay."""
    live = [
        t for t, o in state.owners.items()
        if o.kind == "user" and o.owner == command.user_id and t not in state.revoked
    ]  # fmt: skip
    return [TokenRevoked(at=now, actor=command.actor, token_id=t) for t in live]


def _sign_in(state: OrgState, command: SignInUser, now: datetime) -> list[OrgEvent]:
    """A single sign-on: the user (first time), their identity, their synced teams."""
    people = mb.signed_in(
        state.members, email=command.email, name=command.name, issuer=command.issuer,
        subject=command.subject, actor=command.actor, now=now,
    )  # fmt: skip
    user_id = mb.user_id_of(command.email)
    teams = tm.sync(
        state.teams, user_id, command.groups, actor=command.actor, now=now, rules=command.rules
    )
    return [*people, *teams]


def _known_token(state: OrgState, token_id: str) -> None:
    """Tokens of another organization, and the admin token, are not found here."""
    if token_id not in state.tokens:
        raise NotFound(f"token {token_id} not found")


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
