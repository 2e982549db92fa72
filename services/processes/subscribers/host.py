"""The subscriber host: runs every registered subscription, each on its own consumer.

`runplane subscribers` runs one host (any number of replicas: a subscription's replicas
share its durable, and the server hands each message to one of them); `runplane up`
runs one beside the rest. Each subscription fetches, lanes and settles on its own
(infra/consumer.py), so a subscriber that falls behind or hangs delays no other
subscriber, and no run: the scheduler has a durable of its own.

`RUNPLANE_SUBSCRIBER_MODULES` (comma-separated module names, each with a
`subscriptions(ctx) -> list[Subscription]`) adds subscriptions beside the registry's:
a deployment's own, or a test's. The operator sets it, as any other setting.
"""

from __future__ import annotations

import importlib
import os
from types import TracebackType

import structlog

from infra.consumer import Consumer, Subscription
from infra.options import ConfigError
from services.processes.subscribers import registry
from services.processes.subscribers.context import SubscriberContext

log = structlog.get_logger(__name__)

MODULES_ENV = "RUNPLANE_SUBSCRIBER_MODULES"
# Seconds a subscription waits after a short batch before it fetches again: events come
# a few at a time instead of one fetch (two requests, a status reply) each. Subscribers
# are off the run path (a notification may well leave 50 ms later), the scheduler is not:
# it fetches at once (services/processes/scheduler).
LINGER_S = 0.05


def extra_subscriptions(ctx: SubscriberContext, names: str | None = None) -> list[Subscription]:
    """The subscriptions of the modules `RUNPLANE_SUBSCRIBER_MODULES` names."""
    out: list[Subscription] = []
    wanted = os.environ.get(MODULES_ENV, "") if names is None else names
    for name in (n.strip() for n in wanted.split(",")):
        if not name:
            continue
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            raise ConfigError(f"{MODULES_ENV}: cannot import {name}: {e}") from e
        factory = getattr(module, "subscriptions", None)
        if not callable(factory):
            raise ConfigError(f"{MODULES_ENV}: {name} has no subscriptions(ctx)")
        out.extend(factory(ctx))
    return out


def all_subscriptions(ctx: SubscriberContext) -> list[Subscription]:
    subs = [*registry.subscriptions(ctx), *extra_subscriptions(ctx)]
    names = [s.name for s in subs]
    if len(set(names)) != len(names):
        raise ConfigError(f"two subscriptions share a name: {sorted(names)}")
    return subs


class Host:
    """`async with Host(ctx) as host:` every subscription consuming; `host.names`."""

    def __init__(self, ctx: SubscriberContext, subs: list[Subscription] | None = None) -> None:
        self.ctx = ctx
        self.subs = all_subscriptions(ctx) if subs is None else subs
        self.consumers: list[Consumer] = []

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.subs]

    async def __aenter__(self) -> Host:
        try:
            for sub in self.subs:
                consumer = Consumer(  # the subscriptions fold each run event once
                    self.ctx.nc, sub, states=self.ctx.app.states, linger=LINGER_S,
                    reuse_folds=True,
                )  # fmt: skip
                await consumer.start()
                self.consumers.append(consumer)
        except BaseException:
            await self.stop()
            raise
        log.info("subscribers_started", subscriptions=self.names)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def stop(self) -> None:
        for consumer in reversed(self.consumers):  # what is in hand is redelivered
            await consumer.stop()
        self.consumers.clear()
