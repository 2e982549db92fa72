"""What the subscribers process spends per event (issue 25: the audit log's cost on the
create path, bench/latency.py): its subscriptions fold each run event once between them,
not once each, and a subscription fetches a trickle of events in batches. Against real
JetStream; the scheduler's consumer (no reuse, no linger) is shown unchanged beside."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from nats.aio.client import Client as NATS

from events import run as R
from events.run import RunState
from infra.consumer import Consumer, Received, Subscription
from infra.eventstore import EventStore
from infra.folds import States
from services.app.commands import App
from services.processes.subscribers import host
from tests.builders import workspaces
from tests.helpers import eventually

ORG = "acme"


class CountingStore(EventStore):
    """An event store counting its reads by subject."""

    def __init__(self, nc: NATS) -> None:
        super().__init__(nc)
        self.reads: Counter[str] = Counter()

    async def read(self, subject: str, after: int = 0, *, min_seq: int = 0) -> Any:
        self.reads[subject] += 1
        return await super().read(subject, after, min_seq=min_seq)


async def _two_subscriptions(nc: NATS, app: App, name: str, *, reuse: bool) -> tuple[Any, ...]:
    """Two with-state subscriptions of one process (their own States, as in a process
    that wrote none of the events) over one created run: what each saw, and the reads."""
    store = CountingStore(nc)
    states = States(store)
    seen: dict[str, list[Received]] = {"a": [], "b": []}

    def handler(key: str) -> Any:
        async def handle(r: Received) -> None:
            seen[key].append(r)

        return handle

    consumers = [
        Consumer(
            nc,
            Subscription(name=f"{name}-{key}", handle=handler(key), with_state=True),
            states=states,
            reuse_folds=reuse,
        )
        for key in seen
    ]
    for c in consumers:
        await c.start()
    try:
        await asyncio.gather(*(c.ready.wait() for c in consumers))
        await workspaces(app, f"ws-{name}")
        run_id = (await app.create_run(ORG, f"ws-{name}", "apply", "alice")).state.run_id

        async def both_saw_it() -> bool:
            return all(any(r.type == "run.created" for r in rs) for rs in seen.values())

        await eventually(both_saw_it, what="both subscriptions handled run.created")
    finally:
        for c in consumers:
            await c.stop()
    subject = f"rp.run.{ORG}.ws-{name}.{run_id}"
    created = [next(r for r in rs if r.type == "run.created") for rs in seen.values()]
    return created, store.reads[subject]


async def test_subscriptions_of_one_process_fold_a_run_event_once_between_them(
    nc: NATS, app: App
) -> None:
    """With `reuse_folds` (what the subscribers' host sets) the second subscription takes
    the state the first folded through the same event: one read of the run's subject,
    where each subscription read it (two) before; both see the same state."""
    created, reads = await _two_subscriptions(nc, app, "reuse", reuse=True)
    a, b = created
    assert isinstance(a.state, RunState) and a.state.exists
    assert a.state == b.state and a.seq == b.seq
    assert reads == 1
    assert sorted([a.last_seq, b.last_seq])[0] == 0  # the one that read nothing knows no later
    _, reads_each = await _two_subscriptions(nc, app, "each", reuse=False)
    assert reads_each == 2  # the scheduler's way: a read per consumer, its last_seq known


async def test_concurrent_folds_of_one_event_share_one_read(nc: NATS, app: App) -> None:
    """Several consumers folding the same event at the same instant wait for one read."""
    await workspaces(app, "ws-par")
    done = await app.create_run(ORG, "ws-par", "apply", "alice")
    subject = f"rp.run.{ORG}.ws-par.{done.state.run_id}"
    store = CountingStore(nc)
    states = States(store)
    seq = (await store.read(subject))[0].seq
    store.reads.clear()
    got = await asyncio.gather(
        *(states.through("run", subject, seq, R.fold, R.INITIAL, reuse=True) for _ in range(5))
    )
    assert store.reads[subject] == 1
    assert len({repr(s) for s, _ in got}) == 1 and got[0][0].exists


async def test_a_subscription_fetches_a_trickle_of_events_in_batches(nc: NATS, app: App) -> None:
    """After a short batch the host's subscriptions linger before fetching again, so events
    appended one by one are handed in a few batches, not one fetch each."""
    batches: list[int] = []
    handled: list[Received] = []

    async def handle(r: Received) -> None:
        handled.append(r)

    sub = Subscription(name="t-linger", handle=handle, subjects=("rp.ws.>",))
    c = Consumer(nc, sub, linger=host.LINGER_S * 4)
    hand_out = c._hand_out

    async def counted(msgs: list[Any]) -> None:
        batches.append(len(msgs))
        await hand_out(msgs)

    c._hand_out = counted  # type: ignore[method-assign]  # counts what each fetch brought
    async with c:
        await c.ready.wait()
        for i in range(12):
            await workspaces(app, f"trickle-{i}")  # one ws.created each, appended in turn

        async def all_handled() -> bool:
            return len([r for r in handled if r.type == "ws.created"]) >= 12

        await eventually(all_handled, what="every workspace's creation handled")
    assert sum(batches) >= 12 and len(batches) <= 4, batches
