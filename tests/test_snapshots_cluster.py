"""Read-model snapshots on a three-node cluster (streams at R3): the bucket is replicated
like the others, and a new replica connected only to a follower of RP_EVENTS restores
the snapshot another replica wrote through the leader, tails the events written after it,
and holds the full replay's rows."""

from __future__ import annotations

import json
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from infra import streams
from projections.readmodel import ReadModel
from tests.bootstrap_support import built
from tests.cluster_support import NatsCluster, leader_and_follower
from tests.cluster_support import declared_cluster as declared_cluster  # `cluster`
from tests.projection_support import settle
from tests.snapshot_support import after_the_snapshot, full_replay, several_orgs


@pytest.mark.slow
async def test_a_replica_on_a_follower_restores_and_catches_up(
    cluster: NatsCluster, tmp_path: Path
) -> None:
    async with AsyncExitStack() as stack:
        wnc, rnc = await leader_and_follower(cluster, stack)  # the replica reaches the follower
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
