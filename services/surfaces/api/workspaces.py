"""Workspaces change and go: the configuration members a PATCH takes, DELETE and purge.

DELETE (an organization admin) records `ws.deleted` when no run holds the workspace or
waits in its queue, and no speculative plan of it is still open (409 naming the run
otherwise). The workspace then leaves lists (`?deleted=true` shows it), starts no run
(409 `workspace-deleted`, also for any other command on it), and keeps its history:
its runs, their events, its audit rows stay readable.

Purge (`POST .../workspaces/{ws}/purge`, an organization admin; a second, explicit step,
so that freeing a name is never a side effect of a delete) frees the name of a deleted
workspace. It removes what a new workspace of that name would otherwise inherit: its
sealed secret variables (`rp-secrets`), its managed state's head, pending version and
lock (`rp-state-head`, `rp-state-locks`; the state versions themselves stay in `rp-state`,
named by their `run.state_version` events, for an operator to restore), its
notification configurations, its schedules, the run triggers it follows or is
followed by, and every team's grant on it (`org.access_revoked`, reason "workspace
purged": a grant names a workspace by name, and must not pass to a workspace made
again under it); then it records `ws.purged`, after which the aggregate
folds to a workspace never created, and the read model drops the workspace's row and
its old runs' rows (runs, steps, changes, resource states) and state versions, so a
workspace created again under the name lists only its own. The removals come first: a
purge cut short leaves a deleted workspace with less attached, and is simply made
again. What stays: every event (the stream denies deletes) and the audit history
(`events` rows), the delete's and the purge's included.
"""

from __future__ import annotations

import re
from typing import Any

import nats.errors
import structlog
from aiohttp import web

from events import notification as nt
from events import schedule as sc
from events import teams as tm
from events.workspace import CONFIG_MEMBERS, VCS_RUN_TYPES
from executor.statestore import pending_key, ws_key
from infra.eventstore import LATEST
from infra.kv import STATE_HEAD_BUCKET, STATE_LOCKS_BUCKET
from services.processes.notifications import outbox
from services.processes.notifications.tokens import TokenStore
from services.processes.schedules import store as schedule_store
from services.processes.triggers import graph
from services.surfaces.api import secrets
from services.surfaces.api import vcs as vcs_api
from services.surfaces.api.bodies import UpdateWorkspaceBody, check_name
from services.surfaces.api.common import SEQ_HEADER, path_id, scope
from services.surfaces.api.context import Api
from services.surfaces.api.paths import WS
from services.surfaces.api.problems import Problem

log = structlog.get_logger("runplane.api")

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def config_changes(body: UpdateWorkspaceBody) -> dict[str, Any]:
    """The configuration members the PATCH gives (left out or null: unchanged)."""
    given = {m: getattr(body, m) for m in CONFIG_MEMBERS}
    return {m: v for m, v in given.items() if v is not None}


async def check_config(api: Api, org: str, changes: dict[str, Any]) -> None:
    """422 for a member no workspace may take: a glob with a control character, an
    unknown run type, a VCS connection that is not the organization's own."""
    for member in ("trigger_paths", "trigger_tags"):
        for glob in changes.get(member, ()):
            if _CONTROL.search(glob):
                raise Problem("invalid-command", f"{member}: {glob!r} has a control character")
    run_type = changes.get("vcs_run_type")
    if run_type is not None and run_type not in VCS_RUN_TYPES:
        raise Problem("invalid-command", f"vcs_run_type must be plan or apply, got {run_type!r}")
    connection = changes.get("vcs_connection")
    if connection:
        check_name("vcs_connection", connection)
        await vcs_api.check_binding(api, org, connection)  # the organization's own only


async def delete_workspace(request: web.Request) -> web.Response:
    """DELETE .../workspaces/{ws}: 204, or 409 naming a run that is not over."""
    api, org, who = await scope(request, "workspace.delete")
    ws = path_id(request, "ws")
    row = await api.read.workspaces.get(org, ws)
    if row is None:
        raise Problem("not-found", f"workspace {ws} not found")
    open_runs = await api.read.runs.open(org, ws)
    if open_runs:  # speculative plans hold no place in the queue: only the runs show them
        raise Problem(
            "conflict",
            f"workspace {ws} has run {open_runs[0]} not over: cancel it or let it end first",
            current_status="busy",
            run=open_runs[0],
        )
    result = await api.app.delete_workspace(org, ws, who.user)
    await api.after_write(result.seq)
    return web.Response(status=204, headers={SEQ_HEADER: str(result.seq)})


async def purge_workspace(request: web.Request) -> web.Response:
    """POST .../workspaces/{ws}/purge: free a deleted workspace's name (module docstring)."""
    api, org, who = await scope(request, "workspace.delete")
    ws = path_id(request, "ws")
    state = (await api.app.load_ws(org, ws)).state
    if not state.exists:
        raise Problem("not-found", f"workspace {ws} not found")
    if not state.deleted:
        raise Problem(
            "conflict", f"workspace {ws} is not deleted: delete it first", current_status="live"
        )
    await _remove_attached(request, api, org, ws, who.user)
    result = await api.app.purge_workspace(org, ws, who.user)
    await api.after_write(result.seq)
    return web.Response(status=204, headers={SEQ_HEADER: str(result.seq)})


async def _remove_attached(request: web.Request, api: Api, org: str, ws: str, user: str) -> None:
    store = request.app.get(secrets.SECRETS)
    if store is not None:
        for name in await store.names(org, ws):
            await store.delete(org, ws, name)
    js = api.app.store.nc.jetstream()
    # the head, its pending version (a write cut short before its head move, which the
    # next reader would promote into the new workspace) and the lock
    for bucket, key in (
        (STATE_HEAD_BUCKET, ws_key(org, ws)),
        (STATE_HEAD_BUCKET, pending_key(org, ws)),
        (STATE_LOCKS_BUCKET, ws_key(org, ws)),
    ):
        try:
            await (await js.key_value(bucket)).purge(key)
        except nats.errors.Error as e:
            raise Problem("unavailable", f"removing the workspace's {bucket}: {e}") from e
    for config in await outbox.configs(api.app.store, org):
        if config.workspace == ws:
            if config.has_token and store is not None:
                await TokenStore(store.nc, store.keyring).delete(org, config.id)
            delete = nt.DeleteConfig(actor=user, config_id=config.id)
            await outbox.command(api.app, org, delete)
    await _forget_schedules_and_triggers(api, org, ws, user)
    await api.app.org_command(org, tm.ForgetWorkspace(actor=user, workspace=ws))
    log.info("workspace_purging", org=org, workspace=ws)


async def _forget_schedules_and_triggers(api: Api, org: str, ws: str, user: str) -> None:
    """Its schedules, and the run triggers it follows or is followed by: kept by name on
    the organization's subjects, a workspace created again under it would take them."""
    schedules, _ = await schedule_store.load(api.app, org, ws, latest=True)
    for schedule_id in sorted(schedules.schedules):
        delete = sc.DeleteSchedule(actor=user, schedule_id=schedule_id)
        await schedule_store.command(api.app, org, ws, delete)
    g = (await graph.load(api.app, org, min_seq=LATEST)).state
    for source in g.sources_of(ws):
        await graph.remove(api.app, org, ws, source, user)
    for follower in g.followers_of(ws):
        await graph.remove(api.app, org, follower, ws, user)


ROUTES = [
    web.delete(WS, delete_workspace),
    web.post(WS + "/purge", purge_workspace),
]
