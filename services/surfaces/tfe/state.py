"""State versions through the TFE API, on the very state runplane's runs read and write.

The head pointer, the sealed versions and the run's state lock are
executor/statestore.py's: a version pushed through the CLI (services/surfaces/tfe/state_push.py)
is what the next run plans on, and a version a run wrote is what `terraform state
pull` gets.

Who reads what (HCP Terraform's "read state versions" against "read state outputs"):
the whole state, secrets and all, goes only to an operator, approver or admin: the
`hosted-state-download-url` of a version is minted for them alone, and
`current-state-version` (what `state pull` and every state read of the CLI's backend
start from) answers a viewer 403 saying so. A viewer reads a version's metadata
(`GET /state-versions/:id`, no download URL) and the outputs (services/surfaces/tfe/outputs.py).
runplane's own API never serves a whole state.

Every read of the head goes through `current_head`, which finishes a push a crash cut
short between its event and its head move (see services/surfaces/tfe/state_push.py).

The state is downloaded from a capability URL (services/surfaces/tfe/capability.py) scoped to the
one version and living `DOWNLOAD_TTL_S`.
"""

from __future__ import annotations

from datetime import UTC
from typing import Any

import structlog
from aiohttp import web

from events.codec import run_subject, ws_subject
from events.org import ROLES
from events.run import StateVersionCreated
from events.workspace import StatePushed
from executor.statestore import Head, HeadMoved, StateStoreError
from infra.eventstore import LATEST
from services.surfaces.api.auth import Principal
from services.surfaces.tfe import ids
from services.surfaces.tfe.capability import CapabilityError
from services.surfaces.tfe.context import api_of, may, require, tfe_of
from services.surfaces.tfe.holders import holder_of, still_may
from services.surfaces.tfe.jsonapi import (
    Doc,
    TfeError,
    document,
    not_found,
    resource,
    response,
)
from services.surfaces.tfe.workspaces import workspace_by_id

log = structlog.get_logger("runplane.tfe")

KIND = "state"
DOWNLOAD_TTL_S = 600
DOWNLOAD_PATH = "/api/v2/capabilities/state/"
_RANK = {role: i for i, role in enumerate(ROLES)}


async def may_read_state(request: web.Request, org: str, ws: str) -> bool:
    """Whether the caller may read the workspace's whole states (and sensitive outputs'
    values): plan or above on it (an operator, approver or admin token; events/access.py)."""
    return await may(request, org, "state.read", ws)


def _download_url(request: web.Request, org: str, head: Head) -> str:
    signer = tfe_of(request).need_signer()
    object_id = f"{head.object}@{head.digest}"
    token = signer.sign(KIND, org, object_id, DOWNLOAD_TTL_S, holder=holder_of(request))
    return f"{request.url.origin()}{DOWNLOAD_PATH}{token}"


def render(
    request: web.Request, org: str, ws: str, head: Head, created_at: str | None, readable: bool
) -> Doc:
    """A state version as go-tfe's `StateVersion`. A version the CLI pushed is shown with
    the time its event was recorded, or the present one before the read model has it
    (go-tfe wants a time there). The download URL only for those who may read state."""
    if created_at is None:
        now = api_of(request).app.clock()
        created_at = now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    url = _download_url(request, org, head) if readable else None
    attrs = {
        "serial": head.serial,
        "lineage": head.lineage,
        "size": head.size,
        "created-at": created_at,
        "status": "finalized",
        "resources-processed": True,
        "vcs-commit-sha": None,
        "vcs-commit-url": None,
        "hosted-state-download-url": url,
    }
    rels: dict[str, Any] = {
        "run": ("runs", head.run_id) if head.run_id else None,
        "workspace": ("workspaces", ids.workspace_id(org, ws)),
        "outputs": {"data": []},
    }
    sv_id = ids.state_version_id(org, ws, head.serial, head.digest)
    return resource("state-versions", sv_id, attrs, rels)


async def refuse_whole_state(request: web.Request, org: str, ws: str, who: Principal) -> None:
    """403 unless the caller may read whole states: the detail is what the CLI prints."""
    if await may_read_state(request, org, ws):
        return
    raise TfeError(
        403,
        "state not readable with this access",
        f"{who.user} may read this workspace's outputs but not its whole state "
        "(`terraform state pull`, and the remote backend's every state read, need plan "
        "or above on the workspace: an operator, approver or admin token); `terraform "
        "output` of a cloud block (Terraform >= 1.3) reads the outputs alone",
    )


async def current_head(request: web.Request, org: str, ws: str) -> tuple[Head | None, int]:
    """The workspace's head and its revision, after promoting a pending version whose
    event is recorded but whose head move a crash cut short (see the module's doc): a
    push's, or a run's once the run is over (as a run's state backend would: else the
    CLI would read, and push over, the state before what the run applied)."""
    states = tfe_of(request).need_states()
    try:
        head, revision = await states.head(org, ws)
        pending = await states.pending(org, ws)
        if pending is None or (head and head.object == pending.object):
            return head, revision
        if pending.run_id:
            if not await _run_recorded(request, org, ws, pending, head):
                return head, revision
        elif not await _promoted(request, org, ws, pending, head):
            return head, revision
        revision = await states.move_head(org, ws, pending, revision)
    except HeadMoved:  # another reader promoted it, or a writer moved on: theirs
        try:
            return await states.head(org, ws)
        except StateStoreError as e:
            raise TfeError(503, "unavailable", str(e)) from e
    except StateStoreError as e:
        raise TfeError(503, "unavailable", str(e)) from e
    log.warning("tfe_state_head_recovered", org=org, ws=ws, object=pending.object)
    await states.clear_pending(org, ws)
    return pending, revision


async def _promoted(
    request: web.Request, org: str, ws: str, pending: Head, head: Head | None
) -> bool:
    """Whether `pending` was decided by the last `ws.state_pushed`, which replaced
    `head`. The last one only: a rollback (`push -force` of an earlier version) names
    an object again, so an older event naming it says nothing of this pending mark
    (which may be a push that died before its event)."""
    was = head.object if head is not None else ""
    last = await last_pushed(request, org, ws)
    return last is not None and last.object == pending.object and last.previous == was


async def _run_recorded(
    request: web.Request, org: str, ws: str, pending: Head, head: Head | None
) -> bool:
    """Whether `pending` is a newer version its run recorded (`run.state_version`), of a
    run that is over: a live executor moves its own head, and a promotion under it
    would refuse its write (executor/statehead.py `current_head`, the same rule)."""
    newer = head is None or (pending.lineage == head.lineage and pending.serial > head.serial)
    if not newer:
        return False
    app = api_of(request).app
    loaded = await app.load_run(org, ws, pending.run_id, min_seq=LATEST)
    if not loaded.state.exists or not loaded.state.terminal:
        return False
    for envelope in await app.store.read(run_subject(org, ws, pending.run_id), min_seq=LATEST):
        event = envelope.event
        if isinstance(event, StateVersionCreated) and event.object == pending.object:
            return True
    return False


async def last_pushed(request: web.Request, org: str, ws: str) -> StatePushed | None:
    """The workspace's last `ws.state_pushed`, as the stream's leader has it."""
    subject = ws_subject(org, ws)
    for envelope in reversed(await api_of(request).app.store.read(subject, min_seq=LATEST)):
        if isinstance(envelope.event, StatePushed):
            return envelope.event
    return None


async def existing_workspace(request: web.Request, org: str, ws: str) -> dict[str, Any]:
    row = await api_of(request).read.workspaces.get(org, ws)
    if row is None:
        raise not_found(f"workspace {ws} not found in organization {org}")
    return row


async def recorded_at(request: web.Request, org: str, ws: str, head: Head) -> str | None:
    """When a run or a push recorded the version, as the read model knows it."""
    for row in await api_of(request).read.workspaces.state_versions(org, ws):
        if row["object"] == head.object:
            return _whole(str(row["created_at"]))
    return None


def _whole(at: str) -> str:
    """The read model's `...T12:00:00.123456Z` in whole seconds, as go-tfe parses it."""
    return at.split(".", 1)[0].removesuffix("Z") + "Z"


async def current_state_version(request: web.Request) -> web.Response:
    """GET /workspaces/:id/current-state-version: 404 when the workspace has no state
    (the CLI then starts from none); 403 for a viewer (its one use is the whole state)."""
    org, ws, who = await workspace_by_id(request, "workspace.read")
    await existing_workspace(request, org, ws)
    await refuse_whole_state(request, org, ws, who)
    head, _ = await current_head(request, org, ws)
    if head is None:
        raise not_found(f"workspace {ws} has no state yet")
    created = await recorded_at(request, org, ws, head)
    return response(
        document(render(request, org, ws, head, created, await may_read_state(request, org, ws)))
    )


async def version_of(
    request: web.Request, org: str, ws: str, serial: int, prefix: str
) -> tuple[Head, str | None]:
    """The version of a state version id (the head, or one the read model recorded)
    and when it was recorded; 404 if none."""
    head, _ = await current_head(request, org, ws)
    if head is not None and (head.serial, head.digest[:16]) == (serial, prefix):
        return head, await recorded_at(request, org, ws, head)
    for row in await api_of(request).read.workspaces.state_versions(org, ws):
        if (row["serial"], row["digest"][:16]) == (serial, prefix):
            old = Head(
                object=row["object"],
                serial=row["serial"],
                lineage=row["lineage"],
                digest=row["digest"],
                size=row["size"],
                run_id=row["run_id"] or "",
            )
            return old, _whole(row["created_at"])
    raise not_found(f"state version sv-{org}.{ws}.{serial}.{prefix} not found")


async def read_state_version(request: web.Request) -> web.Response:
    """GET /state-versions/:id: the current version, or one a run or push recorded;
    its metadata to a viewer, its download URL only to those who may read state."""
    org, ws, serial, prefix = ids.parse_state_version_id(request.match_info["sv_id"])
    await require(request, org, "workspace.read", ws)
    await existing_workspace(request, org, ws)
    version, created = await version_of(request, org, ws, serial, prefix)
    return response(
        document(render(request, org, ws, version, created, await may_read_state(request, org, ws)))
    )


async def download(request: web.Request) -> web.Response:
    """GET <hosted-state-download-url>: the clear state of the one version the
    capability names, whatever Authorization the request carries (none is needed)."""
    signer = tfe_of(request).need_signer()
    try:
        org, granted, holder = signer.verify_held(request.match_info["token"], KIND)
    except CapabilityError as e:
        raise TfeError(404, "not found", "no such state version (or the link expired)") from e
    name, _, digest = granted.rpartition("@")
    if not name.startswith(f"{org}/"):  # signed by us for one org's object: never else
        raise TfeError(404, "not found", "no such state version (or the link expired)")
    if not await still_may(request, org, holder, "state.read", name.split("/")[1]):
        raise TfeError(404, "not found", "no such state version (or the link expired)")
    states = tfe_of(request).need_states()
    try:
        data = await states.read(Head(object=name, serial=0, digest=digest))
    except StateStoreError as e:
        log.warning("tfe_state_download_failed", error=str(e))
        raise TfeError(503, "unavailable", "the state version cannot be read now") from e
    return web.Response(body=data, content_type="application/json")
