"""Every subscription `runplane subscribers` runs: a subscriber module adds one line below.

A subscriber is a handler plus a registration (infra/consumer.py
`Subscription`): its own durable consumer, so one that falls behind holds nothing of the
scheduler's, nor of another subscriber's. It decides when to act from the reaction
table (events/react.py), e.g. the `Notify` actions of `react(r.event, r.state)` with
`with_state=True`, never from a set of event tags of its own.
"""

from __future__ import annotations

from infra.consumer import Subscription
from services.processes.chat import subscriber as chat
from services.processes.notifications import subscriber as notifications
from services.processes.stacks import subscriber as stack_runs
from services.processes.subscribers.context import SubscriberContext
from services.processes.triggers import subscriber as run_triggers
from services.processes.vcs import report as vcs_report


def subscriptions(ctx: SubscriberContext) -> list[Subscription]:
    """The subscriptions every `runplane subscribers` replica runs."""
    return [
        # one line per subscriber module, e.g. *notifications.subscriptions(ctx),
        *notifications.subscriptions(ctx),
        *chat.subscriptions(ctx),
        *vcs_report.subscriptions(ctx),
        *run_triggers.subscriptions(ctx),
        *stack_runs.subscriptions(ctx),
    ]
