"""State versions through the TFE API, on the very state runplane's runs read and write.

The head pointer, the sealed versions and the run's state lock are
executor/statestore.py's: a version pushed here is what the next run plans on, and a
version a run wrote is what `terraform state pull` gets. A push is taken only:

- from the holder of the workspace's lock (the CLI locks before it writes; runplane's
  lock also keeps runs from being admitted meanwhile), with no run active and no run
  holding the state lock;
- with the serial and lineage the state itself says and the md5 it was sent with;
- continuing the current state: the same lineage and a higher serial, unless the CLI
  says `force` (`terraform state push -force`), as Terraform's own backends refuse;
- with the head still where it was read (optimistic: another writer wins, this one 409s).

The state is downloaded from a capability URL (services/tfe/capability.py) scoped to the
one version and living `DOWNLOAD_TTL_S`.

Not yet here: versions pushed by the CLI are not recorded as events (runs' versions are,
`run.state_version`), so runplane's own `GET .../state-versions` lists only runs'; and
newer clients' upload URLs (`hosted-state-upload-url`): a version without an inline
`state` is refused with a 422 that says so.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import json
from collections.abc import AsyncIterator
from datetime import UTC
from typing import Any

import structlog
from aiohttp import web

from executor.statestore import Head, HeadMoved, StateStore, StateStoreError, parse_state
from services.api.auth import OPERATOR, VIEWER, Principal
from services.tfe import ids
from services.tfe.capability import CapabilityError
from services.tfe.context import api_of, read_json, require, tfe_of
from services.tfe.jsonapi import (
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
from services.tfe.workspaces import workspace_by_id

log = structlog.get_logger("runplane.tfe")

KIND = "state"
DOWNLOAD_TTL_S = 600
DOWNLOAD_PATH = "/api/v2/capabilities/state/"


def _download_url(request: web.Request, org: str, head: Head) -> str:
    signer = tfe_of(request).need_signer()
    token = signer.sign(KIND, org, f"{head.object}@{head.digest}", DOWNLOAD_TTL_S)
    return f"{request.url.origin()}{DOWNLOAD_PATH}{token}"


def render(request: web.Request, org: str, ws: str, head: Head, created_at: str | None) -> Doc:
    """A state version as go-tfe's `StateVersion`. A version the CLI pushed has no
    recorded time: it is shown with the present one (go-tfe wants a time there)."""
    if created_at is None:
        now = api_of(request).app.clock()
        created_at = now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    attrs = {
        "serial": head.serial,
        "lineage": head.lineage,
        "size": head.size,
        "created-at": created_at,
        "status": "finalized",
        "resources-processed": True,
        "vcs-commit-sha": None,
        "vcs-commit-url": None,
        "hosted-state-download-url": _download_url(request, org, head),
    }
    rels: dict[str, Any] = {
        "run": ("runs", head.run_id) if head.run_id else None,
        "workspace": ("workspaces", ids.workspace_id(org, ws)),
        "outputs": {"data": []},
    }
    sv_id = ids.state_version_id(org, ws, head.serial, head.digest)
    return resource("state-versions", sv_id, attrs, rels)


async def _head(request: web.Request, org: str, ws: str) -> tuple[Head | None, int]:
    try:
        return await tfe_of(request).need_states().head(org, ws)
    except StateStoreError as e:
        raise TfeError(503, "unavailable", str(e)) from e


async def _existing(request: web.Request, org: str, ws: str) -> dict[str, Any]:
    row = await api_of(request).read.get_workspace(org, ws)
    if row is None:
        raise not_found(f"workspace {ws} not found in organization {org}")
    return row


async def _created_at(request: web.Request, org: str, ws: str, head: Head) -> str | None:
    """When a run recorded the version (the read model knows runs' versions only)."""
    for row in await api_of(request).read.state_versions(org, ws):
        if row["object"] == head.object:
            return _whole(str(row["created_at"]))
    return None


def _whole(at: str) -> str:
    """The read model's `...T12:00:00.123456Z` in whole seconds, as go-tfe parses it."""
    return at.split(".", 1)[0].removesuffix("Z") + "Z"


async def current_state_version(request: web.Request) -> web.Response:
    """GET /workspaces/:id/current-state-version: 404 when the workspace has no state
    (the CLI then starts from none)."""
    org, ws, _ = await workspace_by_id(request, VIEWER)
    await _existing(request, org, ws)
    head, _ = await _head(request, org, ws)
    if head is None:
        raise not_found(f"workspace {ws} has no state yet")
    created = await _created_at(request, org, ws, head)
    return response(document(render(request, org, ws, head, created)))


async def read_state_version(request: web.Request) -> web.Response:
    """GET /state-versions/:id: the current version, or one a run recorded."""
    org, ws, serial, prefix = ids.parse_state_version_id(request.match_info["sv_id"])
    require(request, org, VIEWER)
    await _existing(request, org, ws)
    head, _ = await _head(request, org, ws)
    if head is not None and (head.serial, head.digest[:16]) == (serial, prefix):
        created = await _created_at(request, org, ws, head)
        return response(document(render(request, org, ws, head, created)))
    for row in await api_of(request).read.state_versions(org, ws):
        if (row["serial"], row["digest"][:16]) == (serial, prefix):
            old = Head(
                object=row["object"],
                serial=row["serial"],
                lineage=row["lineage"],
                digest=row["digest"],
                size=row["size"],
                run_id=row["run_id"],
            )
            return response(document(render(request, org, ws, old, _whole(row["created_at"]))))
    raise not_found(f"state version {request.match_info['sv_id']} not found")


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


async def current_outputs(request: web.Request) -> web.Response:
    """GET /workspaces/:id/current-state-version-outputs (the `cloud` block's `terraform
    output`): the current state's root outputs by name. `detailed-type` is null, so the
    CLI reads the whole state for their values (as it does with states from before 1.3),
    and no sensitive value is shown here."""
    org, ws, _ = await workspace_by_id(request, VIEWER)
    await _existing(request, org, ws)
    head, _ = await _head(request, org, ws)
    if head is None:
        raise not_found(f"workspace {ws} has no state yet")
    try:
        outputs = json.loads(await tfe_of(request).need_states().read(head)).get("outputs") or {}
    except StateStoreError as e:
        raise TfeError(503, "unavailable", "the state version cannot be read now") from e
    sv_id = ids.state_version_id(org, ws, head.serial, head.digest)
    items = [
        resource(
            "state-version-outputs",
            f"wsout-{sv_id.removeprefix('sv-')}.{i}",
            {
                "name": name,
                "sensitive": bool(out.get("sensitive")),
                "type": out.get("type") if isinstance(out.get("type"), str) else "object",
                "value": None if out.get("sensitive") else out.get("value"),
                "detailed-type": None,
            },
        )
        for i, (name, out) in enumerate(sorted(outputs.items()))
        if isinstance(out, dict)
    ]
    return response(listing(items, page_of(request)))


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
        head, revision = await states.head(org, ws)
    except StateStoreError as e:
        raise TfeError(503, "unavailable", str(e)) from e
    if holder is not None:
        raise TfeError(409, "state locked", f"run {holder.run_id} holds the state lock")
    digest = hashlib.sha256(data).hexdigest()
    _continues(head, serial, lineage, digest, force)
    if head is not None and head.digest == digest:
        return response(document(render(request, org, ws, head, None)), status=201)
    try:
        version = await states.put_version(org, ws, data)
        await states.move_head(org, ws, version, revision)
    except HeadMoved as e:
        await states.drop_version(version.object)
        raise TfeError(409, "state changed", "the workspace's state changed meanwhile") from e
    except StateStoreError as e:
        raise TfeError(503, "unavailable", str(e)) from e
    log.info("tfe_state_pushed", org=org, ws=ws, serial=serial, user=who.user, force=force)
    return response(document(render(request, org, ws, version, None)), status=201)
