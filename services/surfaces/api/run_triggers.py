"""Run triggers over HTTP: workspace B follows workspace A (events/run_triggers.py).

- `POST .../workspaces/{B}/run-triggers {"source": "A"}` (org admin): B follows A; 201,
  Location `.../run-triggers/A`. 404 if either is not a workspace of the organization,
  409 if B follows A already, 422 `run-trigger-cycle` naming the cycle it would close
  (`cycle`: `["a", "b", "c", "a"]`), 422 `run-trigger-limit` past a cap.
- `GET .../workspaces/{B}/run-triggers` (viewer): what B follows (`sources`) and what
  follows B (`followers`), read from the graph's own subject as the stream's leader has
  it (a trigger just added is listed, whichever replica answers).
- `DELETE .../workspaces/{B}/run-triggers/{A}` (org admin): B no longer follows A; 204.

Writing a trigger is an admin's, as a workspace's settings are: it makes one
workspace's applies start runs in another (and with `auto_apply_run_triggers`, apply
them), which is configuration, not a run.

Nothing here tells a caller of a workspace it may not read (events/access.py): a source
it may not read is 404 exactly as a missing one, at creation and at deletion; a list
leaves out the sources and followers it may not read; a cycle names those as
`(hidden)`. A trigger gives the follower nothing of its source (no output, no state:
a triggered run reads only its own workspace), and its run's cause names the source.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

import msgspec
from aiohttp import web

from events import run_triggers as rt
from events.codec import ID_RE
from infra.eventstore import LATEST
from services.processes.triggers import graph
from services.surfaces.api.bodies import Body, check_name, read_body
from services.surfaces.api.common import (
    SEQ_HEADER,
    json_response,
    path_id,
    readable,
    require_on,
    scope,
)
from services.surfaces.api.problems import Problem
from services.surfaces.api.schemas import ID, REF, SEQ_DOC, Doc, operation, problems

PREFIX = "/api/v1/orgs/{org}/workspaces/{ws}/run-triggers"
HIDDEN = "(hidden)"  # a workspace of a cycle the caller may not read


class RunTriggerBody(Body, frozen=True, kw_only=True):
    source: Annotated[
        str,
        msgspec.Meta(
            description="the workspace to follow: its changing applies start runs here",
            extra_json_schema={"pattern": ID_RE.pattern},
        ),
    ]


def _view(g: rt.TriggerGraph, ws: str, seen: Callable[[str], bool]) -> dict[str, object]:
    """What `ws` follows and what follows it, those the caller may read (`seen`)."""
    return {
        "workspace": ws,
        "sources": [{"workspace": s} for s in g.sources_of(ws) if seen(s)],
        "followers": [{"workspace": f} for f in g.followers_of(ws) if seen(f)],
    }


async def create_run_trigger(request: web.Request) -> web.Response:
    api, org, who = await scope(request, "workspace.settings")
    ws = path_id(request, "ws")
    body = await read_body(request, RunTriggerBody)
    source = check_name("source", body.source)
    await require_on(api, who, org, "workspace.read", source)  # never a way to probe
    try:
        g = await graph.add(api.app, org, ws, source, who.user)
    except rt.TriggerCycle as e:
        seen = await readable(api, who, org)
        cycle = [w if seen(w) else HIDDEN for w in e.cycle]
        detail = f"the run trigger would close a cycle: {' -> '.join(cycle)}"
        raise Problem("run-trigger-cycle", detail, cycle=cycle) from e
    except rt.TooManyTriggers as e:
        raise Problem("run-trigger-limit", str(e)) from e
    location = f"/api/v1/orgs/{org}/workspaces/{ws}/run-triggers/{source}"
    headers = {SEQ_HEADER: str(g.seq), "Location": location}
    view = _view(g.state, ws, await readable(api, who, org))
    return json_response(view, status=201, headers=headers)


async def list_run_triggers(request: web.Request) -> web.Response:
    api, org, who = await scope(request, "workspace.read")
    ws = path_id(request, "ws")
    if not (await api.app.load_ws(org, ws)).state.exists:
        raise Problem("not-found", f"workspace {ws} not found")
    # as the stream's leader has it: a trigger just added is listed, whichever replica reads
    g = await graph.load(api.app, org, min_seq=LATEST)
    return json_response(_view(g.state, ws, await readable(api, who, org)))


async def delete_run_trigger(request: web.Request) -> web.Response:
    api, org, who = await scope(request, "workspace.settings")
    ws = path_id(request, "ws")
    source = path_id(request, "source")
    await require_on(api, who, org, "workspace.read", source)  # no edge probed either
    g = await graph.remove(api.app, org, ws, source, who.user)
    return web.Response(status=204, headers={SEQ_HEADER: str(g.seq)})


def routes(ws_prefix: str) -> list[web.RouteDef]:
    base = ws_prefix + "/run-triggers"
    return [
        web.post(base, create_run_trigger),
        web.get(base, list_run_triggers, allow_head=False),
        web.delete(base + "/{source}", delete_run_trigger),
    ]


# ---------------------------------------------------------------- OpenAPI

_LINK: Doc = {"type": "object", "required": ["workspace"], "properties": {"workspace": ID}}
SCHEMAS: dict[str, Doc] = {
    **msgspec.json.schema_components((RunTriggerBody,), ref_template=REF)[1],
    "RunTriggers": {
        "type": "object",
        "required": ["workspace", "sources", "followers"],
        "properties": {
            "workspace": ID,
            "sources": {"type": "array", "items": _LINK, "description": "what it follows"},
            "followers": {"type": "array", "items": _LINK, "description": "what follows it"},
        },
    },
}

PATHS: dict[str, Doc] = {
    PREFIX: {
        "post": operation(
            "createRunTrigger",
            "Follow a workspace: its applies that change something start a run here "
            "(org admin; 422 run-trigger-cycle names the cycle it would close)",
            (201, "RunTriggers"),
            params=("org", "ws"),
            body="RunTriggerBody",
            errors=(400, 403, 404, 409, 422),
        ),
        "get": operation(
            "listRunTriggers",
            "The workspaces this one follows and those following it",
            (200, "RunTriggers"),
            params=("org", "ws"),
            errors=(403, 404),
        ),
    },
    PREFIX + "/{source}": {
        "delete": {
            "operationId": "deleteRunTrigger",
            "summary": "Stop following a workspace (org admin)",
            "parameters": [
                {"$ref": f"#/components/parameters/{p}"} for p in ("org", "ws", "source")
            ],
            "responses": {
                "204": {"description": "no longer follows it", "headers": {"RP-Seq": SEQ_DOC}},
                **problems(403, 404),
            },
        }
    },
}
