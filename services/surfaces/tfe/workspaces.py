"""Account, organizations and workspaces, as the CLI reads and writes them.

- `GET /account/details`: who the token is (`terraform login` checks a pasted token so);
- `GET /organizations/:org` and `/entitlement-set`: `operations` true, so the `remote`
  backend does not fall back to local operations;
- workspaces by name (read, create when missing at `init`, list with `search[name]`)
  and by id (read, lock, unlock, force-unlock, vars). The TFE lock is runplane's
  workspace lock (services/surfaces/api/locks.py): while the CLI holds it no run is admitted.

A workspace the CLI creates has no repository: `CLI_REPOSITORY` stands for "its
configuration comes from the CLI's uploads", the run source the configuration-version
routes (not yet served) will bring.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from events import access
from events.codec import valid_id
from events.run import Workspace
from services.surfaces.api.auth import Principal
from services.surfaces.api.secrets import SECRETS
from services.surfaces.tfe import ids
from services.surfaces.tfe.context import api_of, may, principal, read_json, require
from services.surfaces.tfe.jsonapi import (
    Doc,
    TfeError,
    attributes,
    document,
    listing,
    not_found,
    page_of,
    resource,
    response,
)

CLI_REPOSITORY = "runplane-cli://configuration-upload"
LOCK_REASON = "Locked by Terraform"
MAX_REASON = 1024


def _level(who: Principal, org: str, row: dict[str, Any]) -> int:
    """The caller's level on a workspace row (its folder is in the row)."""
    folder = row.get("folder") or ""
    target = access.Target(org=org, workspace=row["name"], folders=(folder,) if folder else ())
    return who.access.level_on(target)


# ---------------------------------------------------------------- account, organizations


async def account_details(request: web.Request) -> web.Response:
    """GET /account/details: the token's user (users have no other id here)."""
    who = principal(request)
    attrs = {
        "username": who.user,
        "email": "",
        "avatar-url": "",
        "is-service-account": False,
        "two-factor": {"enabled": False, "verified": False},
        "unconfirmed-email": "",
        "v2-only": True,
    }
    return response(document(resource("users", f"user-{who.user}", attrs)))


async def _existing_org(request: web.Request, org: str) -> None:
    if await api_of(request).read.orgs.get(org) is None:
        raise not_found(f"organization {org} not found")


async def get_organization(request: web.Request) -> web.Response:
    org = ids.check_org(request.match_info["org"])
    who = await require(request, org, "org.read")
    await _existing_org(request, org)
    whole = access.Target(org=org)
    attrs = {
        "name": org,
        "external-id": org,
        "email": "",
        "collaborator-auth-policy": "password",
        "cost-estimation-enabled": False,
        "permissions": {
            "can-create-workspace": who.may("workspaces.create", whole),
            "can-update": who.may("org.settings", whole),
            "can-destroy": False,
        },
    }
    return response(document(resource("organizations", org, attrs)))


async def entitlement_set(request: web.Request) -> web.Response:
    """Remote operations are on: the `remote` backend would otherwise run locally."""
    org = ids.check_org(request.match_info["org"])
    await require(request, org, "org.read")
    await _existing_org(request, org)
    attrs = {
        "operations": True,
        "state-storage": True,
        "private-module-registry": False,
        "sentinel": False,
        "teams": False,
        "vcs-integrations": False,
        "agents": False,
        "audit-logging": True,
        "cost-estimation": False,
        "sso": False,
    }
    return response(document(resource("entitlement-sets", f"org-{org}", attrs)))


# ---------------------------------------------------------------- workspaces


def render_workspace(org: str, row: dict[str, Any], who: Principal) -> Doc:
    """A workspace row of the read model as go-tfe's `Workspace`."""
    level = _level(who, org, row)
    operate, admin = level >= access.WRITE, level >= access.ADMIN
    directory = row.get("directory") or "."
    cli = row.get("repository") == CLI_REPOSITORY
    attrs = {
        "name": row["name"],
        "created-at": _time(row.get("created_at")),
        "updated-at": _time(row.get("created_at")),
        "description": "",
        "environment": "default",
        "execution-mode": "remote",
        "operations": True,
        "auto-apply": False,
        "allow-destroy-plan": True,
        "can-queue-destroy-plan": True,
        "file-triggers-enabled": False,
        "global-remote-state": False,
        "queue-all-runs": False,
        "speculative-enabled": True,
        "structured-run-output-enabled": False,
        # runplane picks the binary its executors run; "latest" keeps the CLI from
        # refusing a workspace over a version it does not choose.
        "terraform-version": "latest",
        "trigger-prefixes": [],
        "working-directory": "" if directory == "." else directory,
        "locked": row.get("lock") is not None,
        "vcs-repo": None if cli else {"identifier": row["repository"], "branch": row["branch"]},
        "resource-count": 0,
        "source": "tfe-cli" if cli else "runplane",
        "actions": {"is-destroyable": False},
        "permissions": {
            "can-destroy": False,
            "can-force-unlock": admin,
            "can-lock": operate,
            "can-unlock": operate,
            "can-queue-apply": operate,
            "can-queue-destroy": operate,
            "can-queue-run": operate,
            "can-read-settings": True,
            "can-update": admin,
            "can-update-variable": admin,
            "can-read-state-versions": operate,  # the whole state: operator and up
            "can-create-state-versions": operate,
        },
    }
    active = row.get("active_run")
    relationships: dict[str, Any] = {
        "organization": ("organizations", org),
        "current-run": ("runs", ids.run_object_id("run", org, row["name"], active))
        if active
        else None,
    }
    return resource("workspaces", ids.workspace_id(org, row["name"]), attrs, relationships)


def _time(value: str | None) -> str | None:
    """The read model's times (`...T12:00:00.123456Z`) as go-tfe's iso8601 fields
    expect them: whole seconds, UTC."""
    if not value:
        return None
    return value.split(".", 1)[0].removesuffix("Z") + "Z"


async def _workspace_row(request: web.Request, org: str, ws: str) -> dict[str, Any]:
    read = api_of(request).read
    row = await read.workspaces.get(org, ws)
    if row is None:
        raise not_found(f"workspace {ws} not found in organization {org}")
    return row | {"folder": await read.workspaces.folder_of(org, ws) or ""}


async def workspace_by_id(request: web.Request, action: str) -> tuple[str, str, Principal]:
    """The (org, ws, caller) of the path's workspace id, once the caller may `action`."""
    org, ws = ids.parse_workspace_id(request.match_info["workspace_id"])
    return org, ws, await require(request, org, action, ws)


async def read_workspace(request: web.Request) -> web.Response:
    """GET /organizations/:org/workspaces/:name."""
    org = ids.check_org(request.match_info["org"])
    name = request.match_info["name"]
    if not valid_id(name):
        raise not_found(f"workspace {name!r} not found")
    who = await require(request, org, "workspace.read", name)
    row = await _workspace_row(request, org, name)
    return response(document(render_workspace(org, row, who)))


async def read_workspace_by_id(request: web.Request) -> web.Response:
    org, ws, who = await workspace_by_id(request, "workspace.read")
    row = await _workspace_row(request, org, ws)
    return response(document(render_workspace(org, row, who)))


async def list_workspaces(request: web.Request) -> web.Response:
    """GET /organizations/:org/workspaces: `search[name]` a part of the name (the CLI
    sends the configured name or prefix), paged."""
    org = ids.check_org(request.match_info["org"])
    who = await require(request, org, "org.read")
    await _existing_org(request, org)
    search = request.query.get("search[name]", "")
    read = api_of(request).read
    folders = await read.workspaces.folders(org)
    rows = [r | {"folder": folders.get(r["name"], "")} for r in await read.workspaces.find(org)]
    shown = [
        render_workspace(org, r, who)
        for r in rows
        if search in r["name"] and _level(who, org, r) >= access.READ
    ]
    return response(listing(shown, page_of(request)))


async def create_workspace(request: web.Request) -> web.Response:
    """POST /organizations/:org/workspaces: what `init` sends for a missing workspace
    (name, maybe terraform-version, which runplane does not take: its executors choose)."""
    org = ids.check_org(request.match_info["org"])
    who = await require(request, org, "workspaces.create")
    attrs = attributes(await read_json(request), "workspaces")
    name = attrs.get("name")
    if not isinstance(name, str):
        raise TfeError(422, "invalid attribute", "name is required")
    ids.check_workspace_name(name)
    directory = attrs.get("working-directory") or "."
    if not isinstance(directory, str) or directory.startswith("/") or ".." in directory:
        raise TfeError(422, "invalid attribute", "working-directory must be a relative path")
    await _existing_org(request, org)
    api = api_of(request)
    config = Workspace(repository=CLI_REPOSITORY, branch="main", directory=directory)
    result = await api.app.create_workspace(org, name, config, who.user)
    await api.after_write(result.seq)
    row = await _workspace_row(request, org, name)
    return response(document(render_workspace(org, row, who)), status=201)


async def update_workspace(request: web.Request) -> web.Response:
    """PATCH /workspaces/:id: what the `cloud` block sends after creating a workspace
    (its own terraform-version). runplane's executors choose the binary: 422, which the
    CLI tolerates there."""
    org, ws, _ = await workspace_by_id(request, "workspace.settings")
    await _workspace_row(request, org, ws)
    raise TfeError(
        422,
        "not updatable here",
        "runplane chooses the Terraform version its executors run; change workspaces "
        "through runplane's own API",
    )


# ---------------------------------------------------------------- locks


async def lock_workspace(request: web.Request) -> web.Response:
    """POST /workspaces/:id/actions/lock: 409 if locked (go-tfe: ErrWorkspaceLocked)."""
    org, ws, who = await workspace_by_id(request, "workspace.lock")
    reason = LOCK_REASON
    body = await read_json(request) if request.can_read_body else None
    if isinstance(body, dict):
        given = body.get("reason")
        if isinstance(given, str) and given.strip():
            reason = given[:MAX_REASON]
    api = api_of(request)
    result = await api.app.lock_workspace(org, ws, reason, who.user)
    return await _written(request, org, ws, who, result.seq)


async def unlock_workspace(request: web.Request) -> web.Response:
    """POST /workspaces/:id/actions/unlock: the holder (or an org admin); 409 if not
    locked."""
    org, ws, who = await workspace_by_id(request, "workspace.lock")
    api = api_of(request)
    admin = await may(request, org, "workspace.force_unlock", ws)
    result = await api.app.unlock_workspace(org, ws, who.user, admin=admin)
    return await _written(request, org, ws, who, result.seq)


async def force_unlock_workspace(request: web.Request) -> web.Response:
    """POST /workspaces/:id/actions/force-unlock: an org admin lifts anyone's lock."""
    org, ws, who = await workspace_by_id(request, "workspace.force_unlock")
    api = api_of(request)
    result = await api.app.unlock_workspace(org, ws, who.user, admin=True)
    return await _written(request, org, ws, who, result.seq)


async def _written(
    request: web.Request, org: str, ws: str, who: Principal, seq: int
) -> web.Response:
    await api_of(request).after_write(seq)
    row = await _workspace_row(request, org, ws)
    return response(document(render_workspace(org, row, who)))


# ---------------------------------------------------------------- variables


async def list_vars(request: web.Request) -> web.Response:
    """GET /workspaces/:id/vars: the plain variables with their values, the secret
    ones by name, sensitive and without value (services/surfaces/api/secrets.py)."""
    org, ws, _ = await workspace_by_id(request, "workspace.read")
    row = await _workspace_row(request, org, ws)
    workspace_id = ids.workspace_id(org, ws)
    out = [_var(workspace_id, k, v, False) for k, v in sorted(row["variables"].items())]
    store = request.app.get(SECRETS)
    if store is not None:
        out += [_var(workspace_id, k, None, True) for k in sorted(await store.names(org, ws))]
    return response(listing(out, page_of(request)))


def _var(workspace_id: str, key: str, value: str | None, sensitive: bool) -> Doc:
    attrs = {
        "key": key,
        "value": value,
        "description": "",
        "category": "terraform",
        "hcl": False,
        "sensitive": sensitive,
    }
    rel = {"configurable": ("workspaces", workspace_id)}
    return resource("vars", f"var-{workspace_id.removeprefix('ws-')}.{key}", attrs, rel)
