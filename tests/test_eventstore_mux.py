"""EventStore reads share one wildcard inbox subscription: each read's replies reach it alone."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from events.org import OrgCreated, TokenIssued
from infra import eventstore
from infra.eventstore import Append, EventStore, StoreError, wait_for_stream
from infra.natsserver import EmbeddedNats

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def org(i: int) -> str:
    return f"rp.org.o{i}"


async def seed(store: EventStore, orgs: int) -> dict[str, list[int]]:
    """Organization i gets 1 + i % 7 events; the sequences of each subject's events."""
    seqs: dict[str, list[int]] = {}
    for i in range(orgs):
        subject = org(i)
        seq = await store.append(
            [Append(subject=subject, event=OrgCreated(at=NOW, actor="a", name=f"o{i}"), expected=0)]
        )
        seqs[subject] = [seq]
        for k in range(i % 7):
            event = TokenIssued(
                at=NOW, actor="a", token_id=f"o{i}-t{k}", token_hash="h", user="u", role="admin"
            )
            seq = await store.append([Append(subject=subject, event=event, expected=seq)])
            seqs[subject].append(seq)
    return seqs


def own(subject: str, envs: list[eventstore.Envelope], seqs: list[int]) -> None:
    """`envs` are exactly the events of `subject`, in order."""
    assert [e.seq for e in envs] == seqs
    assert all(e.subject == subject for e in envs)
    name = subject.rsplit(".", 1)[1]
    for e in envs:
        ev = e.event
        assert ev.name == name if isinstance(ev, OrgCreated) else ev.token_id.startswith(name + "-")  # type: ignore[union-attr]


async def test_many_concurrent_reads_each_get_their_own_events(
    nc: NATS, store: EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    seqs = await seed(store, 60)
    monkeypatch.setattr(eventstore, "_BATCH", 3)  # several pages per history, all interleaved
    reader = EventStore(nc)
    subjects = [org(i % 60) for i in range(600)]
    results = await asyncio.gather(*(reader.read(s) for s in subjects))
    for subject, envs in zip(subjects, results, strict=True):
        own(subject, envs, seqs[subject])
    everything = await reader.read("rp.org.>")
    assert [e.seq for e in everything] == sorted(s for v in seqs.values() for s in v)
    assert reader.direct._reads == {}


async def test_reads_after_some_events_and_from_the_cache(nc: NATS, store: EventStore) -> None:
    seqs = await seed(store, 20)
    reader = EventStore(nc)
    for _ in range(2):  # cold, then only what is new (nothing)
        results = await asyncio.gather(*(reader.read(org(i)) for i in range(20)))
        for i, envs in enumerate(results):
            own(org(i), envs, seqs[org(i)])
    after = seqs[org(6)][3]
    assert [e.seq for e in await reader.read(org(6), after=after)] == seqs[org(6)][4:]


async def test_reads_do_not_subscribe_each_time(nc: NATS, store: EventStore) -> None:
    await seed(store, 10)
    reader = EventStore(nc)
    await reader.read(org(0))
    subs, sid = len(nc._subs), nc._sid
    for _ in range(5):
        await asyncio.gather(*(reader.read(org(i)) for i in range(10)))
    assert len(nc._subs) == subs
    assert nc._sid == sid  # not one SUB (nor UNSUB) sent for these 50 reads


async def test_many_first_reads_at_once_share_one_subscription(nc: NATS, store: EventStore) -> None:
    await seed(store, 5)
    subs, sid = len(nc._subs), nc._sid
    reader = EventStore(nc)
    await asyncio.gather(*(reader.read(org(i % 5)) for i in range(100)))
    assert len(nc._subs) == subs + 1 and nc._sid == sid + 1


async def test_a_read_that_times_out_leaves_the_others_alone(
    nc: NATS, store: EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    seqs = await seed(store, 10)
    reader = EventStore(nc, timeout=0.5)
    publish = nc.publish

    async def late(subject: str, payload: bytes = b"", **kw: Any) -> None:
        # The request for o3 is held back past its timeout: its replies come late.
        if b'"rp.org.o3"' in payload:
            await asyncio.sleep(1.0)
        await publish(subject, payload, **kw)

    monkeypatch.setattr(nc, "publish", late)
    slow = asyncio.create_task(reader.read(org(3)))
    others = await asyncio.gather(*(reader.read(org(i)) for i in range(10) if i != 3))
    with pytest.raises(StoreError, match="timed out"):
        await slow
    for i, envs in zip((i for i in range(10) if i != 3), others, strict=True):
        own(org(i), envs, seqs[org(i)])
    monkeypatch.setattr(nc, "publish", publish)
    await asyncio.sleep(1.0)  # the late replies arrive for a read no longer waiting
    own(org(3), await reader.read(org(3)), seqs[org(3)])
    assert reader.direct._reads == {}


async def test_a_cancelled_read_is_forgotten(nc: NATS, store: EventStore) -> None:
    await seed(store, 3)
    reader = EventStore(nc)
    task = asyncio.create_task(reader.read(org(1)))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert reader.direct._reads == {}
    assert len(await reader.read(org(1))) == 2


async def test_an_error_status_raises_a_store_error(nc: NATS) -> None:
    with pytest.raises(StoreError, match="direct get failed: 503"):
        await EventStore(nc, stream="RP_NO_SUCH_STREAM").read("rp.org.x")


async def test_a_lost_subscription_is_made_again(nc: NATS, store: EventStore) -> None:
    seqs = await seed(store, 3)
    reader = EventStore(nc)
    own(org(2), await reader.read(org(2)), seqs[org(2)])
    assert reader.direct._sub is not None
    await reader.direct._sub.unsubscribe()
    own(org(2), await reader.read(org(2)), seqs[org(2)])


async def test_reads_work_after_the_server_restarts(
    nc: NATS, store: EventStore, nats_server: EmbeddedNats
) -> None:
    seqs = await seed(store, 5)
    reader = EventStore(nc, timeout=2.0)
    own(org(4), await reader.read(org(4)), seqs[org(4)])
    subs = len(nc._subs)
    await nats_server.stop()
    async with EmbeddedNats(nats_server.data_dir, port=nats_server.port):
        await wait_for_stream(nc)
        event = TokenIssued(
            at=NOW, actor="a", token_id="o4-new", token_hash="h", user="u", role="admin"
        )
        seq = await store.append([Append(subject=org(4), event=event, expected=seqs[org(4)][-1])])
        envs = await reader.read(org(4))
        own(org(4), envs, [*seqs[org(4)], seq])
        results = await asyncio.gather(*(reader.read(org(i)) for i in range(4)))
        for i, got in enumerate(results):
            own(org(i), got, seqs[org(i)])
        assert len(nc._subs) == subs  # resubscribed by nats-py, not subscribed again


async def test_a_floor_costs_no_leader_read_on_a_stream_of_one_replica(
    store: EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One replica has no follower to lag: a read under a floor its subject does not reach
    (the event that woke the reader was on another subject) is whole as read."""
    seqs = await seed(store, 3)
    asked: list[str] = []
    real = store._leader_tail

    async def leader_tail(subject: str, start: int, most: int = 0) -> Any:
        asked.append(subject)
        return await real(subject, start, most)

    monkeypatch.setattr(store, "_leader_tail", leader_tail)
    token = eventstore.floor.set(max(max(s) for s in seqs.values()) + 100)
    try:
        got = await store.read(org(1))
    finally:
        eventstore.floor.reset(token)
    assert [e.seq for e in got] == seqs[org(1)]
    assert asked == []
    store._replicated, store._replicas_at = True, float("inf")  # as a replicated stream
    token = eventstore.floor.set(max(max(s) for s in seqs.values()) + 100)
    try:
        await store.read(org(2))
    finally:
        eventstore.floor.reset(token)
    assert asked == [org(2)]
