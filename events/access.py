"""Who may do what: the one access check of every surface (API, TFE API, UI, CLI through
the API, chat-ops). Pure.

`resolve` turns a caller (a token as its organization's aggregate knows it) into its
`Access`: a level on the organization, on folders and on workspaces, and organization
rights. `allowed(who, action, target)` answers one question; `require` raises what a
surface answers: NotFound (404) for another organization's things and for a workspace
the caller may not even read (nothing probes what exists), Forbidden (403) otherwise.

Levels (HCP Terraform's): read (see), plan (+ queue plans, read whole state), write (+
apply, approve where the approval rules allow, lock, variables, schedules), admin (+
settings, access, delete). A grant on a folder holds for everything inside it, folders
nested; a caller's level on a workspace is the highest of its organization's, its
folders' and its own. Rights: `manage-workspaces` (create workspaces and folders, admin
on all of them), `manage-policies`, `manage-vcs`, `manage-teams` (users, teams and their
members, team tokens), `read-audit` (the organization's audit log: HCP Terraform keeps
its audit trail to organization tokens; a right lets a team of auditors read it without
admin). Admin on the organization is everything (`owners`).

Callers:
- the deployment's admin token (`superuser`): everything everywhere;
- an organization token, the tokens of before users (`role`): viewer -> read, operator and
  approver -> write, admin -> admin (with every right), on the whole organization. Old
  events need no rewriting: the level is derived from the role they carry;
- a personal token: its user's access now (the union of their teams'), capped at the
  token's own level if it has one; a suspended user's tokens resolve to nothing;
- a team token: its team's access; a deleted team's tokens are revoked with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, Literal

import msgspec

from events import folder as fo
from events.errors import Forbidden, NotFound
from events.members import Member
from events.org import OrgState
from events.teams import LEVELS, OWNERS, RIGHTS, Team, with_owners

NONE, READ, PLAN, WRITE, ADMIN = range(5)
ROLE_LEVEL: Final = {"viewer": READ, "operator": WRITE, "approver": WRITE, "admin": ADMIN}
On = Literal["org", "workspace", "deployment"]


class Need(msgspec.Struct, frozen=True):
    """What an action needs: a level on its target, or one of the rights (if any)."""

    on: On
    level: int
    right: str = ""


# Every action a surface checks. `workspace` actions take a workspace or folder target;
# `org` ones the organization (level NONE: any caller of the organization).
ACTIONS: Final[dict[str, Need]] = {
    "org.read": Need("org", NONE),
    "tokens.personal": Need("org", NONE),
    "workspaces.create": Need("org", ADMIN, "manage-workspaces"),
    "folders.create": Need("org", ADMIN, "manage-workspaces"),
    "policies.manage": Need("org", ADMIN, "manage-policies"),
    "vcs.manage": Need("org", ADMIN, "manage-vcs"),
    "teams.manage": Need("org", ADMIN, "manage-teams"),
    "org.settings": Need("org", ADMIN),  # settings, templates, notifications, chat, tokens
    "org.access": Need("org", ADMIN),  # organization-wide grants, rights, owners
    "org.create": Need("deployment", ADMIN),  # the admin token only
    "audit.read": Need("org", ADMIN, "read-audit"),  # the organization's audit log
    "workspace.read": Need("workspace", READ),
    "run.plan": Need("workspace", PLAN),
    "run.cancel_plan": Need("workspace", PLAN),
    "state.read": Need("workspace", PLAN),
    "run.apply": Need("workspace", WRITE),
    "run.approve": Need("workspace", WRITE),
    "run.cancel": Need("workspace", WRITE),
    "workspace.lock": Need("workspace", WRITE),
    "variables.write": Need("workspace", WRITE),
    "state.write": Need("workspace", WRITE),
    "schedules.write": Need("workspace", WRITE),
    "workspace.force_unlock": Need("workspace", ADMIN),
    "workspace.settings": Need("workspace", ADMIN),
    "workspace.access": Need("workspace", ADMIN),
    "workspace.delete": Need("workspace", ADMIN),
    "state.rollback": Need("workspace", ADMIN),  # a new version copying an earlier one
}


PLAN_ONLY: Final = frozenset({"plan", "drift"})  # run types that change nothing


def run_action(run_type: str) -> str:
    """What starting a run of `run_type` is: queueing a plan, or an apply."""
    return "run.plan" if run_type in PLAN_ONLY else "run.apply"


class Target(msgspec.Struct, frozen=True, kw_only=True):
    """What an action is on: the organization, a folder (its path from the outermost,
    `folders`) or a workspace (with the path of the folder it is in)."""

    org: str
    workspace: str = ""
    folders: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.workspace:
            return f"workspace {self.workspace}"
        return f"folder {self.folders[-1]}" if self.folders else f"organization {self.org}"


class Access(msgspec.Struct, frozen=True, kw_only=True):
    """A caller's access. `org` None: the deployment's admin token."""

    user: str
    org: str | None
    org_level: int = NONE
    folders: Mapping[str, int] = {}
    workspaces: Mapping[str, int] = {}
    rights: frozenset[str] = frozenset()
    teams: tuple[str, ...] = ()
    cap: int = ADMIN  # a personal token's own ceiling
    user_id: str = ""  # a person's id ("" for organization and team tokens)

    @property
    def superuser(self) -> bool:
        return self.org is None

    def level_on(self, target: Target) -> int:
        """The caller's level on `target` (NONE in another organization)."""
        if self.org is None:
            return ADMIN
        if self.org != target.org:
            return NONE
        level = self.org_level
        if "manage-workspaces" in self.rights:
            level = ADMIN
        for folder in target.folders:
            level = max(level, self.folders.get(folder, NONE))
        if target.workspace:
            level = max(level, self.workspaces.get(target.workspace, NONE))
        return min(level, self.cap)

    def uniform(self, level: int) -> bool:
        """Whether the caller holds `level` on every workspace of its organization (so no
        workspace need be looked up to decide)."""
        return self.org is None or self.level_on(Target(org=self.org)) >= level

    def highest(self) -> int:
        """The highest level the caller holds anywhere in its organization."""
        if self.org is None or "manage-workspaces" in self.rights:
            return min(ADMIN, self.cap)
        levels = [self.org_level, *self.folders.values(), *self.workspaces.values()]
        return min(max(levels), self.cap)

    def holds(self, right: str) -> bool:
        return self.org is None or (right in self.rights and self.cap == ADMIN)


def allowed(who: Access, action: str, target: Target) -> bool:
    """Whether `who` may do `action` on `target`."""
    need = ACTIONS[action]
    if who.org is None:
        return True
    if who.org != target.org or need.on == "deployment":
        return False
    if need.right and who.holds(need.right):
        return True
    if need.on == "org":
        return min(who.org_level, who.cap) >= need.level
    return who.level_on(target) >= need.level


def require(who: Access, action: str, target: Target, *, hidden: str = "") -> None:
    """Nothing if allowed; else NotFound for another organization, for the deployment's
    own actions, and (as `hidden`, e.g. "run r-1") for a workspace the caller may not read;
    Forbidden saying what is missing otherwise."""
    if allowed(who, action, target):
        return
    need = ACTIONS[action]
    if who.org != target.org or need.on == "deployment":
        raise NotFound(f"organization {target.org} not found")
    level = who.level_on(target) if need.on == "workspace" else min(who.org_level, who.cap)
    if need.on == "workspace" and level < READ:
        raise NotFound(f"{hidden or target.describe()} not found")
    also = f" or the right {need.right}" if need.right else ""
    raise Forbidden(
        f"{who.user} has {LEVELS[level]} on {target.describe()}; {action} needs "
        f"{LEVELS[need.level]}{also}"
    )


def superuser(user: str) -> Access:
    return Access(user=user, org=None, org_level=ADMIN, rights=frozenset(RIGHTS))


def for_role(org: str, user: str, role: str) -> Access:
    """An organization token of before users: its role on the whole organization."""
    level = ROLE_LEVEL.get(role, NONE)
    rights = frozenset(RIGHTS) if level == ADMIN else frozenset()
    return Access(user=user, org=org, org_level=level, rights=rights)


def for_teams(org: str, user: str, teams: list[Team], **extra: object) -> Access:
    """The union of `teams`' access."""
    org_level, rights = NONE, set[str]()
    folders: dict[str, int] = {}
    workspaces: dict[str, int] = {}
    for team in teams:
        rights.update(team.rights)
        for key, level in team.access.items():
            rank = LEVELS.index(level)
            kind, _, name = key.partition(":")
            if kind == "org":
                org_level = max(org_level, rank)
            else:
                into = folders if kind == "folder" else workspaces
                into[name] = max(into.get(name, NONE), rank)
    names = tuple(t.name for t in teams)
    return Access(
        user=user, org=org, org_level=org_level, folders=folders, workspaces=workspaces,
        rights=frozenset(rights), teams=names, **extra,  # type: ignore[arg-type]  # fields
    )  # fmt: skip


def for_member(
    org: str, member: Member | None, teams: Mapping[str, Team], *, cap: str = ""
) -> Access | None:
    """A person's access now: None if they are no user of `org` or are suspended."""
    if member is None or not member.active:
        return None
    mine = [t for t in with_owners(teams).values() if t.has(member.user_id)]
    ceiling = LEVELS.index(cap) if cap in LEVELS else ADMIN
    return for_teams(org, member.email, mine, cap=ceiling, user_id=member.user_id)


def for_team(org: str, user: str, teams: Mapping[str, Team], team: str) -> Access | None:
    """A team token's access: None once the team is gone."""
    found = with_owners(teams).get(team)
    return None if found is None else for_teams(org, user, [found])


def resolve(state: OrgState, *, token_id: str, user: str, role: str) -> Access | None:
    """The access of one of `state`'s tokens now (its lifecycle checked elsewhere): None
    when it stands for nobody any more (a suspended user, a deleted team). Folder grants
    come expanded to every folder inside, so a workspace's own folder decides."""
    owner = state.owners.get(token_id)
    if owner is None:
        return for_role(state.name, user, role)
    if owner.kind == "user":
        found = for_member(state.name, state.members.get(owner.owner), state.teams, cap=owner.level)
    else:
        found = for_team(state.name, user, state.teams, owner.owner)
    return None if found is None else inherited(found, state.folders)


def inherited(who: Access, tree: Mapping[str, fo.Folder]) -> Access:
    """`who` with each folder grant held by every folder inside it (nested)."""
    if not who.folders:
        return who
    folders = {name: max(who.folders.get(f, NONE) for f in fo.path(tree, name)) for name in tree}
    kept = {k: v for k, v in folders.items() if v > NONE}
    return msgspec.structs.replace(who, folders=kept)


def beyond(who: Access, other: Access, ws_folders: Mapping[str, str] | None = None) -> str:
    """What `other` holds that `who` does not ("" if nothing): a right, or a level on the
    organization, a folder or a workspace (`ws_folders`: each workspace's folder, so that
    `who`'s folder grants count; a workspace missing there is judged without them). A
    holder of `manage-teams` may hand out (members, tokens, a user's standing) no more
    than it holds itself: a right held is not a way to more."""
    if who.org is None:
        return ""
    org = who.org
    for right in sorted(other.rights) if other.cap == ADMIN else ():
        if not who.holds(right):
            return f"the right {right}"
    if min(other.org_level, other.cap) > min(who.org_level, who.cap):
        return f"{LEVELS[min(other.org_level, other.cap)]} on organization {org}"
    wanted = [(Target(org=org, folders=(f,)), v) for f, v in other.folders.items()]
    for ws, level in other.workspaces.items():
        folder = (ws_folders or {}).get(ws, "")
        wanted.append((Target(org=org, workspace=ws, folders=(folder,) if folder else ()), level))
    for target, level in sorted(wanted, key=lambda t: t[0].describe()):
        if min(level, other.cap) > who.level_on(target):
            return f"{LEVELS[min(level, other.cap)]} on {target.describe()}"
    return ""


def of_team(org: str, team: Team, folders: Mapping[str, fo.Folder]) -> Access:
    """What a team's member (or token) holds through `team`."""
    return inherited(for_teams(org, f"team:{team.name}", [team]), folders)


def is_owner(teams: Mapping[str, Team], user_id: str) -> bool:
    return with_owners(teams)[OWNERS].has(user_id)


def describe(who: Access) -> dict[str, object]:
    """What `whoami` shows of an access: levels by name."""
    return {
        "organization": LEVELS[min(who.org_level, who.cap)],
        "folders": {k: LEVELS[min(v, who.cap)] for k, v in sorted(who.folders.items())},
        "workspaces": {k: LEVELS[min(v, who.cap)] for k, v in sorted(who.workspaces.items())},
        "rights": sorted(who.rights) if who.cap == ADMIN else [],
    }
