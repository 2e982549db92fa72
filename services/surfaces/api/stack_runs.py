"""Stack runs over HTTP (events/stack_runs.py; services/app/stack_runs.py).

- `POST /api/v1/orgs/{org}/stacks/{stack}/runs {"type": "plan"|"apply"|"destroy",
  "targets"?: [...], "skip_dependencies"?: false, "failure_policy"?, "message"?}`: 201,
  Location `/api/v1/orgs/{org}/stack-runs/{id}`. The caller must be allowed the run
  type on every workspace the run covers (the targets and, unless
  `skip_dependencies`, what they need first), exactly as if they started each run
  themselves: the children are their runs (a 404 names no workspace). 422
  `invalid-stack` for a target not in the stack, or one the caller may not read (the
  same answer: trying names tells nobody what a stack holds), or an unknown type or
  policy.
- `GET .../stack-runs/{id}` (viewer): its status, its nodes (each with its runs) and the
  levels it goes by.
- `POST .../stack-runs/{id}/resume`: the failed, canceled and skipped nodes start again
  (409 `conflict` unless it is paused, failed or aborted); the same access as starting.

A caller who may not read one of its workspaces sees it named `(hidden)` in the levels
and the targets, and not among the nodes (nor its runs).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from aiohttp import web

from events import access
from events import stacks as sk
from events.errors import NotFound
from events.stack_run_events import RUN_TYPES, StackRunState
from events.stack_runs import select
from infra.eventstore import LATEST
from projections.working import iso
from services.app import stack_runs as runs_app
from services.app import stacks as stacks_app
from services.surfaces.api.bodies import Body, Name, check_name, read_body
from services.surfaces.api.common import (
    SEQ_HEADER,
    json_response,
    path_id,
    readable,
    require_on,
    scope,
)
from services.surfaces.api.context import Api
from services.surfaces.api.problems import Problem
from services.surfaces.api.schemas import REF, Doc, operation, path_param
from services.surfaces.api.stacks import HIDDEN, Policy

RunType = Annotated[str, msgspec.Meta(description="plan, apply or destroy")]


class StackRunBody(Body, frozen=True, kw_only=True):
    type: RunType
    targets: Annotated[list[Name], msgspec.Meta(max_length=sk.MAX_NODES)] = []
    skip_dependencies: bool = False
    failure_policy: Policy = ""
    message: Annotated[str, msgspec.Meta(max_length=1000)] = ""


class ResumeBody(Body, frozen=True, kw_only=True):
    """No fields (the body may be empty)."""


def levels(s: StackRunState) -> list[list[str]]:
    """The selected nodes by the level they run at (a destroy's reversed)."""
    chosen = set(s.selected)
    edges = [e for e in s.definition.edges if e.source in chosen and e.target in chosen]
    if s.run_type == "destroy":
        edges = [sk.Edge(source=e.target, target=e.source) for e in edges]
    return sk.levels(sk.Definition(workspaces=s.selected, edges=edges))


def view(s: StackRunState, seen: Any) -> dict[str, Any]:
    def name(w: str) -> str:
        return w if seen(w) else HIDDEN

    nodes = {
        n: {"status": v.status, "attempt": v.attempt, "run_id": v.run_id or None,
            "run_status": v.run_status or None, "runs": v.runs}
        for n, v in s.nodes.items()
        if seen(n)
    }  # fmt: skip
    return {
        "id": s.stack_run_id,
        "org": s.org,
        "stack": s.stack,
        "type": s.run_type,
        "status": s.status,
        "aborting": s.aborting,
        "failure_policy": s.failure_policy,
        "targets": [name(t) for t in s.targets],
        "skip_dependencies": s.skip_dependencies,
        "levels": [[name(n) for n in level] for level in levels(s)],
        "nodes": nodes,  # those the caller may read; the others are (hidden) in levels
        "resumes": s.resumes,
        "resumed_by": s.resumed_by or None,
        "message": s.message,
        "created_by": s.created_by,
        "created_at": iso(s.created_at) if s.created_at else None,
    }


async def _may_run(api: Api, who: Any, org: str, run_type: str, nodes: list[str]) -> None:
    """The caller may start `run_type` on every node (403 or 404 as for one run). A 404
    names no workspace: the caller may not read it, and the stack shows it (hidden)."""
    for ws in nodes:
        try:
            await require_on(api, who, org, access.run_action(run_type), ws)
        except NotFound:
            raise NotFound(f"a workspace of the stack is {HIDDEN} or not found") from None


async def create_stack_run(request: web.Request) -> web.Response:
    api, org, who = await scope(request, "org.read")
    stack = path_id(request, "stack")
    body = await read_body(request, StackRunBody)
    for t in body.targets:
        check_name("target", t)
    if body.type not in RUN_TYPES:
        raise Problem("invalid-stack", f"type is one of {', '.join(RUN_TYPES)}")
    found = await stacks_app.load(api.app, org, stack, min_seq=LATEST)
    if not found.state.exists:
        raise Problem("not-found", f"stack {stack} not found")
    seen = await readable(api, who, org)
    try:
        unseen = sorted({t for t in body.targets if not seen(t)})
        if unseen:  # answered as a name not in the stack: trying names tells nothing
            raise sk.InvalidStack(f"targets not in the stack: {', '.join(unseen)}")
        nodes = select(found.state.definition, body.type, body.targets, body.skip_dependencies)
        await _may_run(api, who, org, body.type, nodes)
        ask = runs_app.Start(
            run_type=body.type, targets=body.targets, skip_dependencies=body.skip_dependencies,
            failure_policy=body.failure_policy, message=body.message,
        )  # fmt: skip
        done = await runs_app.start(api.app, org, stack, ask, who.user, found)
    except sk.InvalidStack as e:
        raise Problem("invalid-stack", str(e)) from e
    location = f"/api/v1/orgs/{org}/stack-runs/{done.state.stack_run_id}"
    headers = {SEQ_HEADER: str(done.seq), "Location": location}
    return json_response(view(done.state, seen), status=201, headers=headers)


async def _found(api: Api, org: str, stack_run_id: str) -> StackRunState:
    s = (await runs_app.load(api.app, org, stack_run_id, min_seq=LATEST)).state
    if not s.exists:
        raise Problem("not-found", f"stack run {stack_run_id} not found")
    return s


async def get_stack_run(request: web.Request) -> web.Response:
    api, org, who = await scope(request, "org.read")
    s = await _found(api, org, path_id(request, "stack_run"))
    return json_response(view(s, await readable(api, who, org)))


async def resume_stack_run(request: web.Request) -> web.Response:
    api, org, who = await scope(request, "org.read")
    stack_run_id = path_id(request, "stack_run")
    await read_body(request, ResumeBody, optional=True)
    s = await _found(api, org, stack_run_id)
    await _may_run(api, who, org, s.run_type, s.selected)
    done = await runs_app.resume(api.app, org, stack_run_id, who.user)
    seen = await readable(api, who, org)
    return json_response(view(done.state, seen), headers={SEQ_HEADER: str(done.seq)})


RUNS = "/api/v1/orgs/{org}/stacks/{stack}/runs"
ONE = "/api/v1/orgs/{org}/stack-runs/{stack_run}"
ROUTES = [
    web.post(RUNS, create_stack_run),
    web.get(ONE, get_stack_run, allow_head=False),
    web.post(ONE + "/resume", resume_stack_run),
]

# ---------------------------------------------------------------- OpenAPI

_STR: Doc = {"type": "string"}
PARAMETERS: dict[str, Doc] = {"stack_run": path_param("stack_run", "stack run id")}
SCHEMAS: dict[str, Doc] = {
    **msgspec.json.schema_components((StackRunBody, ResumeBody), ref_template=REF)[1],
    "StackRun": {
        "type": "object",
        "required": ["id", "stack", "type", "status", "nodes", "levels"],
        "properties": {
            "id": _STR,
            "org": _STR,
            "stack": _STR,
            "type": {"enum": list(RUN_TYPES)},
            "status": {"enum": ["running", "paused", "completed", "failed", "aborted"]},
            "aborting": {"type": "boolean"},
            "failure_policy": {"enum": list(sk.POLICIES)},
            "targets": {"type": "array", "items": _STR},
            "skip_dependencies": {"type": "boolean"},
            "levels": {"type": "array", "items": {"type": "array", "items": _STR}},
            "nodes": {
                "type": "object",
                "description": "by workspace: status (waiting, running, succeeded, failed, "
                "canceled, skipped), attempt, run_id, run_status, runs (every attempt's)",
            },
            "resumes": {"type": "integer"},
            "resumed_by": {
                "type": ["string", "null"],
                "description": "who resumed it last: the runs started since are theirs",
            },
        },
    },
}
PATHS: dict[str, Doc] = {
    RUNS: {
        "post": operation(
            "createStackRun",
            "Run a stack in dependency order (the run type on every workspace it covers)",
            (201, "StackRun"),
            params=("org", "stack"),
            body="StackRunBody",
            errors=(400, 403, 404, 422),
        )
    },
    ONE: {
        "get": operation(
            "getStackRun",
            "A stack run, its nodes and their runs",
            (200, "StackRun"),
            params=("org", "stack_run"),
            errors=(403, 404),
        )
    },
    ONE + "/resume": {
        "post": operation(
            "resumeStackRun",
            "Start the failed, canceled and skipped nodes again (409 unless paused, failed "
            "or aborted)",
            (200, "StackRun"),
            params=("org", "stack_run"),
            body="ResumeBody",
            body_required=False,
            errors=(400, 403, 404, 409),
        )
    },
}
