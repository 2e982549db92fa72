"""Teams of an organization and the access granted to them: the pieces the organization's
`decide` and `evolve` delegate to (events/org.py). Pure; events/access.py decides with
what they hold.

A team has members (user ids, events/members.py) of two kinds: those an admin set
(`org.team_members_set`) and those single sign-on synced from the user's groups at their
last sign-in (`org.user_teams_synced`), each replaced whole, never mixed; its organization
rights (`RIGHTS`); the identity provider's groups that map to it (`idp_groups`); and its
grants: a level on the organization, a folder (inherited by everything inside, folders
nested) or a workspace. Every change of access is an event naming who did it (`actor`),
the team, the target and the level.

`owners` exists in every organization without being created: admin on everything, with
every right; it cannot be deleted, renamed or granted anything (it holds all already).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime

import msgspec

from events.base import Command, Event
from events.errors import AlreadyExists, Invalid, NotFound

LEVELS = ("none", "read", "plan", "write", "admin")  # each adds to the last (HCP's meaning)
RIGHTS = ("manage-workspaces", "manage-policies", "manage-vcs", "manage-teams", "read-audit")
OWNERS = "owners"
MAX_TEAMS = 200
MAX_MEMBERS = 5000
MAX_GRANTS = 2000  # per team
MAX_GROUPS = 50  # identity-provider groups mapped to a team
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
_KINDS = ("org", "folder", "workspace")


class Team(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    rights: tuple[str, ...] = ()
    idp_groups: tuple[str, ...] = ()
    members: tuple[str, ...] = ()  # set by an admin
    synced: tuple[str, ...] = ()  # set by single sign-on
    access: dict[str, str] = {}  # target key ("org", "folder:x", "workspace:y"): level

    def has(self, user_id: str) -> bool:
        return user_id in self.members or user_id in self.synced


OWNERS_TEAM = Team(name=OWNERS, rights=RIGHTS, access={"org": "admin"})


class TeamSet(Event, frozen=True, kw_only=True, tag="org.team_set"):
    """A team was created or its rights and mapped groups replaced (both whole)."""

    name: str
    rights: list[str] = []
    idp_groups: list[str] = []


class TeamDeleted(Event, frozen=True, kw_only=True, tag="org.team_deleted"):
    name: str


class TeamMembersSet(Event, frozen=True, kw_only=True, tag="org.team_members_set"):
    """The members an admin set, the whole list (user ids)."""

    name: str
    members: list[str]


class UserTeamsSynced(Event, frozen=True, kw_only=True, tag="org.user_teams_synced"):
    """Single sign-on set the teams the user is synced into, the whole list."""

    user_id: str
    teams: list[str]


class AccessGranted(Event, frozen=True, kw_only=True, tag="org.access_granted"):
    """`actor` granted `team` `level` on `target` ("org", "folder:<name>", "workspace:<name>")."""

    team: str
    target: str
    level: str


class AccessRevoked(Event, frozen=True, kw_only=True, tag="org.access_revoked"):
    """`team`'s grant on `target` ended: an admin took it back (`reason` ""), or the
    workspace it named was purged (`reason` "workspace purged": the name is free, and a
    workspace made again under it starts with no grant)."""

    team: str
    target: str
    reason: str = ""


PURGED = "workspace purged"


TeamEvent = TeamSet | TeamDeleted | TeamMembersSet | UserTeamsSynced | AccessGranted | AccessRevoked


class SetTeam(Command, frozen=True, kw_only=True):
    name: str
    rights: list[str] = []
    idp_groups: list[str] = []
    create: bool = True  # False: change an existing team


class DeleteTeam(Command, frozen=True, kw_only=True):
    name: str


class SetTeamMembers(Command, frozen=True, kw_only=True):
    name: str
    members: list[str]


class GrantAccess(Command, frozen=True, kw_only=True):
    team: str
    target: str
    level: str  # "none" revokes


class ForgetWorkspace(Command, frozen=True, kw_only=True):
    """The workspace's name is being freed (its purge): every grant naming it ends."""

    workspace: str


def target_key(kind: str, name: str = "") -> str:
    """The key of a grant's target: "org", "folder:<name>" or "workspace:<name>"."""
    if kind not in _KINDS:
        raise Invalid(f"a grant is on one of {', '.join(_KINDS)}")
    if kind == "org":
        return "org"
    if not _NAME.fullmatch(name):
        raise Invalid(f"{name!r} is no {kind} name")
    return f"{kind}:{name}"


def level_rank(level: str) -> int:
    if level not in LEVELS:
        raise Invalid(f"unknown level {level!r}; one of {', '.join(LEVELS)}")
    return LEVELS.index(level)


def with_owners(teams: Mapping[str, Team]) -> dict[str, Team]:
    """Every team, `owners` included (with whoever an admin made its members)."""
    owners = teams.get(OWNERS)
    members = owners.members if owners is not None else ()
    return {**teams, OWNERS: msgspec.structs.replace(OWNERS_TEAM, members=members)}


def teams_of(teams: Mapping[str, Team], user_id: str) -> list[str]:
    """The names of the teams the user is a member of (set or synced), sorted."""
    return sorted(t.name for t in with_owners(teams).values() if t.has(user_id))


def _check_team(teams: Mapping[str, Team], name: str) -> Team:
    if name == OWNERS:
        return with_owners(teams)[OWNERS]
    team = teams.get(name)
    if team is None:
        raise NotFound(f"team {name} not found")
    return team


def set_team(teams: Mapping[str, Team], cmd: SetTeam, now: datetime) -> TeamSet:
    if cmd.name == OWNERS:
        raise Invalid("owners holds every right already and cannot be changed")
    if not _NAME.fullmatch(cmd.name):
        raise Invalid("a team name is lowercase letters, digits and dashes (at most 63)")
    if cmd.create and cmd.name in teams:
        raise AlreadyExists(f"team {cmd.name} already exists")
    if not cmd.create:
        _check_team(teams, cmd.name)
    if cmd.create and len(teams) >= MAX_TEAMS:
        raise Invalid(f"an organization has at most {MAX_TEAMS} teams")
    unknown = [r for r in cmd.rights if r not in RIGHTS]
    if unknown:
        raise Invalid(f"unknown rights {unknown}; any of {', '.join(RIGHTS)}")
    groups = list(dict.fromkeys(cmd.idp_groups))
    if len(groups) > MAX_GROUPS or not all(_group_ok(g) for g in groups):
        raise Invalid(f"idp_groups: at most {MAX_GROUPS} printable names of 1 to 255 characters")
    rights = sorted(set(cmd.rights), key=RIGHTS.index)
    return TeamSet(at=now, actor=cmd.actor, name=cmd.name, rights=rights, idp_groups=groups)


def _group_ok(group: object) -> bool:
    return isinstance(group, str) and 0 < len(group) <= 255 and group.isprintable()


def delete_team(teams: Mapping[str, Team], cmd: DeleteTeam, now: datetime) -> TeamDeleted:
    if cmd.name == OWNERS:
        raise Invalid("owners cannot be deleted")
    _check_team(teams, cmd.name)
    return TeamDeleted(at=now, actor=cmd.actor, name=cmd.name)


def set_members(
    teams: Mapping[str, Team], members: Iterable[str], cmd: SetTeamMembers, now: datetime
) -> TeamMembersSet:
    """Decide a team's members (user ids of the organization, each once)."""
    _check_team(teams, cmd.name)
    if len(cmd.members) > MAX_MEMBERS:
        raise Invalid(f"a team has at most {MAX_MEMBERS} members")
    people = set(members)
    strangers = [m for m in cmd.members if m not in people]
    if strangers:
        raise NotFound(f"not users of this organization: {', '.join(strangers[:5])}")
    listed = list(dict.fromkeys(cmd.members))
    return TeamMembersSet(at=now, actor=cmd.actor, name=cmd.name, members=listed)


def grant(
    teams: Mapping[str, Team], folders: Iterable[str], cmd: GrantAccess, now: datetime
) -> list[TeamEvent]:
    """Decide a grant (or, at level "none", its revocation). A workspace named must exist:
    the shell checks it (it is another aggregate); a folder must exist here."""
    if cmd.team == OWNERS:
        raise Invalid("owners is admin on everything already")
    team = _check_team(teams, cmd.team)
    kind, _, name = cmd.target.partition(":")
    key = target_key(kind, name)
    if kind == "folder" and name not in set(folders):
        raise NotFound(f"folder {name} not found")
    if level_rank(cmd.level) == 0:
        if key not in team.access:
            return []
        return [AccessRevoked(at=now, actor=cmd.actor, team=cmd.team, target=key)]
    if team.access.get(key) == cmd.level:
        return []
    if key not in team.access and len(team.access) >= MAX_GRANTS:
        raise Invalid(f"a team holds at most {MAX_GRANTS} grants")
    return [AccessGranted(at=now, actor=cmd.actor, team=cmd.team, target=key, level=cmd.level)]


def forget(teams: Mapping[str, Team], cmd: ForgetWorkspace, now: datetime) -> list[TeamEvent]:
    """Every team's grant on the workspace, revoked (nothing when none holds one): a grant
    names a workspace by name, and must not pass to another workspace given that name."""
    key = target_key("workspace", cmd.workspace)
    return [
        AccessRevoked(at=now, actor=cmd.actor, team=name, target=key, reason=PURGED)
        for name, team in sorted(teams.items())
        if key in team.access
    ]


def sync(
    teams: Mapping[str, Team],
    user_id: str,
    groups: Sequence[str],
    *,
    actor: str,
    now: datetime,
    rules: Sequence[tuple[str, str]] = (),
) -> list[TeamEvent]:
    """The user's synced teams from their identity provider `groups`: every team (but
    owners, which only an admin fills) that maps one of them, by its own `idp_groups` or
    by a (group, team) rule of the organization's single sign-on. A rule naming no team
    gives nothing. Nothing when unchanged."""
    if not isinstance(groups, list | tuple) or not all(isinstance(g, str) for g in groups):
        raise Invalid("groups is a list of strings")
    have = set(groups)
    ruled = {team for group, team in rules if group in have}
    wanted = sorted(
        t.name for t in teams.values() if have.intersection(t.idp_groups) or t.name in ruled
    )
    current = sorted(t.name for t in teams.values() if user_id in t.synced)
    if wanted == current:
        return []
    return [UserTeamsSynced(at=now, actor=actor, user_id=user_id, teams=wanted)]


def applied(teams: Mapping[str, Team], event: TeamEvent) -> dict[str, Team]:
    """The teams after `event`."""
    out = dict(teams)
    match event:
        case TeamSet():
            old = out.get(event.name, Team(name=event.name))
            rights, groups = tuple(event.rights), tuple(event.idp_groups)
            out[event.name] = msgspec.structs.replace(old, rights=rights, idp_groups=groups)
        case TeamDeleted():
            out.pop(event.name, None)
        case TeamMembersSet():
            old = out.get(event.name, Team(name=event.name))
            out[event.name] = msgspec.structs.replace(old, members=tuple(event.members))
        case UserTeamsSynced():
            for name, team in out.items():
                synced = tuple(u for u in team.synced if u != event.user_id)
                if name in event.teams:
                    synced = (*synced, event.user_id)
                out[name] = msgspec.structs.replace(team, synced=synced)
        case AccessGranted():
            team = out[event.team]
            access = {**team.access, event.target: event.level}
            out[event.team] = msgspec.structs.replace(team, access=access)
        case AccessRevoked():
            team = out[event.team]
            access = {k: v for k, v in team.access.items() if k != event.target}
            out[event.team] = msgspec.structs.replace(team, access=access)
    return out
