"""/readyz and /healthz of an api replica (services/surfaces/api/readiness.py), on a real
nats-server with a real projector.

The held-back replica: a second api whose projector's writer is held (`Projector.hold`)
from before it starts, so it receives the stream but commits nothing. It answers 503
`not-ready` with how far behind the stream as of its start it is (and 404 for a
workspace that exists: what a load balancer must not send it reads for), /healthz 200
throughout; released, it catches up and answers 200, and stays ready when held again
behind newer events. A projector that stopped or keeps failing is 503 too. The attack:
an unauthenticated caller (any organization's token, or none) learns nothing of other
organizations' activity from /readyz, and a flood of probes costs NATS nothing.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from events.run import Workspace
from projections.projector import Projector
from services.root.bootstrap import Plane
from tests.api_support import ADMIN_TOKEN, PROBLEM, web_app_of
from tests.helpers import eventually

CONFIG = Workspace(repository="https://example.com/infra.git")
PROBLEMS = "https://runplane.dev/problems/"
WORKSPACES = 30


async def _get(client: TestClient[Any, Any], path: str, **headers: str) -> tuple[int, Any]:
    async with client.get(path, headers=headers) as resp:
        body = await resp.json(content_type=None)
        if resp.status >= 400:
            assert resp.content_type == PROBLEM, (resp.status, body)
        return resp.status, body


async def _history(system: Plane, org: str, count: int = WORKSPACES) -> int:
    """An organization with `count` workspaces; the stream's last sequence after them."""
    await system.app.create_org(org, "alice")
    for i in range(count):
        await system.app.create_workspace(org, f"ws-{i}", CONFIG, "alice")
    return await system.store.last_seq()


@pytest.fixture
async def replica() -> AsyncIterator[AsyncExitStack]:
    """What the test's replica runs, stopped in reverse order at its end."""
    async with AsyncExitStack() as stack:
        yield stack


async def _serve(
    system: Plane, stack: AsyncExitStack, projector: Projector
) -> TestClient[Any, Any]:
    web_app = web_app_of(system, projector, secret_store=None)
    return await stack.enter_async_context(TestClient(TestServer(web_app)))


async def test_a_held_back_replica_is_not_ready_until_it_caught_up(
    system: Plane, tmp_path: Path, replica: AsyncExitStack
) -> None:
    """503 not-ready with behind = target - at > 0 while its read model is behind the
    stream's last sequence as of its start (a workspace that exists answers 404 there
    meanwhile), /healthz 200 throughout; 200 once caught up, and still 200 when held
    again behind events appended after that."""
    last = await _history(system, "acme")
    projector = system.projector(tmp_path / "held.sqlite", board_stream=None)
    hold = AsyncExitStack()
    await hold.enter_async_context(projector.hold())  # from before it starts: it
    await replica.enter_async_context(projector)  # receives the stream, commits nothing
    client = await _serve(system, replica, projector)

    async def asked() -> dict[str, Any]:
        status, body = await _get(client, "/readyz")
        assert status == 503 and body["type"] == PROBLEMS + "not-ready", body
        return body if body["target"] is not None else {}

    body = await eventually(asked, what="the replica to know the stream's last sequence")
    assert body["target"] == last and body["at"] == 0 and body["behind"] == last
    assert await _get(client, "/healthz") == (200, {"status": "ok"})
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    status, _ = await _get(client, "/api/v1/orgs/acme/workspaces/ws-0", **auth)
    assert status == 404  # what a load balancer would have served
    await system.app.create_workspace("acme", "later", CONFIG, "alice")  # after its start
    status, body = await _get(client, "/readyz")
    assert (status, body["target"], body["behind"]) == (503, last, last)

    await hold.aclose()  # released: it catches up

    async def ready() -> bool:
        return (await _get(client, "/readyz")) == (200, {"status": "ready"})

    await eventually(ready, what="the replica to be ready once caught up")
    assert projector.seq >= last
    assert (await _get(client, "/api/v1/orgs/acme/workspaces/ws-0", **auth))[0] == 200
    async with projector.hold():  # behind again, on events newer than its start: ready
        await system.app.create_workspace("acme", "newer", CONFIG, "alice")
        assert await system.store.last_seq() > projector.seq
        assert await _get(client, "/readyz") == (200, {"status": "ready"})
        assert await _get(client, "/healthz") == (200, {"status": "ok"})


async def test_a_replica_whose_projector_stopped_or_fails_is_not_ready(
    system: Plane, tmp_path: Path, replica: AsyncExitStack
) -> None:
    """Ready, then its read model breaks (a table gone: every commit fails): 503
    projector-failing; its projector stopped: 503 projector-stopped. /healthz 200."""
    await _history(system, "acme", 3)
    db = tmp_path / "replica.sqlite"
    projector = system.projector(db, board_stream=None)
    await projector.__aenter__()
    replica.push_async_callback(projector.__aexit__, None, None, None)  # it may be twice
    client = await _serve(system, replica, projector)

    async def ready() -> bool:
        return (await _get(client, "/readyz"))[0] == 200

    await eventually(ready, what="the replica to be ready")
    with sqlite3.connect(db) as other:  # a real failure of the read model
        other.execute("DROP TABLE checkpoint")
    await system.app.create_workspace("acme", "after", CONFIG, "alice")

    async def failing() -> dict[str, Any]:
        status, body = await _get(client, "/readyz")
        return body if status == 503 else {}

    body = await eventually(failing, what="a failing projector to be not ready")
    assert body["type"] == PROBLEMS + "projector-failing", body
    assert await _get(client, "/healthz") == (200, {"status": "ok"})
    await projector.__aexit__(None, None, None)
    status, body = await _get(client, "/readyz")
    assert (status, body["type"]) == (503, PROBLEMS + "projector-stopped")
    assert await _get(client, "/healthz") == (200, {"status": "ok"})


async def test_readyz_tells_no_caller_of_others_activity_and_costs_nats_nothing(
    system: Plane, tmp_path: Path, replica: AsyncExitStack
) -> None:
    """Attack: org A (its token, a forged one, or none) polls /readyz to follow org B's
    activity, or floods it to load the cluster. Every caller gets the same answer, which
    names no sequence before or after B's events, and 500 probes send no NATS message
    per probe (the answer is this replica's own state: no stream info asked)."""
    await _history(system, "org-b", 3)
    projector = await replica.enter_async_context(
        system.projector(tmp_path / "r.sqlite", board_stream=None)
    )
    client = await _serve(system, replica, projector)

    async def ready() -> bool:
        return (await _get(client, "/readyz"))[0] == 200

    await eventually(ready, what="the replica to be ready")
    callers: list[dict[str, str]] = [
        {},
        {"Authorization": f"Bearer {ADMIN_TOKEN}"},
        {"Authorization": "Bearer rp_forged_token_of_org_a"},
    ]
    before = [await _get(client, "/readyz", **h) for h in callers]
    for i in range(5):
        await system.app.create_workspace("org-b", f"more-{i}", CONFIG, "bob")
    assert await projector.wait_for(await system.store.last_seq())
    after = [await _get(client, "/readyz", **h) for h in callers]
    assert before == after == [(200, {"status": "ready"})] * len(callers)
    sent = system.nc.stats["out_msgs"]
    for _ in range(500):
        assert (await _get(client, "/readyz"))[0] == 200
    assert system.nc.stats["out_msgs"] - sent < 50  # not one per probe
