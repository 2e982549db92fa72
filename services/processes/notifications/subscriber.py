"""The notifications subscriber: run events in, deliveries scheduled and handed to lanes.

For each run event it takes the `Notify` actions of the reaction table
(`events/react.py`), finds the enabled configurations of the run's
organization and workspace that want them, records each delivery in the log
(`outbox.schedule`) and hands it to the `Dispatcher`; then the event is acknowledged.
Nothing here waits for a receiver: a slow or dead one holds only its own lane.

At start, `recover` puts back on their lanes the deliveries a crash left unfinished, and
every RESCAN_S those another replica held and has not sent for that long (it died).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, get_args

import structlog
from nats.aio.client import Client as NATS

from events import notification as nt
from events import run as run_agg
from events.codec import AnyEvent
from events.react import notifications, react
from events.run import RunEvent, RunState
from infra.consumer import Consumer, Subscription, by_subject
from infra.crypto import KeyRing
from infra.eventstore import EventStore
from infra.options import ConfigError
from services.app.commands import App
from services.processes.notifications import formats, outbox
from services.processes.notifications.delivery import Dispatcher, Policy, policy_from_env
from services.processes.notifications.tokens import TokenStore
from services.processes.subscribers.context import SubscriberContext

log = structlog.get_logger(__name__)

NAME = "notifications"
# Deliveries of one event scheduled concurrently (two appends' round trips each): an
# event for 1,000 destinations is in the log in ~1/64 of the time one at a time takes.
SCHEDULE_AT_ONCE = 64
# How often a replica looks for deliveries another replica held and did not finish (it
# died): those overdue by this long are taken over, under their own RP-Delivery.
RESCAN_S = 60.0
_RUN_EVENTS = get_args(RunEvent)


class Notifier:
    """The handler: an event of a run, the run's state through it -> deliveries."""

    def __init__(
        self,
        store: EventStore,
        dispatcher: Dispatcher,
        *,
        base_url: str = "",
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.store = store
        self.dispatcher = dispatcher
        self.base_url = base_url
        self.clock = clock
        self.scheduled = 0
        self._unfinished: outbox.Unfinished | None = None

    async def handle(self, received: Any) -> None:
        """The subscriber's handler (infra/consumer.py `Received`)."""
        await self.on_event(received.seq, received.subject, received.event, received.state)

    async def on_event(
        self, seq: int, subject: str, event: AnyEvent, state: RunState | None
    ) -> int:
        """Schedule and hand over every delivery the event makes; returns how many."""
        if not isinstance(event, _RUN_EVENTS):
            return 0
        if state is None:
            state = await self._state_at(subject, seq)
        if not state.exists:
            return 0
        fired = [n.trigger for n in notifications(react(event, state))]
        if not fired:
            return 0
        wanted = [
            (cfg, t)
            for cfg in await outbox.configs(self.store, state.org)
            for t in fired
            if nt.applies(cfg, state.org, state.workspace, t)
        ]
        if not wanted:
            return 0
        view = formats.view_of(state, at=event.at, actor=event.actor, base_url=self.base_url)
        now = self.clock()
        n = 0
        for i in range(0, len(wanted), SCHEDULE_AT_ONCE):
            jobs = await asyncio.gather(
                *(
                    outbox.schedule(self.store, cfg, view, trigger, seq, now)
                    for cfg, trigger in wanted[i : i + SCHEDULE_AT_ONCE]
                )
            )
            n += sum(1 for job in jobs if job is not None and self.dispatcher.submit(job))
        self.scheduled += n
        return n

    async def _state_at(self, subject: str, seq: int) -> RunState:
        """The run folded through `seq` (not later), when the consumer did not fold it."""
        envs = await self.store.read(subject, min_seq=seq)
        through: list[Any] = [e.event for e in envs if e.seq <= seq]
        return run_agg.fold(through)

    async def recover(self, nc: NATS, *, overdue: timedelta | None = None) -> int:
        """Put every unfinished delivery back on its lane (with `overdue`: only those
        due that long ago and not in this process's hands, which the replica that held
        them, dead since, will not send); returns how many."""
        n = 0
        if self._unfinished is None:
            self._unfinished = outbox.Unfinished(nc)
        for org, config_id, did in await self._unfinished.refresh():
            state = await outbox.config(self.store, org, config_id)
            if not state.exists or state.config is None or not state.config.enabled:
                continue  # deleted or disabled since: what it had not sent is dropped
            if did in self.dispatcher.in_hand:
                continue
            job = await outbox.job_of(self.store, state.config, did, overdue=overdue)
            if job is not None and self.dispatcher.submit(job):
                n += 1
        if n or overdue is None:
            log.info("notify_recovered", deliveries=n)
        return n


def subscription(notifier: Notifier) -> Subscription:
    """The registration: run events, one lane per run (its events in order, runs in
    parallel: the handler never waits for a receiver), the run's state folded through."""
    return Subscription(
        name=NAME,
        handle=notifier.handle,
        subjects=("rp.run.>",),
        lane=by_subject,
        with_state=True,
    )


def subscriptions(ctx: SubscriberContext) -> list[Subscription]:
    """The registry's entry (services/processes/subscribers/registry.py). The host starts the
    consumer; the dispatcher (its HTTP session and lanes) and the recovery of what a
    crash left unfinished run in a task of their own, started here, for the life of the
    process (the registry has no hook for a subscriber's resources)."""
    opts = ctx.opts
    base_url = os.environ.get(formats.PUBLIC_URL_ENV, "") or f"http://{opts.listen}"
    tokens = TokenStore(ctx.nc, _keyring(ctx))
    store = ctx.app.store
    dispatcher = Dispatcher(
        policy_from_env(), tokens.get, outbox.recorder(store), outbox.current(store)
    )
    notifier = Notifier(store, dispatcher, base_url=base_url)
    _BACKGROUND.add(asyncio.get_running_loop().create_task(_lifetime(ctx.nc, notifier)))
    return [subscription(notifier)]


def _keyring(ctx: SubscriberContext) -> KeyRing | None:
    """The deployment's keys; None without (a configuration with a token then fails to
    be signed, logged: `runplane subscribers` refuses to start without a key anyway)."""
    try:
        return ctx.keys()
    except ConfigError:
        return None


_BACKGROUND: set[asyncio.Task[None]] = set()  # kept referenced for the process's life


async def _lifetime(nc: NATS, notifier: Notifier) -> None:
    """The dispatcher open for the process's life; recovery at start, then every
    RESCAN_S for what another replica, dead since, held (until the task is cancelled)."""
    async with notifier.dispatcher:
        overdue = None
        while True:
            try:
                await notifier.recover(nc, overdue=overdue)
            except Exception:
                log.exception("notify_recovery_failed")
            overdue = timedelta(seconds=RESCAN_S)
            await asyncio.sleep(RESCAN_S)


@asynccontextmanager
async def serving(
    nc: NATS,
    app: App,
    keyring: KeyRing,
    *,
    policy: Policy | None = None,
    base_url: str = "",
) -> AsyncIterator[Notifier]:
    """The subscriber running: its dispatcher, its consumer, and the recovery of what a
    crash left unfinished (after the consumer is up, so nothing new is missed)."""
    tokens = TokenStore(nc, keyring)
    chosen = policy or policy_from_env()
    record, now_at = outbox.recorder(app.store), outbox.current(app.store)
    async with Dispatcher(chosen, tokens.get, record, now_at) as dispatcher:
        notifier = Notifier(app.store, dispatcher, base_url=base_url)
        async with Consumer(nc, subscription(notifier), states=app.states):
            await notifier.recover(nc)
            yield notifier
