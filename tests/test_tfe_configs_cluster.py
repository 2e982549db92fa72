"""The configuration quota's ledger on a three-node JetStream cluster (replicas 3): two
api replicas, each on its own node, race for a workspace's last slots; the ledger's
node is killed -9 and the next reservation lands once the bucket has a new leader."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path

import nats
import pytest

from infra import kv, streams
from services.surfaces.tfe.quota import Limits, Quota, QuotaError
from tests.cluster_support import NatsCluster
from tests.helpers import eventually

pytestmark = pytest.mark.slow


async def test_the_ledger_holds_its_limit_across_nodes_and_a_killed_leader(
    tmp_path: Path,
) -> None:
    async with NatsCluster(tmp_path / "cluster") as cluster:
        setup = await cluster.connect()
        await streams.declare(setup, setup.jetstream(), replicas=3)
        await setup.close()
        limits = Limits(pending_per_workspace=3)
        conns = [
            await nats.connect(servers=[n.url], **cluster.auth.connect_options())
            for n in cluster.nodes[:2]
        ]
        try:
            replicas = [Quota(c.jetstream(), limits) for c in conns]
            now = datetime.now(UTC)

            async def reserve(q: Quota, i: int) -> bool:
                try:
                    await q.reserve("acme", "net", f"cv-acme.net.v{i}", now)
                except QuotaError:
                    return False
                return True

            taken = await asyncio.gather(*[reserve(replicas[i % 2], i) for i in range(10)])
            assert sum(taken) == 3, taken
            for q in replicas:
                assert len((await q.ledger("acme")).versions) == 3

            leader = await cluster.stream_leader(f"KV_{kv.TFE_CONFIGS_BUCKET}")
            await leader.kill()
            survivor = await cluster.connect()
            try:
                q = Quota(survivor.jetstream(), limits)
                # another workspace's slot: it lands once a new leader is elected
                await eventually(
                    lambda: _reserve_dns(q, now),
                    timeout=60,
                    interval=0.5,
                    what="a reservation after the ledger's leader died",
                )
                ledger = await q.ledger("acme")
                assert len(ledger.versions) == 4 and "cv-acme.dns.v1" in ledger.versions
            finally:
                await survivor.close()
        finally:
            for c in conns:
                await c.close()


async def _reserve_dns(q: Quota, now: datetime) -> bool:
    try:
        await q.reserve("acme", "dns", "cv-acme.dns.v1", now)
    except (nats.errors.Error, TimeoutError):
        return False
    return True
