"""State versions through the TFE API, on the very state runplane's runs read and write.

The head pointer, the sealed versions and the run's state lock are
executor/statestore.py's: a version pushed here is what the next run plans on, and a
version a run wrote is what `terraform state pull` gets.

Who reads what (HCP Terraform's "read state versions" against "read state outputs"):
the whole state, secrets and all, goes only to an operator or admin: the
`hosted-state-download-url` of a version is minted for them alone, and
`current-state-version` (what `state pull` and every state read of the CLI's backend
start from) answers a viewer 403 saying so. A viewer reads a version's metadata
(`GET /state-versions/:id`, no download URL) and the outputs (services/tfe/outputs.py).
runplane's own API never serves a whole state.

A push is taken only:

- from the holder of the workspace's lock (the CLI locks before it writes; runplane's
  lock also keeps runs from being admitted meanwhile), with no run active and no run
  holding the state lock;
- with the serial and lineage the state itself says and the md5 it was sent with;
- continuing the current state: the same lineage and a higher serial, unless the CLI
  says `force` (`terraform state push -force`), as Terraform's own backends refuse;
- with the head still where it was read (optimistic: another writer wins, this one 409s).

A push is recorded as `ws.state_pushed` (events/workspace.py) before the head moves:
the event is the decision (the workspace aggregate checks, on its own subject and at
the moment of the append, that the pusher holds the lock, that no run is active and
that no other push landed since the head was read), and the head follows it. Between
the two the version is marked pending (as a run's is, executor/statebackend.py): a
crash there leaves an event whose head has not moved, and the next reader of the state
promotes the pending version if, and only if, its event is recorded and names the
current head as the one it replaced (`_promoted`). So no head moves without its event,
and no event stays without its head but one whose head was moved meanwhile by a writer
outside these rules (logged as `tfe_state_head_moved`; the event's `previous` shows it).
A refused push (a stale serial, no lock) writes no event.

The state is downloaded from a capability URL (services/tfe/capability.py) scoped to the
one version and living `DOWNLOAD_TTL_S`.

Not yet here: newer clients' upload URLs (`hosted-state-upload-url`): a version without
an inline `state` is refused with a 422 that says so.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
from collections.abc import AsyncIterator
from datetime import UTC
from typing import Any

import structlog
from aiohttp import web

from events.codec import ws_subject
from events.errors import DomainError
from events.org import ROLES
from events.workspace import RecordStatePush, StatePushed
from executor.statestore import Head, HeadMoved, StateStore, StateStoreError, parse_state
from services.api.auth import OPERATOR, VIEWER, Principal
from services.infra.eventstore import LATEST
from services.tfe import ids
from services.tfe.capability import CapabilityError
from services.tfe.context import api_of, read_json, require, tfe_of
from services.tfe.jsonapi import (
    Doc,
    TfeError,
    attributes,
    document,
    not_found,
    resource,
    response,
)
from services.tfe.workspaces import workspace_by_id

log = structlog.get_logger("runplane.tfe")

KIND = "state"
DOWNLOAD_TTL_S = 600
DOWNLOAD_PATH = "/api/v2/capabilities/state/"
_RANK = {role: i for i, role in enumerate(ROLES)}


def may_read_state(who: Principal) -> bool:
    """Whether the caller may read whole states (and sensitive outputs' values): an
    operator or admin of the organization (the caller's organization is checked first)."""
    return who.superuser or _RANK.get(who.role, -1) >= _RANK[OPERATOR]


def _download_url(request: web.Request, org: str, head: Head) -> str:
    signer = tfe_of(request).need_signer()
    token = signer.sign(KIND, org, f"{head.object}@{head.digest}", DOWNLOAD_TTL_S)
    return f"{request.url.origin()}{DOWNLOAD_PATH}{token}"


def render(
    request: web.Request, org: str, ws: str, head: Head, created_at: str | None, who: Principal
) -> Doc:
    """A state version as go-tfe's `StateVersion`. A version the CLI pushed is shown with
    the time its event was recorded, or the present one before the read model has it
    (go-tfe wants a time there). The download URL only for those who may read state."""
    if created_at is None:
        now = api_of(request).app.clock()
        created_at = now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    url = _download_url(request, org, head) if may_read_state(who) else None
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


def refuse_whole_state(who: Principal) -> None:
    """403 unless the caller may read whole states: the detail is what the CLI prints."""
    if may_read_state(who):
        return
    raise TfeError(
        403,
        "state not readable with this role",
        f"role {who.role} may read this workspace's outputs but not its whole state "
        "(`terraform state pull`, and the remote backend's every state read, need the "
        "operator or admin role); `terraform output` of a cloud block (Terraform >= 1.3) "
        "reads the outputs alone",
    )


async def current_head(request: web.Request, org: str, ws: str) -> tuple[Head | None, int]:
    """The workspace's head and its revision, after promoting a pushed version whose
    event is recorded but whose head move a crash cut short (see the module's doc)."""
    states = tfe_of(request).need_states()
    try:
        head, revision = await states.head(org, ws)
        pending = await states.pending(org, ws)
        if pending is None or pending.run_id or (head and head.object == pending.object):
            return head, revision
        if not await _promoted(request, org, ws, pending, head):
            return head, revision
        revision = await states.move_head(org, ws, pending, revision)
    except HeadMoved:
        return await current_head(request, org, ws)
    except StateStoreError as e:
        raise TfeError(503, "unavailable", str(e)) from e
    log.warning("tfe_state_head_recovered", org=org, ws=ws, object=pending.object)
    await states.clear_pending(org, ws)
    return pending, revision


async def _promoted(
    request: web.Request, org: str, ws: str, pending: Head, head: Head | None
) -> bool:
    """Whether `pending` was decided by a `ws.state_pushed` that replaced `head`."""
    was = head.object if head is not None else ""
    subject = ws_subject(org, ws)
    for envelope in await api_of(request).app.store.read(subject, min_seq=LATEST):
        event = envelope.event
        if isinstance(event, StatePushed) and event.object == pending.object:
            return event.previous == was
    return False


async def _existing(request: web.Request, org: str, ws: str) -> dict[str, Any]:
    row = await api_of(request).read.get_workspace(org, ws)
    if row is None:
        raise not_found(f"workspace {ws} not found in organization {org}")
    return row


async def _created_at(request: web.Request, org: str, ws: str, head: Head) -> str | None:
    """When a run or a push recorded the version, as the read model knows it."""
    for row in await api_of(request).read.state_versions(org, ws):
        if row["object"] == head.object:
            return _whole(str(row["created_at"]))
    return None


def _whole(at: str) -> str:
    """The read model's `...T12:00:00.123456Z` in whole seconds, as go-tfe parses it."""
    return at.split(".", 1)[0].removesuffix("Z") + "Z"


async def current_state_version(request: web.Request) -> web.Response:
    """GET /workspaces/:id/current-state-version: 404 when the workspace has no state
    (the CLI then starts from none); 403 for a viewer (its one use is the whole state)."""
    org, ws, who = await workspace_by_id(request, VIEWER)
    await _existing(request, org, ws)
    refuse_whole_state(who)
    head, _ = await current_head(request, org, ws)
    if head is None:
        raise not_found(f"workspace {ws} has no state yet")
    created = await _created_at(request, org, ws, head)
    return response(document(render(request, org, ws, head, created, who)))


async def version_of(
    request: web.Request, org: str, ws: str, serial: int, prefix: str
) -> tuple[Head, str | None]:
    """The version of a state version id (the head, or one the read model recorded)
    and when it was recorded; 404 if none."""
    head, _ = await current_head(request, org, ws)
    if head is not None and (head.serial, head.digest[:16]) == (serial, prefix):
        return head, await _created_at(request, org, ws, head)
    for row in await api_of(request).read.state_versions(org, ws):
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
    who = require(request, org, VIEWER)
    await _existing(request, org, ws)
    version, created = await version_of(request, org, ws, serial, prefix)
    return response(document(render(request, org, ws, version, created, who)))


async def download(request: web.Request) -> web.Response:
    """GET <hosted-state-download-url>: the clear state of the one version the
    capability names, whatever Authorization the request carries (none is needed)."""
    signer = tfe_of(request).need_signer()
    try:
        org, granted = signer.verify(request.match_info["token"], KIND)
    except CapabilityError as e:
        raise TfeError(404, "not found", "no such state version (or the link expired)") from e
    name, _, digest = granted.rpartition("@")
    if not name.startswith(f"{org}/"):  # signed by us for one org's object: never else
        raise TfeError(404, "not found", "no such state version (or the link expired)")
    states = tfe_of(request).need_states()
    try:
        data = await states.read(Head(object=name, serial=0, digest=digest))
    except StateStoreError as e:
        log.warning("tfe_state_download_failed", error=str(e))
        raise TfeError(503, "unavailable", "the state version cannot be read now") from e
    return web.Response(body=data, content_type="application/json")


# ---------------------------------------------------------------- push


def _decode_state(attrs: dict[str, Any]) -> tuple[bytes, int, str, bool]:
    """The state sent, checked against what the request says of it."""
    encoded = attrs.get("state")
    if encoded is None:
        # go-tfe (>= 1.x) reads this very phrase as "upload URLs not supported" and the
        # CLI then sends the state inline
        raise TfeError(
            422,
            "state required",
            "param is missing or the value is empty: state (send it inline, base64: "
            "this server does not hand out state upload URLs yet)",
        )
    if not isinstance(encoded, str):
        raise TfeError(422, "invalid attribute", "state must be a base64 string")
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as e:
        raise TfeError(422, "invalid attribute", "state is not valid base64") from e
    md5 = attrs.get("md5")
    if not isinstance(md5, str) or hashlib.md5(data, usedforsecurity=False).hexdigest() != md5:
        raise TfeError(422, "invalid attribute", "md5 does not match the state sent")
    try:
        serial, lineage = parse_state(data)
    except ValueError as e:
        raise TfeError(422, "invalid attribute", f"state is not a Terraform state: {e}") from e
    if attrs.get("serial") != serial:
        raise TfeError(422, "invalid attribute", f"serial must be the state's own ({serial})")
    if attrs.get("lineage") not in (None, lineage):
        raise TfeError(422, "invalid attribute", "lineage must be the state's own")
    return data, serial, lineage, attrs.get("force") is True


def _continues(head: Head | None, serial: int, lineage: str, digest: str, force: bool) -> None:
    """409 unless the new state continues the current one (or `force`)."""
    if head is None or force:
        return
    if lineage != head.lineage:
        raise TfeError(
            409,
            "lineage mismatch",
            f"the state's lineage {lineage!r} is not the workspace's ({head.lineage!r}); "
            "push -force to replace it",
        )
    if serial <= head.serial and digest != head.digest:
        raise TfeError(
            409,
            "serial not newer",
            f"the state's serial {serial} is not above the workspace's ({head.serial})",
        )


class _Gate:
    """One organization's state pushes, one at a time."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


PUSHES: web.AppKey[dict[str, _Gate]] = web.AppKey("runplane.tfe.pushes", dict)


@contextlib.asynccontextmanager
async def _one_push_at_a_time(request: web.Request, org: str) -> AsyncIterator[None]:
    """A push holds its body (up to MAX_BODY), its decoding and its state at once: one
    organization's many concurrent pushes would fill the API process every organization
    shares. Another organization's waits for none of them."""
    gates = request.app[PUSHES]
    gate = gates.setdefault(org, _Gate())
    gate.users += 1
    try:
        async with gate.lock:
            yield
    finally:
        gate.users -= 1
        if not gate.users:
            del gates[org]


def _writable(row: dict[str, Any], who: Principal) -> None:
    lock = row.get("lock")
    if lock is None or lock.get("holder") != who.user:
        raise TfeError(409, "workspace not locked", "lock the workspace before writing its state")
    if row.get("active_run"):
        raise TfeError(409, "run active", f"run {row['active_run']} is active on the workspace")


async def create_state_version(request: web.Request) -> web.Response:
    """POST /workspaces/:id/state-versions {serial, md5, lineage, state, force}: the
    lock's holder only, which is checked before the body is read."""
    org, ws, who = await workspace_by_id(request, OPERATOR)
    states = tfe_of(request).need_states()
    _writable(await _existing(request, org, ws), who)
    async with _one_push_at_a_time(request, org):
        return await _push(request, org, ws, who, states)


async def _push(
    request: web.Request, org: str, ws: str, who: Principal, states: StateStore
) -> web.Response:
    data, serial, lineage, force = _decode_state(
        attributes(await read_json(request), "state-versions")
    )
    _writable(await _existing(request, org, ws), who)
    try:
        holder, _ = await states.holder(org, ws)
    except StateStoreError as e:
        raise TfeError(503, "unavailable", str(e)) from e
    if holder is not None:
        raise TfeError(409, "state locked", f"run {holder.run_id} holds the state lock")
    head, revision = await current_head(request, org, ws)
    digest = hashlib.sha256(data).hexdigest()
    _continues(head, serial, lineage, digest, force)
    if head is not None and head.digest == digest:
        created = await _created_at(request, org, ws, head)
        return response(document(render(request, org, ws, head, created, who)), status=201)
    try:
        version = await states.put_version(org, ws, data)
        await states.mark_pending(org, ws, version)
    except StateStoreError as e:
        raise TfeError(503, "unavailable", str(e)) from e
    seq = await _record(request, org, ws, who, version, head, force)
    await _move(request, org, ws, version, revision)
    log.info("tfe_state_pushed", org=org, ws=ws, serial=serial, user=who.user, force=force)
    await api_of(request).after_write(seq)
    created = await _created_at(request, org, ws, version)
    return response(document(render(request, org, ws, version, created, who)), status=201)


async def _record(
    request: web.Request,
    org: str,
    ws: str,
    who: Principal,
    version: Head,
    head: Head | None,
    force: bool,
) -> int:
    """`ws.state_pushed`, decided on the workspace's own subject; refused (a lock lost,
    a run admitted, another push landed), the version is dropped and nothing recorded."""
    command = RecordStatePush(
        actor=who.user,
        serial=version.serial,
        lineage=version.lineage,
        digest=version.digest,
        object=version.object,
        size=version.size,
        previous=head.object if head is not None else "",
        forced=force,
    )
    states = tfe_of(request).need_states()
    try:
        result = await api_of(request).app.record_state_push(org, ws, command)
    except DomainError:
        await states.drop_version(version.object)
        await states.clear_pending(org, ws)
        raise
    # Any other failure leaves it unknown whether the event landed: the pending version
    # stays, and `current_head` promotes it only if its event is recorded.
    return int(result.seq)


async def _move(request: web.Request, org: str, ws: str, version: Head, revision: int) -> None:
    """The head to the recorded version, then the pending mark cleared."""
    states = tfe_of(request).need_states()
    try:
        await states.move_head(org, ws, version, revision)
    except HeadMoved as e:
        log.error("tfe_state_head_moved", org=org, ws=ws, object=version.object)
        raise TfeError(409, "state changed", "the workspace's state changed meanwhile") from e
    except StateStoreError as e:
        # recorded but not moved: the next read promotes it (`current_head`)
        raise TfeError(503, "unavailable", str(e)) from e
    await states.clear_pending(org, ws)
