"""Replication is a setting and never goes down by itself: every stream, bucket and
durable consumer gets `--replicas` (default 1 alone, 3 on a cluster), a declaration
keeps more where there is more, and `runplane nats status` shows and repairs it."""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import nats.errors
import pytest
from nats.aio.client import Client as NATS

from infra import replicas as rep
from infra import streams
from infra.natsserver import EmbeddedNats
from infra.options import ConfigError, Options
from services.root import natsstatus
from services.root.runtime import nats_connection
from tests.cluster_support import NatsCluster
from tests.helpers import eventually
from tests.procs import ROOT, TEST_KEY


async def _replicas(nc: NATS) -> dict[str, int]:
    """Replicas of everything runplane declares: streams, and consumers by `stream > name`."""
    found: dict[str, int] = {}
    for _, stream in natsstatus.declared():
        config = await rep.stream_config(nc, stream)
        assert config is not None, f"{stream} missing"
        found[stream] = int(config["num_replicas"])
    for row in await natsstatus.collect(nc):
        if row.kind == "consumer" and row.durable:
            found[row.name] = row.have
    return found


def test_a_declaration_keeps_the_replicas_it_finds() -> None:
    assert rep.kept(None, 1) == 1
    assert rep.kept({"num_replicas": 3}, 1) == 3
    assert rep.kept({"num_replicas": 1}, 3) == 3
    assert rep.kept({}, 1) == 1


async def test_a_single_server_gets_one_replica_of_everything(
    nc: NATS, nats_server: EmbeddedNats
) -> None:
    assert rep.cluster_size(nc) == 1 and rep.wanted(nc, 0) == 1
    await streams.ensure_scheduler_consumer(nc.jetstream())
    await streams.ensure_executor_consumer(nc.jetstream(), "default")
    found = await _replicas(nc)
    assert set(found.values()) == {1}, found
    assert f"{streams.EVENTS} > {streams.SCHEDULER_CONSUMER}" in found


async def test_more_replicas_than_servers_is_one_clear_error(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match="replicas > 1 not supported"):
        async with nats_connection([nats_server.url], nats_server.auth, replicas=3):
            pass
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("RUNPLANE_")},
        "RUNPLANE_ENCRYPTION_KEY": TEST_KEY,
        "RUNPLANE_REPLICAS": "9",
    }
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "services.root.cli", "up", "--data-dir", str(tmp_path / "d")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == "runplane: --replicas wants 1 to 5, got 9", done.stderr


async def test_nats_status_lists_everything_on_a_single_server(
    nc: NATS, nats_server: EmbeddedNats
) -> None:
    await streams.ensure_scheduler_consumer(nc.jetstream())
    out = io.StringIO()
    opts = Options(nats_url=nats_server.url, nats_auth=nats_server.auth)
    async with AsyncExitStack() as stack:
        code = await natsstatus.status(opts, stack, repair=False, out=out)
    text = out.getvalue()
    assert code == 0, text
    for name in ("RP_EVENTS", "RP_DISPATCH", "rp-secrets", "rp-state-locks", "rp-plans"):
        assert any(line.split()[1] == name for line in text.splitlines()[1:]), text
    assert f"RP_EVENTS > {streams.SCHEDULER_CONSUMER}" in text
    assert text.rstrip().endswith("replication: everything at 1 or more (one server)")


async def test_nats_status_finds_the_server_of_a_running_up(tmp_path: Path) -> None:
    """Without --nats-url, `runplane nats status` reads the data directory of a running
    `runplane up`: its server's URL and credentials."""
    async with EmbeddedNats(tmp_path / "data" / "nats") as server:
        async with nats_connection([server.url], server.auth):
            pass
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("RUNPLANE_")},
            "PYTHONPATH": str(ROOT),
        }
        args = ["nats", "status", "--data-dir", str(tmp_path / "data")]
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "services.root.cli", *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env,
            timeout=60,
        )
    assert done.returncode == 0, done.stderr
    assert "RP_EVENTS" in done.stdout and "replication: everything at 1" in done.stdout


# ---------------------------------------------------------------- a 3-node cluster


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[NatsCluster]:
    async with NatsCluster(tmp_path / "cluster") as c:
        yield c


@pytest.mark.slow
async def test_on_a_cluster_replication_defaults_to_3_and_never_goes_down(
    cluster: NatsCluster,
) -> None:
    # A first process on an older runplane (or told --replicas 1) made everything R1.
    async with nats_connection(cluster.urls, cluster.auth, replicas=1) as nc:
        await streams.ensure_scheduler_consumer(nc.jetstream())
        await streams.ensure_executor_consumer(nc.jetstream(), "default")
        assert set((await _replicas(nc)).values()) == {1}
        assert rep.cluster_size(nc) == 3 and rep.wanted(nc, 0) == 3
        status = await _status(cluster, repair=False)
        assert status[0] == 1 and "below 3 (cluster of 3)" in status[1], status[1]
    # `nats status --repair` raises everything, the consumers with their streams.
    code, text = await _status(cluster, repair=True)
    assert code == 0, text
    assert "raised RP_EVENTS to 3 replicas" in text and "raised KV_rp-secrets" in text
    async with nats_connection(cluster.urls, cluster.auth) as nc:
        assert set((await _replicas(nc)).values()) == {3}, await _replicas(nc)
        await eventually(lambda: _all_current(nc), timeout=60, what="every replica current")
    # A process started with --replicas 1 keeps them at 3.
    async with nats_connection(cluster.urls, cluster.auth, replicas=1) as nc:
        await streams.ensure_scheduler_consumer(nc.jetstream())
        assert set((await _replicas(nc)).values()) == {3}, await _replicas(nc)
    code, text = await _status(cluster, repair=False)
    assert code == 0 and "replication: everything at 3 or more (cluster of 3)" in text, text
    events = next(ln for ln in text.splitlines() if ln.split()[1] == "RP_EVENTS")
    assert events.split()[2] == "3/3" and events.split()[3] in {"n1", "n2", "n3"}, events


@pytest.mark.slow
async def test_a_fresh_cluster_gets_3_replicas_and_a_connection_survives_its_server(
    cluster: NatsCluster,
) -> None:
    async with nats_connection(cluster.urls, cluster.auth) as nc:
        await streams.ensure_scheduler_consumer(nc.jetstream())
        assert set((await _replicas(nc)).values()) == {3}
        ours = cluster.node(nc._server_info["server_name"])
        await ours.kill()

        async def published() -> bool:  # once reconnected and the stream has a leader
            try:
                await nc.jetstream().publish("rp.org.x.created", b"{}", timeout=2)
            except nats.errors.Error:
                return False
            return True

        await eventually(published, timeout=30, interval=0.2, what="a publish after the kill")
        assert nc.connected_url is not None and nc.connected_url.port != ours.port
        await ours.start()


async def _all_current(nc: NATS) -> bool:
    """Every stream and durable consumer has its two other replicas, all current."""
    rows = [r for r in await natsstatus.collect(nc) if r.durable]
    return all(r.peers.count("current") == 2 for r in rows)


async def _status(cluster: NatsCluster, *, repair: bool) -> tuple[int, str]:
    out = io.StringIO()
    opts = Options(nats_url=cluster.url, nats_auth=cluster.auth)
    async with AsyncExitStack() as stack:
        code = await natsstatus.status(opts, stack, repair=repair, out=out)
    return code, out.getvalue()
