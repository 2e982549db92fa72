"""`?as_of=` through a server whose replica of RP_EVENTS is behind (three nats-servers,
streams at R3): the answer as of a sequence holds every event of the organization up to
it, never half a state, however far the server the api reaches lags: the organization's
model and a workspace's (whose run is found at the leader) alike. A direct get
through that server (the old path of every reader, tests/stale_reads_support.py) misses
the newest run at least once: the lag is real.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from events.codec import run_subject
from events.run import RunCreated, Workspace
from infra import streams
from infra.eventstore import Append, EventStore
from projections.asof import PastModels
from services.app.commands import App
from tests.cluster_support import NatsCluster
from tests.cluster_support import declared_cluster as declared_cluster  # `cluster`
from tests.stale_reads_support import PAYLOAD, Lagging

TIMEOUT = 2.0  # a follower far behind may not answer a direct get at all
TRIALS = 40
CONFIG = Workspace(repository="/repo")


@pytest.mark.slow
async def test_as_of_through_a_lagging_replica_answers_the_whole_state(
    cluster: NatsCluster,
) -> None:
    async with Lagging(cluster, streams.EVENTS) as lag:
        wjs = lag.writer.jetstream()
        writer = EventStore(lag.writer)
        app = App(writer)
        await app.create_org("acme", "admin")
        await app.create_workspace("acme", "net", CONFIG, "alice")
        past = PastModels(lag.reader)  # the api's connection reaches the lagging server
        created: list[str] = []
        stale_direct = 0
        try:
            for i in range(TRIALS):

                async def burst(j: int, i: int = i) -> object:
                    return await wjs.publish(f"rp.run.burst.ws.r{i}x{j}", PAYLOAD)

                async def write(i: int = i) -> int:
                    # An append expecting an empty subject: no read on the writer's side
                    # (the App's reads may reach the stopped server).
                    run_id = f"run-{i}"
                    event = RunCreated(
                        at=datetime.now(UTC), actor="alice", run_id=run_id, org="acme",
                        workspace="net", run_type="plan", config=CONFIG,
                    )  # fmt: skip
                    subject = run_subject("acme", "net", run_id)
                    seq = await writer.append([Append(subject=subject, event=event, expected=0)])
                    created.append(run_id)
                    return seq

                seq = await lag.behind(burst, write)
                direct = EventStore(lag.reader, timeout=TIMEOUT)
                try:
                    seen = await direct.read(run_subject("acme", "net", created[-1]))
                    stale_direct += not seen
                except Exception:  # noqa: BLE001 - a follower far behind may not answer
                    stale_direct += 1
                assert await past.resolve(str(seq)) == seq
                # the workspace's own model first (the organization's at seq would serve it)
                assert await past.run_workspace("acme", created[-1], seq) == "net"
                async with past.at("acme", seq, "net") as read:
                    mine = await read.runs.find("acme", workspace="net", limit=1000)
                assert [r["id"] for r in mine] == list(reversed(created)), i
                async with past.at("acme", seq) as read:
                    runs = await read.runs.find("acme", limit=1000)
                    ws = await read.workspaces.get("acme", "net")
                assert [r["id"] for r in runs] == list(reversed(created)), i
                assert ws is not None and ws["name"] == "net"
                if stale_direct >= 3 and past.behind >= 1:
                    break
        finally:
            await past.close()
    assert stale_direct > 0, "the replica never lagged: nothing proven"
    print(f"direct gets stale {stale_direct}, as_of reads served behind and read again "
          f"{past.behind}, of {len(created)} trials")  # fmt: skip
