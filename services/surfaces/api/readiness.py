"""Liveness and readiness, for a load balancer: `/healthz` and `/readyz`, both without a
token and both answered from this process alone (no question to NATS per request: a
flood of probes costs the cluster nothing).

- `/healthz` (liveness): 200 while the process serves. Restart the process when it fails.
- `/readyz` (readiness): 200 only once this replica's read model has reached the stream's
  last sequence as its leader had it when the projector started (`Projector.start_target`),
  so a load balancer never sends a read to a replica that would answer 404 for a run
  that exists. Before that, 503 `not-ready` with how far behind (`behind` events, `target`,
  `at`). Once ready it stays ready (the read model only moves forward) unless the
  projector stops (503 `projector-stopped`) or keeps failing (503 `projector-failing`: a
  failure restarted it less than `FAILING_S` ago; a projector that fails for good fails
  again at least every 5 s). The components `runplane up` starts after the api (`ready`
  of `build_app`) gate it too.

The 200 answer names no sequence: the stream's sequence counts every organization's
events, and an unauthenticated caller polling it would see their rate. The 503s, of a
replica starting or broken, do (what an operator needs to see how long it will take).
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from services.surfaces.api.common import json_response
from services.surfaces.api.context import API
from services.surfaces.api.problems import CONTENT_TYPE, Problem
from services.surfaces.api.schemas import Doc, json_content, ref

FAILING_S = 10.0  # twice the projector's longest pause between restarts


async def healthz(request: web.Request) -> web.Response:
    """Liveness: the process serves."""
    return json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Readiness: this replica's read model has caught up with the stream as of its start."""
    api = request.app[API]
    projector = api.projector
    if not projector.running:
        raise Problem("projector-stopped", "this replica's read model no longer follows the stream")
    target, at = projector.start_target, projector.seq
    if target is None:
        raise Problem(
            "not-ready", "asking the stream's last sequence", behind=None, target=None, at=at
        )
    if at < target:
        raise Problem(
            "not-ready",
            f"the read model is {target - at} events behind the stream as of this replica's start",
            behind=target - at,
            target=target,
            at=at,
        )
    if not api.ready():
        raise Problem("not-ready", "starting up", behind=0, target=target, at=at)
    failed = projector.failed_at
    if failed is not None and asyncio.get_running_loop().time() - failed < FAILING_S:
        raise Problem("projector-failing", "this replica's read model failed to follow the stream")
    return json_response({"status": "ready"})


ROUTES = [
    web.get("/healthz", healthz, allow_head=False),
    web.get("/readyz", readyz, allow_head=False),
]


def problem_doc(what: str) -> Doc:
    return {"description": what, "content": {CONTENT_TYPE: {"schema": ref("Problem")}}}


PATHS: dict[str, Doc] = {
    "/healthz": {
        "get": {
            "operationId": "healthz",
            "summary": "Liveness: 200 while the process serves (no token needed)",
            "security": [],
            "responses": {
                "200": {"description": "serving", "content": json_content("Health")},
            },
        }
    },
    "/readyz": {
        "get": {
            "operationId": "readyz",
            "summary": "Readiness: this replica's read model has caught up with the stream as "
            "of its start (no token needed)",
            "security": [],
            "responses": {
                "200": {"description": "ready", "content": json_content("Ready")},
                "503": problem_doc(
                    "not-ready (with behind, target and at), projector-stopped or projector-failing"
                ),
            },
        }
    },
}
