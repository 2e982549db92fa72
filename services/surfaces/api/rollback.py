"""State rollback: `POST .../workspaces/{ws}/state-versions/{id}/rollback {"reason"}`.

A new state version whose content is the earlier version's, with the next serial (the
current head's + 1) and the same lineage, so Terraform takes it as the continuation of
what it last saw and the next plan is made against it. Only an admin of the workspace
(`state.rollback`, events/access.py), only while the caller holds the workspace's lock
and no run is active or holds the state lock; only a version of this workspace and of
its current lineage (404 otherwise, as for another organization's); one whose content
the state quotas let go is 410 `state-version-pruned`.

It is a push of runplane's own: the same steps and the same record as `terraform state
push` through the TFE API (services/surfaces/tfe/state_push.py), so the same crash
safety: the version is sealed and stored, marked pending, recorded as `ws.state_pushed`
(cause `rollback`, `rollback_of` the copied version, `reason`, the actor), then the head
moves. Killed before the event, there is no new version on record and the head is where
it was (the stored object is counted in the ledger, the oldest to go); killed after it,
the next reader of the state (the TFE API's `current_head`, a run's state backend,
executor/statehead.py) promotes the pending version because its event names it and the
head it replaced. The workspace aggregate decides the event on its own subject at the
moment of the append: the lock still the caller's (taken at the same time), no run
admitted, no other push landed since the head was read.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from datetime import datetime
from typing import Annotated, Any

import msgspec
import structlog
from aiohttp import web

from events.errors import DomainError
from events.workspace import RecordStatePush
from executor.statefile import StateRefused
from executor.statestore import Head, HeadMoved, StateStore, StateStoreError, VersionGone
from executor.statestore import with_serial as reserialed
from services.surfaces.api.auth import Principal
from services.surfaces.api.bodies import Body, read_body
from services.surfaces.api.common import json_response, path_id, scope
from services.surfaces.api.context import Api
from services.surfaces.api.paths import WS
from services.surfaces.api.problems import Problem
from services.surfaces.api.schemas import REF, Doc, operation
from services.surfaces.tfe import ids
from services.surfaces.tfe.context import TFE
from services.surfaces.tfe.jsonapi import TfeError
from services.surfaces.tfe.state import current_head, last_pushed

log = structlog.get_logger("runplane.api")


class RollbackBody(Body, frozen=True, kw_only=True):
    reason: Annotated[
        str, msgspec.Meta(min_length=1, max_length=1024, description="why, kept with the event")
    ]


def version_id(org: str, ws: str, row: dict[str, Any]) -> str:
    """A listed version's id (the TFE API's: `sv-<org>.<ws>.<serial>.<digest16>`)."""
    return ids.state_version_id(org, ws, int(row["serial"]), str(row["digest"]))


def with_ids(org: str, ws: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"id": version_id(org, ws, r), **r} for r in rows]


async def rollback_state_version(request: web.Request) -> web.Response:
    """POST .../state-versions/{id}/rollback: 201 with the new version."""
    api, org, who = await scope(request, "state.rollback")
    ws = path_id(request, "ws")
    body = await read_body(request, RollbackBody)
    answer = await roll_back(request, api, org, ws, who, request.match_info["id"], body.reason)
    return json_response(answer, status=201)


async def roll_back(
    request: web.Request, api: Api, org: str, ws: str, who: Principal, value: str, reason: str
) -> dict[str, Any]:
    """Roll workspace `ws` back to its version `value` (an id), for `who`, who may
    (`state.rollback`, checked by the caller): the new version as listed, with `seq`."""
    states = request.app[TFE].states
    if states is None:
        raise Problem("unavailable", "this deployment has no encryption key: no managed state")
    lock_since = _writable(await _workspace(api, org, ws), who)
    source = await _version(api, org, ws, value)
    await _no_run_holds_the_state(states, org, ws)
    with _tfe_problems():
        head, revision = await current_head(request, org, ws)
    if head is None:
        raise Problem("conflict", f"workspace {ws} has no state to roll back")
    if source.lineage != head.lineage:
        raise Problem(
            "state-version-other-lineage",
            f"state version {value} is of lineage {source.lineage!r}, "
            f"not the workspace's current {head.lineage!r}",
        )
    version = await _store(states, org, ws, source, head.serial + 1)
    command = RecordStatePush(
        actor=who.user,
        serial=version.serial,
        lineage=version.lineage,
        digest=version.digest,
        object=version.object,
        size=version.size,
        previous=head.object,
        cause="rollback",
        reason=reason,
        rollback_of=source.object,
        lock_since=lock_since,
    )
    try:
        result = await api.app.record_state_push(org, ws, command)
    except DomainError:  # the lock lost, a run admitted, another push landed: nothing
        await _clear_unless_recorded(request, states, org, ws, version, head)
        raise
    await _move(states, org, ws, version, revision)
    log.info("state_rolled_back", org=org, ws=ws, serial=version.serial, of=source.object)
    await api.after_write(int(result.seq))
    return {
        "id": ids.state_version_id(org, ws, version.serial, version.digest),
        **msgspec.to_builtins(version),
        "rollback_of": source.object,
        "reason": reason,
        "pushed_by": who.user,
        "seq": int(result.seq),
    }


async def _clear_unless_recorded(
    request: web.Request, states: StateStore, org: str, ws: str, version: Head, head: Head
) -> None:
    """Clear the pending mark if it is still this rollback's, unless the same version
    over the same head was recorded meanwhile (the same rollback sent twice at once: the
    pending mark is the other's too, which its head move, or the next read, needs)."""
    last = await last_pushed(request, org, ws)
    if last is not None and (last.object, last.previous) == (version.object, head.object):
        return
    with contextlib.suppress(StateStoreError):
        if await states.pending(org, ws) == version:
            await states.clear_pending(org, ws)


async def _workspace(api: Api, org: str, ws: str) -> dict[str, Any]:
    row = await api.read.workspaces.get(org, ws)
    if row is None:
        raise Problem("not-found", f"workspace {ws} not found")
    return row


def _writable(row: dict[str, Any], who: Principal) -> datetime | None:
    """When the caller's lock was taken (None: not known); 409 unless the caller holds
    the workspace's lock and no run is active."""
    lock = row.get("lock")
    if lock is None or lock.get("holder") != who.user:
        raise Problem("workspace-not-locked", "lock the workspace before rolling its state back")
    if row.get("active_run"):
        raise Problem("run-active", f"run {row['active_run']} is active on the workspace")
    try:
        return datetime.fromisoformat(str(lock["locked_at"]))
    except (KeyError, ValueError):
        return None


async def _version(api: Api, org: str, ws: str, value: str) -> Head:
    """The listed version `value` names, of this workspace: 404 for any other (another
    workspace's or organization's id says nothing of whether it exists)."""
    try:
        v_org, v_ws, serial, prefix = ids.parse_state_version_id(value)
    except TfeError as e:
        raise Problem("not-found", f"state version {value!r} not found") from e
    if (v_org, v_ws) == (org, ws):
        for row in await api.read.workspaces.state_versions(org, ws):
            if row["serial"] == serial and str(row["digest"]).startswith(prefix):
                return Head(
                    object=str(row["object"]),
                    serial=serial,
                    lineage=str(row["lineage"]),
                    digest=str(row["digest"]),
                    size=int(row["size"]),
                )
    raise Problem("not-found", f"state version {value!r} not found in workspace {ws}")


async def _no_run_holds_the_state(states: StateStore, org: str, ws: str) -> None:
    try:
        holder, _ = await states.holder(org, ws)
    except StateStoreError as e:
        raise Problem("unavailable", str(e)) from e
    if holder is not None:
        raise Problem("run-active", f"run {holder.run_id} holds the state lock")


async def _store(states: StateStore, org: str, ws: str, source: Head, serial: int) -> Head:
    """The source's content with `serial`, sealed and stored, marked pending."""
    try:
        data = await states.read(source)
        content = await asyncio.to_thread(reserialed, data, serial)
        version = await states.put_version(org, ws, content)
        await states.mark_pending(org, ws, version)
    except VersionGone as e:
        raise Problem(
            "state-version-pruned",
            f"state version {source.object} is no longer stored: the state quotas let it go",
        ) from e
    except ValueError as e:  # stored, so checked once: not a state now is no input's fault
        raise Problem("internal-error", f"state version {source.object}: {e}") from e
    except StateRefused as e:
        raise Problem("quota-exceeded", str(e)) from e
    except StateStoreError as e:
        raise Problem("unavailable", str(e)) from e
    return version


async def _move(states: StateStore, org: str, ws: str, version: Head, revision: int) -> None:
    """The head to the recorded version, then the pending mark cleared."""
    try:
        await states.move_head(org, ws, version, revision)
    except HeadMoved as e:
        with _tfe_problems():
            head, _ = await states.head(org, ws)
        if head is not None and head.object == version.object:
            return  # a reader promoted it first: done
        log.error("state_rollback_head_moved", org=org, ws=ws, object=version.object)
        raise Problem("state-changed", "the workspace's state changed meanwhile") from e
    except StateStoreError as e:  # recorded, not moved: the next read promotes it
        raise Problem("unavailable", str(e)) from e
    await states.clear_pending(org, ws)


@contextlib.contextmanager
def _tfe_problems() -> Iterator[None]:
    """The TFE side's errors (its `current_head`'s 503) as problems."""
    try:
        yield
    except TfeError as e:
        raise Problem("unavailable", e.detail or e.title) from e
    except StateStoreError as e:
        raise Problem("unavailable", str(e)) from e


# ---------------------------------------------------------------- OpenAPI

SCHEMAS: dict[str, Doc] = msgspec.json.schema_components((RollbackBody,), ref_template=REF)[1]
PATHS: dict[str, Doc] = {
    "/api/v1/orgs/{org}/workspaces/{ws}/state-versions/{id}/rollback": {
        "post": operation(
            "rollbackStateVersion",
            "A new state version copying version {id} with the next serial (workspace admin; "
            "the caller holds the workspace's lock; no run active)",
            (201, "StateVersion"),
            params=("org", "ws", "id"),
            body="RollbackBody",
            body_required=True,
            errors=(400, 403, 404, 409, 410, 422, 503),
        )
    },
}

ROUTES = [web.post(WS + "/state-versions/{id}/rollback", rollback_state_version)]
