"""/readyz of an api replica whose NATS server is a follower of RP_EVENTS (three
nats-servers, streams at R3): its target is the stream's last sequence as the leader has
it (every acknowledged write, not what the follower may hold yet), it answers 503
`not-ready` while its projector is held back behind that, and 200 once caught up.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from events.run import Workspace
from tests.api_support import web_app_of
from tests.bootstrap_support import built
from tests.cluster_support import NatsCluster, leader_and_follower
from tests.cluster_support import declared_cluster as declared_cluster  # `cluster`
from tests.helpers import eventually

CONFIG = Workspace(repository="https://example.com/infra.git")
PROBLEMS = "https://runplane.dev/problems/"


async def _readyz(client: TestClient[Any, Any]) -> tuple[int, Any]:
    async with client.get("/readyz") as resp:
        return resp.status, await resp.json(content_type=None)


@pytest.mark.slow
async def test_a_replica_on_a_follower_is_ready_at_the_leaders_last_sequence(
    cluster: NatsCluster, tmp_path: Path
) -> None:
    async with AsyncExitStack() as stack:
        wnc, rnc = await leader_and_follower(cluster, stack)  # the replica reaches the follower
        writer = built(wnc, stack, tmp_path / "writer")
        await writer.app.create_org("acme", "alice")
        for i in range(40):
            await writer.app.create_workspace("acme", f"ws-{i}", CONFIG, "alice")
        last = await writer.store.last_seq()
        replica = built(rnc, stack, tmp_path / "replica")
        projector = replica.projector(tmp_path / "replica.sqlite", board_stream=None)
        hold = AsyncExitStack()
        await hold.enter_async_context(projector.hold())  # held back from its start
        await stack.enter_async_context(projector)
        web_app = web_app_of(replica, projector, secret_store=None)
        client = await stack.enter_async_context(TestClient(TestServer(web_app)))

        async def asked() -> dict[str, Any]:
            status, body = await _readyz(client)
            assert status == 503 and body["type"] == PROBLEMS + "not-ready", body
            return body if body["target"] is not None else {}

        body = await eventually(asked, what="the replica to know the stream's last sequence")
        assert (body["target"], body["at"], body["behind"]) == (last, 0, last)
        await writer.app.create_workspace("acme", "later", CONFIG, "alice")
        assert (await _readyz(client))[1]["target"] == last  # as of its start
        await hold.aclose()

        async def ready() -> bool:
            return await _readyz(client) == (200, {"status": "ready"})

        await eventually(ready, what="the replica to be ready once caught up")
        assert projector.seq >= last
