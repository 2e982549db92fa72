"""The one consumer loop (infra/consumer.py) against real JetStream: how a
handler's outcome settles its message, lanes (in order within, in parallel across, a
stuck one holding nobody else), in-progress ticks, state folded through the event, and a
subscriber that falls behind never slowing admission."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

import nats.errors
import pytest
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from events import run as R
from events.errors import Invalid
from infra import consumer as C
from infra import streams
from infra.consumer import Consumer, Received, Retry, Subscription
from services.app.commands import App
from tests.bootstrap_support import Process
from tests.builders import workspaces
from tests.helpers import eventually

ORG = "acme"
ALL = ("rp.run.>", "rp.ws.>")
LANE_LIMIT = 4


async def _info(nc: NATS, name: str) -> Any:
    return await nc.jetstream().consumer_info(streams.EVENTS, streams.subscriber_consumer(name))


def _settled(nc: NATS, name: str) -> Any:
    """A probe: every message of the subscription delivered and settled (none pending,
    none waiting for an ack or a redelivery)."""

    async def probe() -> bool:
        info = await _info(nc, name)
        return info.num_pending == 0 and info.num_ack_pending == 0

    return probe


class Calls:
    """What a handler saw, by event type."""

    def __init__(self) -> None:
        self.seen: list[Received] = []

    def of(self, type_: str) -> list[Received]:
        return [r for r in self.seen if r.type == type_]

    def count(self, type_: str) -> Any:
        async def probe() -> int:
            return len(self.of(type_))

        return probe


async def test_a_handler_that_returns_has_its_message_acked_once(nc: NATS, app: App) -> None:
    calls = Calls()

    async def handle(r: Received) -> None:
        calls.seen.append(r)

    sub = Subscription(name="t-ack", handle=handle, subjects=ALL)
    async with Consumer(nc, sub, states=app.states) as c:
        await c.ready.wait()
        await workspaces(app, "net")
        run_id = (await app.create_run(ORG, "net", "apply", "alice")).state.run_id
        await eventually(calls.count("ws.run_enqueued"), what="enqueue handled")
        await eventually(_settled(nc, "t-ack"), what="all acked")
    (created,) = calls.of("run.created")
    assert created.subject == f"rp.run.{ORG}.net.{run_id}"
    assert (created.org, created.ws, created.run_id) == (ORG, "net", run_id)
    assert created.num_delivered == 1 and created.state is None
    assert isinstance(created.event, R.RunCreated) and created.seq > 0
    assert [r.type for r in calls.seen] == ["ws.created", "run.created", "ws.run_enqueued"]


async def test_a_declaration_jetstream_does_not_answer_is_sent_again_not_fatal(
    nc: NATS, app: App
) -> None:
    """A replica started while its cluster elects a leader: the durable's declaration
    times out (the cluster suite's subscribers exited 1, "nats: timeout"). It is sent
    again until answered, and the consumer then delivers."""
    calls = Calls()
    unanswered = 2

    async def handle(r: Received) -> None:
        calls.seen.append(r)

    async def electing(js: JetStreamContext) -> None:
        nonlocal unanswered
        if unanswered:
            unanswered -= 1
            raise nats.errors.TimeoutError
        await streams.ensure_subscriber_consumer(js, "t-declare", ALL)

    sub = Subscription(name="t-declare", handle=handle, subjects=ALL)
    async with Consumer(nc, sub, states=app.states, declare=electing) as c:
        await c.ready.wait()
        await workspaces(app, "net")
        await eventually(calls.count("ws.created"), what="the workspace's event handled")
    assert unanswered == 0


async def test_retry_with_a_delay_brings_the_event_back_after_it(nc: NATS, app: App) -> None:
    calls = Calls()
    loop = asyncio.get_running_loop()
    times: list[float] = []

    async def handle(r: Received) -> None:
        calls.seen.append(r)
        times.append(loop.time())
        if r.num_delivered == 1:
            raise Retry(0.6, "not yet")

    sub = Subscription(name="t-retry", handle=handle)
    async with Consumer(nc, sub, states=app.states):
        await workspaces(app, "net")
        await app.create_run(ORG, "net", "apply", "alice")
        await eventually(calls.count("run.created"), what="first delivery")
        await eventually(lambda: _at_least(calls.count("run.created"), 2), what="redelivered")
        await eventually(_settled(nc, "t-retry"), what="acked the second time")
    first, second = calls.of("run.created")
    assert (first.num_delivered, second.num_delivered) == (1, 2)
    assert first.seq == second.seq
    assert times[1] - times[0] >= 0.55  # not before its delay


async def _at_least(probe: Any, n: int) -> bool:
    return bool(await probe() >= n)


async def test_a_permanent_error_terminates_the_message(nc: NATS, app: App) -> None:
    """`retryable=False`: the message is given up (term), never delivered again."""
    calls = Calls()

    async def handle(r: Received) -> None:
        calls.seen.append(r)
        raise Invalid("this event can never be handled")

    sub = Subscription(name="t-term", handle=handle)
    async with Consumer(nc, sub, states=app.states):
        await workspaces(app, "net")
        await app.create_run(ORG, "net", "apply", "alice")
        await eventually(calls.count("run.created"), what="delivered")
        await eventually(_settled(nc, "t-term"), what="settled: terminated")
        info = await _info(nc, "t-term")
    assert info.num_redelivered == 0
    assert len(calls.of("run.created")) == 1


async def test_any_other_error_is_retried_soon(nc: NATS, app: App) -> None:
    calls = Calls()

    async def handle(r: Received) -> None:
        calls.seen.append(r)
        if r.num_delivered == 1:
            raise RuntimeError("a bug, or a hiccup")

    sub = Subscription(name="t-nak", handle=handle)
    async with Consumer(nc, sub, states=app.states):
        await workspaces(app, "net")
        await app.create_run(ORG, "net", "apply", "alice")
        await eventually(lambda: _at_least(calls.count("run.created"), 2), what="redelivered")
        await eventually(_settled(nc, "t-nak"), what="acked")
    assert [r.num_delivered for r in calls.of("run.created")] == [1, 2]


async def test_lanes_keep_order_within_a_workspace_and_run_in_parallel_across(
    nc: NATS, app: App
) -> None:
    """Workspace a's first event waits for b's first handler: with one lane at a time it
    would wait for ever. Within a lane the sequences come in order."""
    await workspaces(app, "a", "b")
    for _ in range(5):
        for ws in ("a", "b"):
            await app.create_run(ORG, ws, "apply", "alice")
    b_started = asyncio.Event()
    by_lane: dict[str, list[int]] = defaultdict(list)
    running: set[str] = set()
    overlapped = []

    async def handle(r: Received) -> None:
        running.add(r.ws)
        if len(running) > 1:
            overlapped.append(r.seq)
        if r.ws == "b":
            b_started.set()
        else:
            await asyncio.wait_for(b_started.wait(), 10)
        await asyncio.sleep(0)  # let the other lane in
        by_lane[r.ws].append(r.seq)
        running.discard(r.ws)

    sub = Subscription(name="t-lanes", handle=handle, subjects=ALL, start="all")
    async with Consumer(nc, sub, states=app.states):
        await eventually(_settled(nc, "t-lanes"), what="all handled")
    assert len(by_lane["a"]) == len(by_lane["b"]) == 11  # ws.created, 5 x (created, enqueued)
    for seqs in by_lane.values():
        assert seqs == sorted(seqs)
    assert overlapped  # the lanes ran at once


async def test_a_handler_that_hangs_in_one_lane_delays_no_other_lane(nc: NATS, app: App) -> None:
    stuck = asyncio.Event()
    handled: list[str] = []

    async def handle(r: Received) -> None:
        if r.ws == "stuck":
            stuck.set()
            await asyncio.Event().wait()  # hangs for ever
        handled.append(r.ws)

    sub = Subscription(name="t-hang", handle=handle, subjects=ALL, lane_limit=LANE_LIMIT)
    async with Consumer(nc, sub, states=app.states, batch=8) as c:
        await c.ready.wait()
        await workspaces(app, "stuck", "free")
        for _ in range(40):  # 81 events: more than the room every lane shares (64)
            await app.create_run(ORG, "stuck", "apply", "alice")
        await stuck.wait()
        for _ in range(10):
            await app.create_run(ORG, "free", "apply", "alice")
        await eventually(lambda: _count(handled, "free", 21), what="the free lane handled")
    assert "stuck" not in handled


async def _count(items: list[str], value: str, n: int) -> bool:
    return items.count(value) >= n


async def test_a_message_in_hand_longer_than_the_ack_wait_is_not_redelivered(
    nc: NATS, app: App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-progress ticks keep a slow handler's message its own (ack wait 1 s, handler 2.5 s)."""
    monkeypatch.setattr(C, "PROGRESS_EVERY", 0.3)
    calls = Calls()

    async def handle(r: Received) -> None:
        calls.seen.append(r)
        await asyncio.sleep(2.5)

    async def declare(js: JetStreamContext) -> None:
        await js.add_consumer(
            streams.EVENTS,
            ConsumerConfig(
                durable_name="t-slow",
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.ALL,
                filter_subject="rp.run.>",
                ack_wait=1,
                max_deliver=-1,
            ),
        )

    await workspaces(app, "net")
    await app.create_run(ORG, "net", "apply", "alice")
    sub = Subscription(name="slow", handle=handle)
    async with Consumer(nc, sub, states=app.states, durable="t-slow", declare=declare):
        await eventually(calls.count("run.created"), what="delivered")
        info = await nc.jetstream().consumer_info(streams.EVENTS, "t-slow")

        async def acked() -> bool:
            i = await nc.jetstream().consumer_info(streams.EVENTS, "t-slow")
            return i.num_ack_pending == 0

        await eventually(acked, timeout=10, what="acked")
        info = await nc.jetstream().consumer_info(streams.EVENTS, "t-slow")
    assert info.num_redelivered == 0
    assert len(calls.seen) == 1


async def test_with_state_the_aggregate_is_folded_through_the_event_not_later(
    nc: NATS, app: App
) -> None:
    await workspaces(app, "net")
    run_id = (await app.create_run(ORG, "net", "apply", "alice")).state.run_id
    assert await app.admit_next(ORG, "net") == run_id  # run.queued, after the created
    await app.run_command(ORG, "net", run_id, R.CancelRun(actor="alice"))
    calls = Calls()

    async def handle(r: Received) -> None:
        calls.seen.append(r)

    sub = Subscription(name="t-state", handle=handle, subjects=ALL, with_state=True, start="all")
    async with Consumer(nc, sub, states=app.states):
        await eventually(_settled(nc, "t-state"), what="all handled")
    statuses = [(r.type, r.state.status) for r in calls.seen if isinstance(r.state, R.RunState)]
    assert statuses == [
        ("run.created", R.Status.PENDING),
        ("run.queued", R.Status.QUEUED),
        ("run.canceled", R.Status.CANCELED),
    ]
    (queued,) = calls.of("run.queued")
    assert isinstance(queued.event, R.RunQueued) and queued.event.status == R.Status.QUEUED
    ws_states = [(r.type, r.state) for r in calls.seen if r.subject == f"rp.ws.{ORG}.net"]
    assert [(t, s.queue, s.active) for t, s in ws_states] == [  # type: ignore[union-attr]
        ("ws.created", (), ""),
        ("ws.run_enqueued", (run_id,), ""),
        ("ws.run_admitted", (), run_id),
        ("ws.run_released", (), ""),
    ]


async def test_a_subscriber_that_falls_behind_does_not_slow_admission(
    nc: NATS, app: App, process: Process
) -> None:
    """A subscriber whose handler never returns holds its own durable only: the scheduler
    still admits and dispatches every run."""
    blocked = asyncio.Event()

    async def handle(r: Received) -> None:
        blocked.set()
        await asyncio.Event().wait()

    await workspaces(app, *(f"w{i}" for i in range(5)))
    sub = Subscription(name="t-behind", handle=handle, subjects=ALL, start="all")
    async with Consumer(nc, sub, states=app.states), process(store=app.store).scheduler():
        await blocked.wait()
        runs = [
            (await app.create_run(ORG, f"w{i}", "apply", "alice")).state.run_id for i in range(5)
        ]

        async def all_queued() -> bool:
            states = [(await app.load_run(ORG, f"w{i}", r)).state for i, r in enumerate(runs)]
            return all(s.status == R.Status.QUEUED for s in states)

        await eventually(all_queued, timeout=15, what="every run admitted")
        info = await nc.jetstream().stream_info(streams.DISPATCH)
        assert info.state.messages == 5  # and dispatched
    behind = await _info(nc, "t-behind")
    assert behind.num_pending + behind.num_ack_pending > 5  # the subscriber is behind


async def test_an_event_redelivered_after_later_ones_sees_its_own_state(nc: NATS, app: App) -> None:
    """A `run.created` put back comes after the run's `run.queued` was folded: it still
    sees the run as it was through itself, pending."""
    await workspaces(app, "net")
    run_id = (await app.create_run(ORG, "net", "apply", "alice")).state.run_id
    assert await app.admit_next(ORG, "net") == run_id
    calls = Calls()

    async def handle(r: Received) -> None:
        calls.seen.append(r)
        if r.type == "run.created" and r.num_delivered == 1:
            raise Retry(0.3)

    sub = Subscription(name="t-again", handle=handle, with_state=True, start="all")
    async with Consumer(nc, sub, states=app.states):
        await eventually(lambda: _at_least(calls.count("run.created"), 2), what="redelivered")
        await eventually(_settled(nc, "t-again"), what="all handled")
    order = [(r.type, r.num_delivered, r.state.status) for r in calls.seen]  # type: ignore[union-attr]
    assert order == [
        ("run.created", 1, R.Status.PENDING),
        ("run.queued", 1, R.Status.QUEUED),
        ("run.created", 2, R.Status.PENDING),
    ]
