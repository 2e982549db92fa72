"""One direct-get reader (infra/directget.py) under the event store, the KV
buckets, the step logs and the heartbeat board: one error root with `retryable`, and
reads that share one inbox subscription instead of subscribing each time."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from infra import kv, steplogs
from infra.directget import DirectReader, InfraError, ReadError, as_raw
from infra.eventstore import EventStore, StoreError
from infra.heartbeats import Board, BoardError, body, subject
from infra.streams import LOGS


async def test_every_adapters_error_is_an_infra_error_that_may_be_retried(nc: NATS) -> None:
    """A stream that is not there answers a direct get with an error status."""
    reads: list[tuple[type[InfraError], Any]] = [
        (StoreError, EventStore(nc, stream="RP_NONE").read("rp.org.x")),
        (BoardError, Board(nc, stream="RP_NONE").last("r", "plan")),
        (kv.KvError, kv.direct_last_values(nc, "rp-none", "*")),
        (steplogs.LogError, steplogs.direct_batch(nc, "RP_NONE", "rp.log.>", 1)),
    ]
    for kind, read in reads:
        with pytest.raises(kind, match="direct get failed: 503") as info:
            await read
        assert isinstance(info.value, InfraError) and info.value.retryable


async def test_board_kv_and_log_reads_do_not_subscribe_each_time(nc: NATS) -> None:
    board = Board(nc)
    for i in range(5):
        assert await board.put(subject(f"r{i}", "plan"), body(lease_id=f"l{i}", timeout=60))
        await nc.publish(
            f"rp.log.r{i}.plan.init", b"line", headers=steplogs.live_headers("stdout", 1)
        )
    await nc.jetstream().key_value(kv.SECRETS_BUCKET)
    await board.last("r0", "plan")  # the first read subscribes, once
    subs, sid = len(nc._subs), nc._sid
    for _ in range(3):
        _, beats = await board.snapshot()
        assert len(beats) == 5
        found = await asyncio.gather(*(Board(nc).last(f"r{i}", "plan") for i in range(5)))
        assert [b.lease_id for b in found if b] == [f"l{i}" for i in range(5)]
        await kv.direct_last_values(nc, kv.SECRETS_BUCKET, "acme.net.*")
        assert len(await steplogs.read_live(nc, "rp.log.*.plan.init")) == 5
    assert len(nc._subs) == subs
    assert nc._sid == sid  # not one SUB (nor UNSUB) sent for these reads


async def test_a_read_that_gets_no_answer_times_out_with_the_callers_error(nc: NATS) -> None:
    reader = DirectReader(nc)
    silent = await nc.subscribe("rp.silent.server")  # takes the request, never answers
    with pytest.raises(BoardError, match="reading nothing timed out"):
        await reader.one(
            "rp.silent.server", b"", as_raw, what="nothing", error=BoardError, timeout=0.2
        )
    with pytest.raises(ReadError, match="timed out"):
        await reader.batch(LOGS, {"seq": 1}, as_raw, what="x", timeout=0.0001)
    assert reader._reads == {}
    await silent.unsubscribe()


async def test_a_reply_the_reader_cannot_parse_fails_that_read_alone(nc: NATS) -> None:
    board = Board(nc)
    assert await board.put(subject("r1", "plan"), body(lease_id="l1"))

    def broken(hdrs: dict[str, str], data: bytes) -> Any:
        raise ValueError("not what I expected")

    reader = DirectReader.of(nc)
    with pytest.raises(ValueError, match="not what I expected"):
        await reader.last(board.stream, subject("r1", "plan"), broken, what="r1")
    assert (await board.last("r1", "plan")) is not None
