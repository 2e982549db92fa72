"""What a test starts from, built one way: an organization, its workspaces and a queued
run through the App (`organization`, `workspace`, `workspaces`, `queued_run`), or a
workspace through the API (`api_workspace`, over tests/api_support.py's `Http`).

A test that needs something special (a repository committed first, a timeout, reapers)
wraps these rather than writing its own. Holds no tests itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from events import run as R
from services.app.commands import App
from tests.api_support import Http

ORG = "acme"
NOWHERE = "/nowhere"  # a repository no test here reads: runs are driven by hand


async def organization(app: App, name: str = ORG, *, actor: str = "admin") -> None:
    """The organization `name`, created by `actor` unless it exists."""
    if not (await app.load_org(name)).state.exists:
        await app.create_org(name, actor)


async def workspace(
    app: App,
    name: str,
    *,
    org: str = ORG,
    actor: str = "admin",
    config: R.Workspace | None = None,
    folder: str = "",
    **fields: Any,
) -> None:
    """The workspace `name` of `org` (the organization created first unless it exists),
    by `actor`: `config` with `fields` changed, or else a configuration of `fields` alone
    (repository `NOWHERE` unless given)."""
    await organization(app, org, actor=actor)
    if config is None:
        config = R.Workspace(**{"repository": NOWHERE, **fields})
    elif fields:
        config = msgspec.structs.replace(config, **fields)
    await app.create_workspace(org, name, config, actor, folder=folder)


async def workspaces(
    app: App, *names: str, org: str = ORG, actor: str = "admin", **fields: Any
) -> None:
    """`workspace` for each of `names`, in order, with the same configuration."""
    for name in names:
        await workspace(app, name, org=org, actor=actor, **fields)


async def queued_run(
    app: App, ws: str, *, org: str = ORG, run_type: str = "apply", actor: str = "alice"
) -> str:
    """A run of `ws` created and admitted (its workspace had none active); its id."""
    run_id = str((await app.create_run(org, ws, run_type, actor)).state.run_id)
    assert await app.admit_next(org, ws) == run_id
    return run_id


async def api_workspace(
    http: Http,
    repository: str | Path = "https://example.com/infra.git",
    name: str = "net",
    *,
    org: str = ORG,
    settings: dict[str, Any] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """The workspace `name` of `org` made through the API (`Http.workspace`: 201 or the
    test fails), then given `settings` unless None (PATCH .../settings: 200). Its body as
    created."""
    made = await http.workspace(org, name, repository=str(repository), **fields)
    if settings is not None:
        path = f"/api/v1/orgs/{org}/workspaces/{name}/settings"
        a = await http.call("PATCH", path, json=settings)
        assert a.status == 200, a.body
    return made
