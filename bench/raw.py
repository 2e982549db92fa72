"""The raw limits: what nats-py and nats-server do with nothing of runplane in the way.

- sync publish: one `js.publish` at a time, each awaited (msgs/s, p50, p99);
- pipelined checked appends: many subjects at once, each message carrying
  `Nats-Expected-Last-Subject-Sequence` (and a `Nats-Msg-Id`, as every runplane append
  does), a subject's next append sent when its previous one is acknowledged;
- replay: the whole stream through nats-py's ordered consumer, each message decoded with
  msgspec into the same typed event schema runplane stores.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from events.codec import AnyEvent, encode
from events.run import RunCreated, Workspace
from infra.streams import EVENTS

from .common import percentile


class _Ack(msgspec.Struct):
    seq: int = 0
    error: dict[str, object] | None = None


_ack = msgspec.json.Decoder(_Ack)


def sample_event(i: int = 0) -> bytes:
    """A real encoded runplane event of a typical size (~300 bytes)."""
    config = Workspace(
        repository="https://git.example.com/infra/network.git",
        variables={"region": "eu-west-1", "env": "production"},
    )
    ev = RunCreated(
        at=datetime(2026, 1, 1, tzinfo=UTC),
        actor="alice@example.com",
        run_id=f"{i:026d}",
        org="bench",
        workspace="network",
        run_type="apply",
        config=config,
        message="bump the vpc",
    )
    return encode(ev)


async def sync_publish(nc: NATS, n: int) -> dict[str, float]:
    """`js.publish`, one at a time: the latency floor of one acknowledged append."""
    js = nc.jetstream()
    data = sample_event()
    for i in range(50):  # warm the connection and the stream
        await js.publish(f"rp.run.bench.warm.r{i}", data)
    lat: list[float] = []
    start = time.perf_counter()
    for i in range(n):
        t = time.perf_counter()
        await js.publish(f"rp.run.bench.sync.r{i % 1000}", data, stream=EVENTS)
        lat.append(time.perf_counter() - t)
    elapsed = time.perf_counter() - start
    return {
        "msgs": n,
        "msgs_per_s": n / elapsed,
        "p50_ms": percentile(lat, 50) * 1000,
        "p99_ms": percentile(lat, 99) * 1000,
    }


async def pipelined_publish(nc: NATS, subjects: int, n: int) -> dict[str, float]:
    """Checked appends over many subjects at once, each chained on its subject's last
    sequence: the most a writer with optimistic concurrency can get through."""
    data = sample_event(1)
    per = max(1, n // subjects)
    conflicts = 0
    prefix = uuid.uuid4().hex[:8]

    async def chain(k: int) -> None:
        nonlocal conflicts
        subject = f"rp.run.bench.pipe{prefix}.r{k}"
        last = 0
        for _ in range(per):
            msg = await nc.request(
                subject,
                data,
                timeout=10,
                headers={
                    "Nats-Expected-Last-Subject-Sequence": str(last),
                    "Nats-Msg-Id": uuid.uuid4().hex,
                },
            )
            ack = _ack.decode(msg.data)
            if ack.error:
                conflicts += 1
                raise RuntimeError(f"raw append refused: {ack.error}")
            last = ack.seq

    start = time.perf_counter()
    await asyncio.gather(*(chain(k) for k in range(subjects)))
    elapsed = time.perf_counter() - start
    total = per * subjects
    return {"msgs": total, "subjects": subjects, "msgs_per_s": total / elapsed}


async def _checked_batch(
    nc: NATS, subjects: tuple[str, str], last: list[int], data: bytes
) -> list[int]:
    """One atomic batch of one message per subject, each expecting its subject's `last`
    sequence; the subjects' new last sequences."""
    batch = uuid.uuid4().hex
    for i, subject in enumerate(subjects):
        headers = {
            "Nats-Batch-Id": batch,
            "Nats-Batch-Sequence": str(i + 1),
            "Nats-Expected-Last-Subject-Sequence": str(last[i]),
            "Nats-Msg-Id": uuid.uuid4().hex,
        }
        if i == 0:
            await nc.publish(subject, data, headers=headers)
            continue
        headers["Nats-Batch-Commit"] = "1"
        ack = _ack.decode((await nc.request(subject, data, timeout=10, headers=headers)).data)
        if ack.error:
            raise RuntimeError(f"raw batch refused: {ack.error}")
        return [ack.seq - 1, ack.seq]
    raise AssertionError("unreachable")


async def pipelined_batches(nc: NATS, chains: int, batches: int) -> dict[str, float]:
    """Checked two-message atomic batches (one message on a run subject, one on a workspace
    subject, as runplane's create, admission and release are), many chains at once."""
    data = sample_event(2)
    per = max(1, batches // chains)
    prefix = uuid.uuid4().hex[:8]

    async def chain(k: int) -> None:
        subjects = (f"rp.run.bench.b{prefix}.r{k}", f"rp.ws.bench.b{prefix}x{k}")
        last = [0, 0]
        for _ in range(per):
            last = await _checked_batch(nc, subjects, last, data)

    lat: list[float] = []
    one = 200

    async def timed(k: int) -> None:  # one batch at a time, each awaited alone
        subjects = (f"rp.run.bench.s{prefix}.r{k}", f"rp.ws.bench.s{prefix}x{k}")
        last = [0, 0]
        for _ in range(one):
            t = time.perf_counter()
            last = await _checked_batch(nc, subjects, last, data)
            lat.append(time.perf_counter() - t)

    await timed(0)  # one at a time: the latency of one atomic batch
    start = time.perf_counter()
    await asyncio.gather(*(chain(k) for k in range(chains)))
    elapsed = time.perf_counter() - start
    total = per * chains
    return {
        "batches": total,
        "chains": chains,
        "batches_per_s": total / elapsed,
        "msgs_per_s": 2 * total / elapsed,
        "sync_batches": one,
        "sync_p50_ms": percentile(lat, 50) * 1000,
        "sync_p99_ms": percentile(lat, 99) * 1000,
    }


async def push_replay(nc: NATS, expected: int, stream: str = EVENTS) -> dict[str, float]:
    """The ordered consumer at the protocol level (what nats-py's does, minus its per-message
    bookkeeping): an ephemeral push consumer, no acks, flow control answered in order, every
    message decoded in the subscription's callback. The fastest raw replay we found."""
    js = nc.jetstream()
    decoder = msgspec.json.Decoder(AnyEvent)
    done = asyncio.Event()
    count = 0
    undecodable = 0

    async def on_msg(msg: Msg) -> None:
        nonlocal count, undecodable
        if msg.headers and "Status" in msg.headers:
            if msg.reply:  # flow control: everything before it has been handled
                await nc.publish(msg.reply)
            return
        try:
            decoder.decode(msg.data)
        except msgspec.DecodeError:
            undecodable += 1
        count += 1
        if count >= expected:
            done.set()

    inbox = nc.new_inbox()
    start = time.perf_counter()
    sub = await nc.subscribe(
        inbox, cb=on_msg, pending_msgs_limit=2_000_000, pending_bytes_limit=1024**3
    )
    info = await js.add_consumer(
        stream,
        ConsumerConfig(
            deliver_subject=inbox,
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.NONE,
            flow_control=True,
            idle_heartbeat=5.0,
            mem_storage=True,
            num_replicas=1,
            inactive_threshold=30.0,
        ),
    )
    try:
        await asyncio.wait_for(done.wait(), timeout=600)
    finally:
        elapsed = time.perf_counter() - start
        await sub.unsubscribe()
        await js.delete_consumer(stream, info.name)
    return {"msgs": count, "msgs_per_s": count / elapsed, "undecodable": undecodable}


async def ordered_replay(nc: NATS, expected: int, stream: str = EVENTS) -> dict[str, float]:
    """Read the whole stream with nats-py's ordered consumer, decoding every message."""
    js = nc.jetstream()
    decoder = msgspec.json.Decoder(AnyEvent)
    done = asyncio.Event()
    count = 0
    undecodable = 0

    async def on_msg(msg: Msg) -> None:
        nonlocal count, undecodable
        try:
            decoder.decode(msg.data)
        except msgspec.DecodeError:
            undecodable += 1
        count += 1
        if count >= expected:
            done.set()

    start = time.perf_counter()
    sub = await js.subscribe(
        "rp.>",
        stream=stream,
        ordered_consumer=True,
        cb=on_msg,
        deliver_policy=DeliverPolicy.ALL,
        pending_msgs_limit=2_000_000,
        pending_bytes_limit=1024 * 1024 * 1024,
    )
    try:
        await asyncio.wait_for(done.wait(), timeout=600)
    finally:
        elapsed = time.perf_counter() - start
        await sub.unsubscribe()
    return {"msgs": count, "msgs_per_s": count / elapsed, "undecodable": undecodable}
