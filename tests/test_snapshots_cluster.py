"""Read-model snapshots on a three-node cluster (streams at R3): the bucket is replicated
like the others, and a new replica connected only to a follower of RP_EVENTS restores
the snapshot another replica wrote through the leader, tails the events written after it,
and holds the full replay's rows."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import nats
import pytest

from infra import streams
from projections.readmodel import ReadModel
from tests.bootstrap_support import built
from tests.cluster_support import NatsCluster
from tests.projection_support import settle
from tests.snapshot_support import after_the_snapshot, full_replay, several_orgs


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[NatsCluster]:
    async with NatsCluster(tmp_path / "cluster") as c:
        nc = await c.connect()
        await streams.declare(nc, nc.jetstream(), replicas=3)
        await nc.close()
        yield c


@pytest.mark.slow
async def test_a_replica_on_a_follower_restores_and_catches_up(
    cluster: NatsCluster, tmp_path: Path
) -> None:
    leader = await cluster.stream_leader(streams.EVENTS)
    follower = next(n for n in cluster.nodes if n is not leader)
    auth = cluster.auth.connect_options()
    async with AsyncExitStack() as stack:
        wnc = await nats.connect(leader.url, **auth)
        stack.push_async_callback(wnc.close)
        rnc = await nats.connect(follower.url, **auth)
        stack.push_async_callback(rnc.close)
        writer = built(wnc, stack, tmp_path)
        info = json.loads(
            (await wnc.request(f"$JS.API.STREAM.INFO.OBJ_{streams.SNAPSHOTS_BUCKET}", b"")).data
        )
        assert info["config"]["num_replicas"] == 3
        async with writer.projector(tmp_path / "writer.db") as projector:
            await several_orgs(writer.app)
            await settle(projector, writer.store)
            written = await writer.snapshot_writer(projector).write_once(force=True)
        assert written is not None
        await after_the_snapshot(writer.app)
        last = await writer.store.last_seq()

        replica = built(rnc, stack, tmp_path)  # the same deployment's key
        async with replica.projector(tmp_path / "replica.db") as restored:
            assert restored.restored == written.seq
            assert await restored.wait_for(last, timeout=30)
            assert restored.received == last - written.seq
            async with await ReadModel.open(tmp_path / "replica.db") as read:
                rows = await read.dump()
        assert rows == await full_replay(wnc, tmp_path / "full.db")
