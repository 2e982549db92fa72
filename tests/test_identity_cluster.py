"""Suspension on a cluster: two api replicas, each its own connection to a different node
of a 3-node NATS JetStream cluster, its own command side and read model. A user is
suspended through replica A; from A's answer on, replica B refuses the user's personal
token and ends their browser session, with no wait and no retry (B asks the stream's
leader for the organization's last event on every request)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.root.runtime import nats_connection
from services.surfaces.api.context import API
from tests.api_support import ADMIN_TOKEN, Http
from tests.bootstrap_support import built
from tests.cluster_support import NatsCluster

V1 = "/api/v1/orgs"


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[NatsCluster]:
    async with NatsCluster(tmp_path / "cluster") as c:
        yield c


async def _replica(
    stack: AsyncExitStack, cluster: NatsCluster, node: int, root: Path
) -> tuple[Http, TestClient[Any, Any]]:
    """An api replica connected to node `node` only."""
    url = cluster.urls[node]
    nc = await stack.enter_async_context(nats_connection([url], cluster.auth))
    plane = built(nc, stack, root)
    projector = await stack.enter_async_context(plane.projector(root / f"rm-{node}.sqlite"))
    web = plane.web_app(projector, admin_token=ADMIN_TOKEN, secret_store=None, repositories=None)
    client = await stack.enter_async_context(TestClient(TestServer(web)))
    return Http(client, web[API], plane.app), client


async def test_a_user_suspended_through_one_replica_is_refused_at_once_by_the_other(
    cluster: NatsCluster, tmp_path: Path
) -> None:
    async with AsyncExitStack() as stack:
        a, _ = await _replica(stack, cluster, 0, tmp_path)
        b, browser = await _replica(stack, cluster, 1, tmp_path)
        assert (await a.post("/api/v1/orgs", json={"name": "acme"})).status == 201
        invited = await a.post(f"{V1}/acme/users", json={"email": "sue@acme.io"})
        user_id = invited.body["id"]
        grant = {"team": "ops", "level": "read"}
        assert (await a.post(f"{V1}/acme/teams", json={"name": "ops"})).status == 201
        members = {"members": [user_id]}
        assert (await a.call("PUT", f"{V1}/acme/teams/ops/members", json=members)).status == 200
        assert (await a.call("PUT", f"{V1}/acme/access", json=grant)).status == 200
        made = await a.post(f"{V1}/acme/tokens", json={"kind": "user", "user_id": user_id})
        token = made.body["token"]
        assert (await b.get(f"{V1}/acme/workspaces", token=token)).status == 200
        # a browser signed in through B
        signin = await browser.get("/")
        presign = signin.cookies["rp_presign"].value
        form = {"csrf": presign, "token": token, "org": ""}
        async with browser.post("/signin", data=form, allow_redirects=False) as r:
            assert r.status == 303, await r.text()
        async with browser.get("/orgs/acme", allow_redirects=False) as r:
            assert r.status == 200

        suspended = await a.post(f"{V1}/acme/users/{user_id}/suspend")
        assert suspended.status == 200

        # at once on B: no eventually, no retry
        (await b.get(f"{V1}/acme/workspaces", token=token)).problem("user-suspended", 401)
        async with browser.get("/orgs/acme", allow_redirects=False) as r:
            assert r.status == 303 and r.headers["Location"] == "/"  # the session ended
        assert (await a.post(f"{V1}/acme/users/{user_id}/reactivate")).status == 200
        async with browser.get("/orgs/acme", allow_redirects=False) as r:
            assert r.status == 303  # ended sessions stay ended: sign in again
        # and so do the tokens: the suspension revoked them
        (await b.get(f"{V1}/acme/workspaces", token=token)).problem("unauthorized", 401)
