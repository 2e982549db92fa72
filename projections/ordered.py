"""Ordered, gap-free reading of a stream from a start sequence (an "ordered consumer").

Why not nats-py's `js.subscribe(ordered_consumer=True)` (measured with nats-py 2.16):

- with `next_msg` it creates one task per message and tops out near 27,000 msg/s;
- with a callback it answers flow control as soon as a message is *received*, so nothing
  holds the server back, and if the pending queue overflows the dropped message has already
  advanced the ordered sequence: it is lost without a reset;
- a reset before the first message restarts the consumer at sequence 1, not at the
  requested start.

This reader creates an ephemeral push consumer (flow control, idle heartbeats, no acks,
in memory), queues what arrives and answers a flow-control request only when the caller
has taken every message before it, which bounds what is buffered to the server's
flow-control window. A gap in the consumer sequence, a heartbeat that reports messages we
never saw, or silence for three heartbeats (a restarted server forgets ephemeral
consumers) recreates the consumer from the last sequence handed out.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from types import TracebackType
from typing import NamedTuple, Self

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from infra.tasks import cancel_and_wait

log = structlog.get_logger(__name__)

_STATUS = "Status"
_LAST_CONSUMER = "Nats-Last-Consumer"
_STALLED = "Nats-Consumer-Stalled"
_V1_TOKENS = 9  # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>


class Delivered(NamedTuple):
    """One stream message, reduced to what a projection needs."""

    seq: int
    subject: str
    data: bytes
    time_ns: int  # when the server stored it, nanoseconds since the epoch
    headers: dict[str, str] | None = None  # the message's own headers (live log lines)


class OrderedReader:
    """Hand out a stream's messages in sequence order, from `start_seq` on, in batches."""

    def __init__(
        self,
        nc: NATS,
        stream: str,
        *,
        start_seq: int = 1,
        idle_heartbeat: float = 1.0,
        filter_subject: str | None = None,
        filter_subjects: list[str] | None = None,
    ) -> None:
        self.nc = nc
        self.stream = stream
        self.last = start_seq - 1  # the last sequence handed out
        self.idle_heartbeat = idle_heartbeat
        self.filter_subject = filter_subject
        self.filter_subjects = filter_subjects  # several (instead of `filter_subject`)
        # the messages the first consumer had to deliver when made (-1: not made yet):
        # whoever reads to the stream's end as it was at the start knows when it got there
        self.pending = -1
        # A deque and an event rather than an asyncio.Queue: a replay puts a million
        # messages through here, and Queue.put_nowait/get_nowait cost several times more.
        self._queue: deque[tuple[int, Msg]] = deque()
        self._arrived = asyncio.Event()
        self._gen = 0  # bumped by every reset; messages of older generations are dropped
        self._cseq = 0  # the consumer sequence of the last message taken
        self._sub: Subscription | None = None
        self._consumer = ""
        self._seen = 0.0  # loop time of the last message or heartbeat received
        self._lock = asyncio.Lock()
        self._watchdog: asyncio.Task[None] | None = None
        self.resets = 0

    async def __aenter__(self) -> Self:
        async with self._lock:
            await self._create()
        self._watchdog = asyncio.create_task(self._watch(), name=f"ordered-{self.stream}")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await cancel_and_wait(self._watchdog)
        await self._drop_consumer()

    # ------------------------------------------------------------ reading

    async def next_batch(self, max_msgs: int, timeout: float | None = None) -> list[Delivered]:
        """Wait for at least one message, then take what is already buffered, up to max_msgs.

        Raises TimeoutError if nothing arrives within `timeout` seconds.
        """
        out: list[Delivered] = []
        async with asyncio.timeout(timeout):
            while not out:
                while not self._queue:
                    self._arrived.clear()
                    await self._arrived.wait()
                gen, msg = self._queue.popleft()
                await self._take(gen, msg, out)
                while len(out) < max_msgs and self._queue:
                    gen, msg = self._queue.popleft()
                    await self._take(gen, msg, out)
        return out

    @property
    def received_last(self) -> int:
        """The stream sequence of the last message received: handed out, or still buffered
        (parsed here, on demand, not per message)."""
        for gen, msg in reversed(self._queue):
            if gen == self._gen and msg.reply.startswith("$JS.ACK."):
                tokens = msg.reply.split(".")
                return int(tokens[5 if len(tokens) == _V1_TOKENS else 7])
        return self.last

    async def _take(self, gen: int, msg: Msg, out: list[Delivered]) -> None:
        if gen != self._gen:
            return
        status = msg.headers.get(_STATUS) if msg.headers else None
        if status is not None:
            await self._control(status, msg)
            return
        tokens = msg.reply.split(".")
        off = 0 if len(tokens) == _V1_TOKENS else 2  # v2 adds domain and account hash
        cseq = int(tokens[6 + off])
        if cseq != self._cseq + 1:
            log.warning("ordered_gap", stream=self.stream, expected=self._cseq + 1, got=cseq)
            await self._reset()
            return
        self._cseq = cseq
        self.last = int(tokens[5 + off])
        out.append(Delivered(self.last, msg.subject, msg.data, int(tokens[7 + off]), msg.headers))

    async def _control(self, status: str, msg: Msg) -> None:
        """Answer flow control, notice stalls and gaps reported by heartbeats."""
        hdrs = msg.headers or {}
        if status != "100":  # e.g. 409 consumer deleted: start over
            log.warning("ordered_status", stream=self.stream, status=status)
            await self._reset()
        elif msg.reply:  # flow control: everything sent before it has been taken
            await self.nc.publish(msg.reply)
        else:  # idle heartbeat
            if stalled := hdrs.get(_STALLED):
                await self.nc.publish(stalled)
            last = hdrs.get(_LAST_CONSUMER)
            if last is not None and int(last) != self._cseq:
                await self._reset()

    # ------------------------------------------------------------ the consumer

    async def _create(self) -> None:
        """Subscribe a fresh inbox and create the consumer from the next sequence."""
        gen = self._gen
        inbox = self.nc.new_inbox()

        async def received(msg: Msg) -> None:
            self._seen = asyncio.get_running_loop().time()
            self._queue.append((gen, msg))
            self._arrived.set()

        sub = await self.nc.subscribe(inbox, cb=received)
        config = ConsumerConfig(
            deliver_subject=inbox,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=self.last + 1,
            ack_policy=AckPolicy.NONE,
            max_deliver=1,
            flow_control=True,
            idle_heartbeat=self.idle_heartbeat,
            mem_storage=True,
            num_replicas=1,
            inactive_threshold=max(5.0, 5 * self.idle_heartbeat),
            filter_subject=self.filter_subject,
            filter_subjects=self.filter_subjects,
        )
        try:
            info = await self.nc.jetstream().add_consumer(self.stream, config, timeout=5)
        except BaseException:
            await sub.unsubscribe()
            raise
        self._sub, self._consumer = sub, info.name
        if self.pending < 0:
            self.pending = info.num_pending or 0
        self._seen = asyncio.get_running_loop().time()

    async def _reset(self) -> None:
        """Replace the consumer, resuming after the last sequence handed out."""
        async with self._lock:
            self._gen += 1
            self._cseq = 0
            self.resets += 1
            await self._drop_consumer()
            try:
                await self._create()
            except Exception as e:  # noqa: BLE001 - whatever failed, the watchdog retries
                log.warning("ordered_recreate_failed", stream=self.stream, error=repr(e))
                self._seen = asyncio.get_running_loop().time()
            else:
                log.info("ordered_reset", stream=self.stream, start_seq=self.last + 1)

    async def _drop_consumer(self) -> None:
        """Unsubscribe and delete the consumer; either may fail when the server is away."""
        sub, self._sub = self._sub, None
        name, self._consumer = self._consumer, ""
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if name and self.nc.is_connected:
            with contextlib.suppress(Exception):
                await self.nc.jetstream().delete_consumer(self.stream, name)

    async def _watch(self) -> None:
        """Recreate the consumer when the server has been silent for three heartbeats."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.idle_heartbeat)
            silent = loop.time() - self._seen > 3 * self.idle_heartbeat
            if self._sub is None or silent:
                await self._reset()
