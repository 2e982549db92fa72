"""No decision on a stale read, on a real 3-node cluster with a follower that is behind.

Each stream the decisions read is R3. The reader is connected to one follower of that
stream only, the writer to its leader. For each trial the follower is stopped (SIGSTOP),
a burst of writes and then the one that matters go to the leader (acknowledged by the
other two), the follower is resumed (SIGCONT) and read through at once, by the old path
(a plain direct get, which the follower answers from what it has) and by the path the
scheduler, reaper, executor and secrets responder use now, at the same moment:

- the event store: `EventStore.read` under the decision's `floor` (the scheduler's
  message, the reaper's round);
- the heartbeat board: `Board.snapshot` (the reaper's round: the clock message proves
  the read) and `Board.last(leader=True)` (checked before any verdict is acted on);
- the state head: `StateStore.head` (what Terraform plans on);
- the secrets: `kv.last_values` (what the responder hands a dispatch).

(The cluster test is `slow`; the last test, on one server, plays a board page from a
follower behind for the reaper's limits.)

The old path must come out stale at least once (else the follower never lagged and the
test proves nothing); the new path never. A new read may fail instead (the board's clock
not read back): that is no decision, and is counted apart.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import nats
import nats.js.errors
import pytest
from nats.aio.client import Client as NATS

from events.codec import org_subject
from events.org import OrgCreated
from events.run import Status
from executor.statestore import StateStore, ws_key
from infra import kv, streams
from infra.crypto import KeyRing
from infra.eventstore import Append, EventStore, floor
from infra.heartbeats import DEADLINE, Beat, Board, body, subject
from services.app.commands import App
from services.processes.scheduler import limits
from tests.builders import queued_run
from tests.cluster_support import NatsCluster
from tests.cluster_support import declared_cluster as declared_cluster  # `cluster`
from tests.reaper_support import ORG, state, workspace
from tests.stale_reads_support import PAYLOAD, Lagging, Tally, trials

TIMEOUT = 2.0  # a follower far behind may not answer a direct get at all


async def events(cluster: NatsCluster) -> Tally:
    async with Lagging(cluster, streams.EVENTS) as lag:
        wjs = lag.writer.jetstream()
        writer = EventStore(lag.writer)

        async def burst(j: int) -> object:
            return await wjs.publish(f"rp.run.burst.ws.r{j}", PAYLOAD)

        async def write(i: int) -> int:
            # An append expecting an empty subject: no read on the writer's side.
            created = OrgCreated(at=datetime.now(UTC), actor="t", name=f"org{i}")
            return await writer.append(
                [Append(subject=org_subject(f"org{i}"), event=created, expected=0)]
            )

        async def old(i: int) -> bool:
            return bool(await EventStore(lag.reader, timeout=TIMEOUT).read(f"rp.org.org{i}"))

        async def with_floor(i: int, seq: int) -> bool:
            floor.set(seq)  # as the scheduler does per message (this task's own context)
            return bool(
                (
                    await App(EventStore(lag.reader, timeout=TIMEOUT)).load_org(f"org{i}")
                ).state.exists
            )

        return await trials(lag, burst, write, old, {"EventStore.read(floor)": with_floor})


async def board(cluster: NatsCluster) -> Tally:
    async with Lagging(cluster, streams.HEARTBEATS) as lag:
        wjs = lag.writer.jetstream()
        writer = Board(lag.writer)

        async def burst(j: int) -> object:
            return await wjs.publish(subject(f"burst{j}", "plan"), PAYLOAD)

        async def write(i: int) -> int:
            assert await writer.put(subject(f"run{i}", "plan"), body(lease_id=f"l{i}", timeout=60))
            return 0

        async def old(i: int) -> bool:
            return await Board(lag.reader, timeout=TIMEOUT).last(f"run{i}", "plan") is not None

        async def snapshot(i: int, _: int) -> bool:
            _now, beats = await Board(lag.reader, timeout=TIMEOUT).snapshot()
            return any(b.run_id == f"run{i}" for b in beats)

        async def leader(i: int, _: int) -> bool:
            return (
                await Board(lag.reader, timeout=TIMEOUT).last(f"run{i}", "plan", leader=True)
                is not None
            )

        reads = {"Board.snapshot": snapshot, "Board.last(leader)": leader}
        return await trials(lag, burst, write, old, reads)


async def state_head(cluster: NatsCluster) -> Tally:
    async with Lagging(cluster, f"KV_{kv.STATE_HEAD_BUCKET}") as lag:
        wjs = lag.writer.jetstream()
        bucket = await wjs.key_value(kv.STATE_HEAD_BUCKET)
        key = ws_key("acme", "net")
        store = StateStore(lag.reader.jetstream(timeout=TIMEOUT), KeyRing.generate())

        async def burst(j: int) -> object:
            return await bucket.put(f"burst.w{j}", PAYLOAD)

        async def write(i: int) -> int:
            return int(
                await bucket.put(
                    key, json.dumps({"object": f"v{i}", "serial": i, "digest": "d"}).encode()
                )
            )

        async def old(i: int) -> bool:
            direct = await lag.reader.jetstream(timeout=TIMEOUT).key_value(kv.STATE_HEAD_BUCKET)
            try:
                entry = await direct.get(key)  # a direct get: the bucket allows them
            except nats.js.errors.KeyNotFoundError:
                return False
            return bool(json.loads(entry.value or b"{}").get("serial") == i)

        async def head(i: int, _: int) -> bool:
            found, _rev = await store.head("acme", "net")
            return found is not None and found.serial == i

        return await trials(lag, burst, write, old, {"StateStore.head": head})


async def secrets(cluster: NatsCluster) -> Tally:
    async with Lagging(cluster, f"KV_{kv.SECRETS_BUCKET}") as lag:
        bucket = await lag.writer.jetstream().key_value(kv.SECRETS_BUCKET)

        async def burst(j: int) -> object:
            return await bucket.put(f"burst.w{j}.s", PAYLOAD)

        async def write(i: int) -> int:
            return int(await bucket.put("acme.net.token", f"sealed-{i}".encode()))

        async def old(i: int) -> bool:
            found, _ = await kv.direct_last_values(
                lag.reader, kv.SECRETS_BUCKET, "acme.net.*", timeout=TIMEOUT
            )
            return found.get("acme.net.token") == f"sealed-{i}".encode()

        async def values(i: int, _: int) -> bool:
            found = await kv.last_values(
                lag.reader, kv.SECRETS_BUCKET, "acme.net.*", timeout=TIMEOUT
            )
            return found.get("acme.net.token") == f"sealed-{i}".encode()

        return await trials(lag, burst, write, old, {"kv.last_values": values})


@pytest.mark.slow
async def test_reads_through_a_follower_that_is_behind_are_never_stale(
    cluster: NatsCluster,
) -> None:
    results = {
        "events": await events(cluster),
        "heartbeat board": await board(cluster),
        "state head": await state_head(cluster),
        "secrets": await secrets(cluster),
    }
    report = "\n".join(t.line(name) for name, t in results.items())
    print(report)
    for name, t in results.items():
        assert t.old_stale > 0, f"{name}: the follower never lagged, nothing proven\n{report}"
        assert not any(t.new_stale.values()), f"{name}: a new read was stale\n{report}"


async def test_a_deadline_marker_the_leader_no_longer_has_is_not_enforced(
    nc: NATS, app: App
) -> None:
    """A board page from a follower behind shows a marker whose deadline has passed; the
    leader has a newer one since: the reaper's limits leave the run alone this round."""
    await workspace(app, "net")
    run_id = await queued_run(app, "net")
    board = Board(nc)
    now = datetime.now(UTC)

    async def put(deadline: datetime) -> Beat:
        marker = body(kind=DEADLINE, org=ORG, workspace="net", run_deadline=deadline.isoformat())
        assert await board.put(subject(run_id, DEADLINE), marker)
        beat = await board.last(run_id, DEADLINE, leader=True)
        assert beat is not None
        return beat

    behind = await put(now - timedelta(seconds=5))
    await put(now + timedelta(hours=1))
    assert await limits.enforce(app, board, behind, now) == limits.Limit.KEEP
    assert (await state(app, "net", run_id)).status == Status.QUEUED
    current = await board.last(run_id, DEADLINE, leader=True)
    assert current is not None and current.seq > behind.seq, "the newer marker is kept"
