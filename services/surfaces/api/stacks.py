"""Stacks over HTTP: a named set of the organization's workspaces with dependency edges
(events/stacks.py; services/app/stacks.py).

- `POST /api/v1/orgs/{org}/stacks {"name", "workspaces", "edges": [{"source", "target"}],
  "failure_policy"?}` (org admin): 201, Location `.../stacks/{name}`. 404 if a node is
  not a live workspace of the organization, 409 if the name is taken, 422
  `stack-cycle` naming a cycle (`cycle`: `["a", "b", "a"]`), 422 `invalid-stack`
  (a node listed twice, an edge to a workspace not in the stack, a limit, a policy, the
  organization's MAX_STACKS reached).
- `GET .../stacks` (viewer): the organization's stacks, from the read model.
- `GET .../stacks/{stack}` (viewer): one stack as the stream's leader has it, with its
  DAG `levels`.
- `PUT .../stacks/{stack}` (org admin): its whole new definition, checked as at creation.
- `DELETE .../stacks/{stack}` (org admin): 204.

A caller who may not read one of a stack's workspaces sees it named `(hidden)`, in the
nodes, the edges and the levels alike (a stack tells nobody of a workspace they may not
read).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import msgspec
from aiohttp import web

from events import stacks as sk
from infra.eventstore import LATEST
from projections.stacks import count_stacks, list_stacks
from projections.working import iso
from services.app import stacks as store
from services.surfaces.api.bodies import Body, Name, check_name, read_body
from services.surfaces.api.common import SEQ_HEADER, items, json_response, path_id, readable, scope
from services.surfaces.api.problems import Problem
from services.surfaces.api.schemas import ID, REF, SEQ_DOC, Doc, operation, path_param, problems

HIDDEN = "(hidden)"
Policy = Annotated[str, msgspec.Meta(description="pause (default), abort or continue")]


class EdgeBody(Body, frozen=True, kw_only=True):
    source: Annotated[Name, msgspec.Meta(description="the workspace depended on")]
    target: Annotated[Name, msgspec.Meta(description="the workspace that depends on it")]


class StackDefinitionBody(Body, frozen=True, kw_only=True):
    workspaces: Annotated[list[Name], msgspec.Meta(max_length=sk.MAX_NODES)]
    edges: Annotated[list[EdgeBody], msgspec.Meta(max_length=sk.MAX_EDGES)] = []
    failure_policy: Policy = sk.DEFAULT_POLICY


class StackBody(StackDefinitionBody, frozen=True, kw_only=True):
    name: Name


def _definition(body: StackDefinitionBody) -> sk.Definition:
    for w in body.workspaces:
        check_name("workspace", w)
    for e in body.edges:
        check_name("source", e.source)
        check_name("target", e.target)
    edges = [sk.Edge(source=e.source, target=e.target) for e in body.edges]
    return sk.Definition(
        workspaces=list(body.workspaces), edges=edges, failure_policy=body.failure_policy
    )


def shown(view: dict[str, Any], seen: Callable[[str], bool]) -> dict[str, Any]:
    """A stack's view with every workspace the caller may not read named HIDDEN."""

    def name(w: str) -> str:
        return w if seen(w) else HIDDEN

    return view | {
        "workspaces": [name(w) for w in view["workspaces"]],
        "edges": [
            {"source": name(e["source"]), "target": name(e["target"])} for e in view["edges"]
        ],
        "levels": [[name(w) for w in level] for level in view["levels"]],
    }


def _view(s: sk.StackState) -> dict[str, Any]:
    d = s.definition
    return {
        "name": s.name,
        "workspaces": d.workspaces,
        "edges": [{"source": e.source, "target": e.target} for e in d.edges],
        "failure_policy": d.failure_policy,
        "levels": sk.levels(d),
        "changed_at": iso(s.changed_at) if s.changed_at else None,
        "changed_by": s.changed_by,
    }


async def _decided(write: Any) -> store.Stack:
    """The write's result, its refusals as the stable problems of stacks."""
    try:
        result: store.Stack = await write
    except sk.StackCycle as e:
        raise Problem("stack-cycle", str(e), cycle=e.cycle) from e
    except sk.InvalidStack as e:
        raise Problem("invalid-stack", str(e)) from e
    return result


async def create_stack(request: web.Request) -> web.Response:
    api, org, who = await scope(request, "org.settings")
    body = await read_body(request, StackBody)
    name = check_name("name", body.name)
    await api.reached(await api.app.store.last_seq(), api.read_wait)  # stacks just made
    if await count_stacks(api.read.rows, org) >= sk.MAX_STACKS:
        raise Problem("invalid-stack", f"an organization has at most {sk.MAX_STACKS} stacks")
    s = await _decided(store.create(api.app, org, name, _definition(body), who.user))
    headers = {SEQ_HEADER: str(s.seq), "Location": f"/api/v1/orgs/{org}/stacks/{name}"}
    return json_response(_view(s.state), status=201, headers=headers)


async def list_all(request: web.Request) -> web.Response:
    api, org, who = await scope(request, "org.read")
    seen = await readable(api, who, org)
    return items([shown(v, seen) for v in await list_stacks(api.read.rows, org)])


async def get_stack(request: web.Request) -> web.Response:
    api, org, who = await scope(request, "org.read")
    s = await _found(api.app, org, path_id(request, "stack"))
    return json_response(shown(_view(s.state), await readable(api, who, org)))


async def put_stack(request: web.Request) -> web.Response:
    api, org, who = await scope(request, "org.settings")
    name = path_id(request, "stack")
    body = await read_body(request, StackDefinitionBody)
    s = await _decided(store.change(api.app, org, name, _definition(body), who.user))
    return json_response(_view(s.state), headers={SEQ_HEADER: str(s.seq)})


async def delete_stack(request: web.Request) -> web.Response:
    api, org, who = await scope(request, "org.settings")
    s = await store.delete(api.app, org, path_id(request, "stack"), who.user)
    return web.Response(status=204, headers={SEQ_HEADER: str(s.seq)})


async def _found(app: Any, org: str, name: str) -> store.Stack:
    s = await store.load(app, org, name, min_seq=LATEST)
    if not s.state.exists:
        raise Problem("not-found", f"stack {name} not found")
    return s


PREFIX = "/api/v1/orgs/{org}/stacks"
ROUTES = [
    web.post(PREFIX, create_stack),
    web.get(PREFIX, list_all, allow_head=False),
    web.get(PREFIX + "/{stack}", get_stack, allow_head=False),
    web.put(PREFIX + "/{stack}", put_stack),
    web.delete(PREFIX + "/{stack}", delete_stack),
]

# ---------------------------------------------------------------- OpenAPI

_EDGE: Doc = {
    "type": "object",
    "required": ["source", "target"],
    "properties": {"source": ID, "target": ID},
}
_NAMES: Doc = {"type": "array", "items": {"type": "string"}}
PARAMETERS: dict[str, Doc] = {"stack": path_param("stack", "stack name")}
SCHEMAS: dict[str, Doc] = {
    **msgspec.json.schema_components((StackBody, StackDefinitionBody), ref_template=REF)[1],
    "Stack": {
        "type": "object",
        "required": ["name", "workspaces", "edges", "failure_policy", "levels"],
        "properties": {
            "name": ID,
            "workspaces": _NAMES,
            "edges": {"type": "array", "items": _EDGE},
            "failure_policy": {"enum": list(sk.POLICIES)},
            "levels": {"type": "array", "items": _NAMES, "description": "nodes by DAG level"},
            "changed_at": {"type": ["string", "null"]},
            "changed_by": {"type": "string"},
        },
    },
    "Stacks": {
        "type": "object",
        "required": ["items"],
        "properties": {"items": {"type": "array", "items": {"$ref": REF.format(name="Stack")}}},
    },
}
_ONE = ("org", "stack")
PATHS: dict[str, Doc] = {
    PREFIX: {
        "post": operation(
            "createStack",
            "Create a stack (org admin; 422 stack-cycle, invalid-stack)",
            (201, "Stack"),
            params=("org",),
            body="StackBody",
            errors=(400, 403, 404, 409, 422),
        ),
        "get": operation(
            "listStacks",
            "The organization's stacks",
            (200, "Stacks"),
            params=("org",),
            errors=(403, 404),
        ),
    },
    PREFIX + "/{stack}": {
        "get": operation(
            "getStack",
            "A stack with its DAG levels",
            (200, "Stack"),
            params=_ONE,
            errors=(403, 404),
        ),
        "put": operation(
            "putStack",
            "Replace a stack's definition (org admin)",
            (200, "Stack"),
            params=_ONE,
            body="StackDefinitionBody",
            errors=(400, 403, 404, 422),
        ),
        "delete": {
            "operationId": "deleteStack",
            "summary": "Delete a stack (org admin)",
            "parameters": [{"$ref": f"#/components/parameters/{p}"} for p in _ONE],
            "responses": {
                "204": {"description": "deleted", "headers": {"RP-Seq": SEQ_DOC}},
                **problems(403, 404),
            },
        },
    },
}
