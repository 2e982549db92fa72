"""Helpers every handler shares: path ids, access checks, JSON answers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec
import structlog
from aiohttp import web

from events.org import OrgState
from services.surfaces.api.auth import PRINCIPAL, Principal
from services.surfaces.api.bodies import check_name
from services.surfaces.api.context import API, Api
from services.surfaces.api.problems import Problem

log = structlog.get_logger("runplane.api")

SEQ_HEADER = "RP-Seq"
Row = dict[str, Any]
_encoder = msgspec.json.Encoder()


def json_response(
    data: Any, *, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    return web.Response(
        status=status,
        body=_encoder.encode(data),
        content_type="application/json",
        headers=dict(headers or {}),
    )


def items(rows: list[Row], **extra: Any) -> web.Response:
    return json_response({"items": rows, **extra})


def path_id(request: web.Request, key: str) -> str:
    """A validated id from the path (org, ws, run): they become NATS subject tokens."""
    return check_name(key, request.match_info[key])


def scope(request: web.Request, role: str) -> tuple[Api, str, Principal]:
    """The api, the path's organization and the caller, once the caller may act there."""
    org = path_id(request, "org")
    who = request[PRINCIPAL]
    who.require(org, role)
    return request.app[API], org, who


async def org_state(api: Api, org: str) -> OrgState:
    """The organization's aggregate (folders, groups, settings, templates, policies):
    404 if it does not exist."""
    state: OrgState = (await api.app.load_org(org)).state
    if not state.exists:
        raise Problem("not-found", f"organization {org} not found")
    return state


def command_answer(row: Row, seq: int, *, status: int = 200, location: str = "") -> web.Response:
    """A command's answer from its own result: the row, RP-Seq, and a Location if given."""
    headers = {SEQ_HEADER: str(seq)}
    if location:
        headers["Location"] = location
    return json_response(row, status=status, headers=headers)


async def written(
    api: Api,
    seq: int,
    fresh: Callable[[], Awaitable[Row | None]],
    fallback: Callable[[], Row],
    *,
    status: int,
    location: str = "",
) -> web.Response:
    """Answer a command: the projected resource once the projection holds the write.

    `fresh` reads the projection; `fallback` renders the command's own result, used only
    when the projection lags beyond the bound (the write stands: answering an error would
    invite a retry that writes twice).
    """
    body = None
    if await api.after_write(seq):
        try:
            body = await fresh()
        except Exception as e:  # noqa: BLE001 - e.g. NATS gone right after the append
            # The write stands whatever failed while reading it back: answer it anyway.
            log.warning("written_answer_fallback", seq=seq, error=repr(e))
    headers = {SEQ_HEADER: str(seq)}
    if location:
        headers["Location"] = location
    return json_response(body if body is not None else fallback(), status=status, headers=headers)
