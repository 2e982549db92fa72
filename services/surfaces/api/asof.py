"""`?as_of=<sequence | RFC 3339 time>`: a run, a workspace, its state versions and the
organization's runs as the API answered them once the stream held that sequence.

The caller's access is checked first, exactly as for the live answer and by today's rule
(`scope`, events/access.py): a grant given after the moment does not hide the past, a
grant revoked before now hides it (what a caller may read is who they are now, not who
they were). The answer comes from a scratch read model (projections/asof.py): a run's,
a workspace's, its state versions' and its runs' from that workspace's own history, the
organization's runs from the organization's; never from another organization's events.

Every other runplane API route refuses `as_of` (400 `as-of-unsupported`, naming those
that take it: `SUPPORTED`), in one middleware before any handler runs
(services/surfaces/api/middleware.py): a read ignoring it would be taken for the past,
a command must never run under it.

What an answer holds that is not in the event log is left out, and named in
`as_of_omitted`: a run's `owner` and `deadline` (the heartbeat board), a workspace's
`secret_variables` (the secret store). Every answer carries `as_of_seq` (and the
`RP-As-Of-Seq` header): the stream sequence it is as of.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import nats.errors
from aiohttp import web
from nats.aio.client import Client as NATS

from events.codec import org_subject, ws_subject
from events.org import OrgState
from events.org import fold as fold_org
from events.workspace import WorkspaceState
from events.workspace import fold as fold_ws
from infra.directget import InfraError
from projections.asof import AsOfError, Bounds, PastModels, TooCostly
from projections.readmodel import ReadModel
from services.surfaces.api.common import Row, json_response
from services.surfaces.api.context import API
from services.surfaces.api.paths import ORG, RUN, V1, WS
from services.surfaces.api.problems import Problem, run_removed
from services.surfaces.api.rollback import with_ids

PAST: web.AppKey[PastModels] = web.AppKey("runplane.as_of", PastModels)
AS_OF = "as_of"
SEQ_HEADER = "RP-As-Of-Seq"
RUN_OMITTED = ("owner", "deadline")  # projections/liveness.py: the heartbeat board
WS_OMITTED = ("secret_variables",)  # the secret store
# The routes (GET) that answer as of a moment; every other API route refuses `as_of`.
SUPPORTED = (RUN, WS, WS + "/settings", WS + "/state-versions", ORG + "/runs", WS + "/runs")


# The query parameter, in the API reference (listed with settings.PARAMETERS).
PARAMETER: dict[str, Any] = {
    "name": AS_OF,
    "in": "query",
    "required": False,
    "description": "the answer as it was once the event stream held this sequence, or at "
    "this RFC 3339 time (its offset required); it carries as_of_seq and as_of_omitted (the "
    "fields not in the event log, left out); 422 invalid-as-of, 503 as-of-too-costly",
    "schema": {"type": "string"},
}


def mount(web_app: web.Application, nc: NATS, bounds: Bounds) -> None:
    """The app's scratch models, closed (and their files removed) with it."""
    web_app[PAST] = models = PastModels(
        nc, max_models=bounds.models, max_events=bounds.events, max_held=bounds.held,
        per_minute=bounds.per_minute,
    )  # fmt: skip
    web_app.on_cleanup.append(lambda _: models.close())


def asked(request: web.Request) -> bool:
    return AS_OF in request.query


def refuse_unsupported(request: web.Request) -> None:
    """400 `as-of-unsupported` for `as_of` on a runplane API route (`/api/v1/...`) that
    does not take it: it would be silently ignored and today's answer taken for the past,
    and a command must never run under it. The web UI's and the TFE API's routes (whose
    clients never send it) are not this API's, and unmatched paths stay 404."""
    if not asked(request):
        return
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else ""
    if not route.startswith(V1 + "/"):
        return
    if request.method == "GET" and route in SUPPORTED:
        return
    raise Problem(
        "as-of-unsupported",
        f"{request.method} {route} answers only the present: as_of is taken by GET on "
        + ", ".join(SUPPORTED),
        supported=[f"GET {r}" for r in SUPPORTED],
    )


@contextlib.asynccontextmanager
async def past(
    request: web.Request, org: str, ws: str | None = None, *, seq: int = 0
) -> AsyncIterator[tuple[ReadModel, int]]:
    """The organization's read model as of the request's `as_of` (or `seq`, resolved
    already), and its sequence; with `ws`, one folded from that workspace's history
    (projections/asof.py `subjects`), which answers that workspace's questions alone."""
    models = request.app[PAST]
    try:
        seq = seq or await models.resolve(request.query[AS_OF])
        async with models.at(org, seq, ws) as read:
            yield read, seq
    except TooCostly as e:
        raise Problem(e.slug, str(e), headers={"Retry-After": "1"}) from None
    except AsOfError as e:
        raise Problem(e.slug, str(e)) from None
    except (nats.errors.Error, TimeoutError) as e:
        raise Problem("unavailable", f"the event stream is out of reach: {e!r}") from None


async def aggregates(
    request: web.Request, org: str, ws: str
) -> tuple[OrgState, WorkspaceState, int]:
    """The organization's and the workspace's aggregates folded from their own subjects up
    to the request's `as_of` (what `GET .../settings` answers from, live), and the
    sequence. Read as of a stream at least at that sequence (the leader finishes a read
    a replica behind could not)."""
    models = request.app[PAST]
    try:
        seq = await models.resolve(request.query[AS_OF])
        store = request.app[API].app.store
        org_events = await store.read(org_subject(org), min_seq=seq)
        ws_events = await store.read(ws_subject(org, ws), min_seq=seq)
    except AsOfError as e:
        raise Problem(e.slug, str(e)) from None
    except (nats.errors.Error, InfraError, TimeoutError) as e:
        raise Problem("unavailable", f"the event stream is out of reach: {e!r}") from None
    org_state = fold_org([e.event for e in org_events if e.seq <= seq])  # type: ignore[misc]
    ws_state = fold_ws([e.event for e in ws_events if e.seq <= seq])  # type: ignore[misc]
    if not org_state.exists:
        raise Problem("not-found", f"organization {org} not found as of {seq}")
    if not ws_state.exists:
        raise Problem("not-found", f"workspace {ws} not found as of {seq}")
    return org_state, ws_state, seq


def answer(body: dict[str, Any], seq: int, omitted: tuple[str, ...] = ()) -> web.Response:
    return json_response(
        {**body, "as_of_seq": seq, "as_of_omitted": list(omitted)},
        headers={SEQ_HEADER: str(seq)},
    )


def _run(row: Row) -> Row:
    return {k: v for k, v in row.items() if k not in RUN_OMITTED}


async def _sequence(request: web.Request) -> int:
    try:
        return await request.app[PAST].resolve(request.query[AS_OF])
    except AsOfError as e:
        raise Problem(e.slug, str(e)) from None
    except (nats.errors.Error, InfraError, TimeoutError) as e:
        raise Problem("unavailable", f"the event stream is out of reach: {e!r}") from None


async def run(request: web.Request, org: str, run_id: str) -> web.Response:
    """The run from its workspace's model (its workspace: its first event's subject, at
    the stream's leader); a run that did not exist then is 404 without folding a thing."""
    seq = await _sequence(request)
    try:
        ws = await request.app[PAST].run_workspace(org, run_id, seq)
    except (nats.errors.Error, InfraError, TimeoutError) as e:
        raise Problem("unavailable", f"the event stream is out of reach: {e!r}") from None
    if ws is None:
        raise Problem("not-found", f"run {run_id} not found as of {seq}")
    async with past(request, org, ws, seq=seq) as (read, seq):
        row = await read.runs.get(org, run_id)
        removed = None if row is not None else await read.runs.removed_at(org, run_id)
    if removed is not None:  # as GET answered then (services/surfaces/api/removed.py)
        raise run_removed(run_id, removed)
    if row is None:
        raise Problem("not-found", f"run {run_id} not found as of {seq}")
    return answer(_run(row), seq, RUN_OMITTED)


async def workspace(request: web.Request, org: str, ws: str) -> web.Response:
    async with past(request, org, ws) as (read, seq):
        row = await read.workspaces.get(org, ws)
    if row is None:
        raise Problem("not-found", f"workspace {ws} not found as of {seq}")
    return answer(row, seq, WS_OMITTED)


async def state_versions(request: web.Request, org: str, ws: str) -> web.Response:
    async with past(request, org, ws) as (read, seq):
        if await read.workspaces.get(org, ws) is None:
            raise Problem("not-found", f"workspace {ws} not found as of {seq}")
        rows = await read.workspaces.state_versions(org, ws)
    return answer({"items": with_ids(org, ws, rows)}, seq)


async def runs(
    request: web.Request, org: str, filters: dict[str, Any], readable: set[str] | None
) -> web.Response:
    """A page of the organization's runs (of `filters["workspace"]` if given), newest
    first, as `GET .../runs` answered it; `readable`: the workspaces the caller may read
    today (None: all). A workspace's page is read from its own model, unless its cursor
    (`before`) is not one of its runs then: the organization's model places that."""
    ws = filters.get("workspace")
    seq = await _sequence(request)
    async with past(request, org, ws, seq=seq) as (read, seq):
        cursor = filters.get("before")
        if ws is None or cursor is None or await read.runs.workspace_of(org, cursor) == ws:
            return await _page(read, seq, org, filters, readable)
    async with past(request, org, seq=seq) as (read, seq):
        return await _page(read, seq, org, filters, readable)


async def _page(
    read: ReadModel, seq: int, org: str, filters: dict[str, Any], readable: set[str] | None
) -> web.Response:
    if await read.orgs.get(org) is None:
        raise Problem("not-found", f"organization {org} not found as of {seq}")
    ws = filters.get("workspace")
    if ws is not None and await read.workspaces.get(org, ws) is None:
        raise Problem("not-found", f"workspace {ws} not found as of {seq}")
    rows = await read.runs.find(org, **filters)
    page_full = len(rows) == filters["limit"]
    after = rows[-1]["id"] if page_full and rows else None
    if readable is not None:
        rows = [r for r in rows if r["workspace"] in readable]
    return answer({"items": [_run(r) for r in rows], "next": after}, seq, RUN_OMITTED)
