"""A workspace's current outputs through the TFE API: what a viewer may read of its state.

- `GET /workspaces/:id/current-state-version-outputs` (the `cloud` block's `terraform
  output`): the current state's root outputs, each with its `detailed-type` (the cty
  type Terraform wrote into the state), so a Terraform >= 1.3 needs nothing else: it
  never falls back to reading the whole state, which a viewer may not. A sensitive
  output's value is null in the list, as HCP Terraform answers;
- `GET /state-version-outputs/:id`: one output, which the CLI asks for each sensitive
  one. Its value only to those who may read state (services/surfaces/tfe/state.py,
  `may_read_state`: operator, approver or admin), as HCP Terraform's "read state versions"
  permission; to a viewer it is null (the CLI shows `<sensitive>`, `-json` shows null).

An output's id is `wsout-<org>.<ws>.<serial>.<digest16>.<name>`: its state version's id
and its name (a Terraform identifier: no dot), so it reads back without a lookup.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
from aiohttp import web

from executor.statestore import Head, StateStoreError
from services.surfaces.tfe import ids
from services.surfaces.tfe.context import require, tfe_of
from services.surfaces.tfe.jsonapi import (
    Doc,
    TfeError,
    document,
    listing,
    not_found,
    page_of,
    resource,
)
from services.surfaces.tfe.jsonapi import response as answer
from services.surfaces.tfe.state import current_head, existing_workspace, may_read_state, version_of
from services.surfaces.tfe.workspaces import workspace_by_id

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,127}$")


def output_id(org: str, ws: str, head: Head, name: str) -> str:
    sv = ids.state_version_id(org, ws, head.serial, head.digest).removeprefix("sv-")
    return f"wsout-{sv}.{name}"


def _parse_output_id(value: str) -> tuple[str, str, int, str, str]:
    """(org, ws, serial, digest prefix, name) of an output id; 404 if not one."""
    body = value.removeprefix("wsout-")
    sv, _, name = body.rpartition(".")
    if body == value or not _NAME.fullmatch(name):
        raise not_found(f"state version output {value!r} not found")
    try:
        return (*ids.parse_state_version_id(f"sv-{sv}"), name)
    except TfeError as e:
        raise not_found(f"state version output {value!r} not found") from e


def _simple_type(detailed: Any) -> str:
    """go-tfe's `type`: the cty type's kind in TFE's words."""
    kind = detailed[0] if isinstance(detailed, list) and detailed else detailed
    if kind in ("string", "number", "bool"):
        return str(kind)
    return "array" if kind in ("list", "set", "tuple") else "object"


def render_output(
    org: str, ws: str, head: Head, name: str, out: dict[str, Any], *, reveal: bool
) -> Doc:
    """One output; a sensitive one's value only if `reveal`."""
    sensitive = bool(out.get("sensitive"))
    detailed = out.get("type")
    attrs = {
        "name": name,
        "sensitive": sensitive,
        "type": _simple_type(detailed),
        "value": out.get("value") if reveal or not sensitive else None,
        "detailed-type": detailed if detailed is not None else None,
    }
    return resource("state-version-outputs", output_id(org, ws, head, name), attrs)


class _Outputs(msgspec.Struct):
    """A state's root outputs alone: msgspec skips every other member without making it
    into objects (a tenant's state of 2 million empty resources, 6 MiB, took 150 MB and
    the event loop every organization shares as `json.loads`)."""

    outputs: Any = None


async def _outputs(request: web.Request, head: Head) -> dict[str, dict[str, Any]]:
    """The root outputs of a version's state, by name (bad entries skipped)."""
    try:
        data = await tfe_of(request).need_states().read(head)
    except StateStoreError as e:
        raise TfeError(503, "unavailable", "the state version cannot be read now") from e
    try:
        outputs = msgspec.json.decode(data, type=_Outputs).outputs
    except msgspec.DecodeError:
        return {}
    if not isinstance(outputs, dict):
        return {}
    return {k: v for k, v in outputs.items() if isinstance(v, dict) and _NAME.fullmatch(k)}


async def current_outputs(request: web.Request) -> web.Response:
    """GET /workspaces/:id/current-state-version-outputs: every sensitive value null."""
    org, ws, _ = await workspace_by_id(request, "workspace.read")
    await existing_workspace(request, org, ws)
    head, _ = await current_head(request, org, ws)
    if head is None:
        raise not_found(f"workspace {ws} has no state yet")
    outputs = await _outputs(request, head)
    items = [
        render_output(org, ws, head, name, out, reveal=False)
        for name, out in sorted(outputs.items())
    ]
    return answer(listing(items, page_of(request)))


async def read_output(request: web.Request) -> web.Response:
    """GET /state-version-outputs/:id: a sensitive value to those who may read state."""
    org, ws, serial, prefix, name = _parse_output_id(request.match_info["output_id"])
    await require(request, org, "workspace.read", ws)
    await existing_workspace(request, org, ws)
    version, _ = await version_of(request, org, ws, serial, prefix)
    out = (await _outputs(request, version)).get(name)
    if out is None:
        raise not_found(f"state version output {request.match_info['output_id']!r} not found")
    doc = render_output(org, ws, version, name, out, reveal=await may_read_state(request, org, ws))
    return answer(document(doc))
