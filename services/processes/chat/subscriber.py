"""Chat-ops as subscribers on the one consumer loop (infra/consumer.py).

- `chat-slack-requests`: every recorded Slack request (`rp.org.*.chat.slack.req.*`), one
  lane each (a slow one holds no other), from the first: a request the api recorded
  while no subscriber ran is worked when one starts (the log is the outbox). One older
  than `MAX_AGE` is not worked (its response_url is dead, and an approval clicked an hour
  ago is not a decision made now): it is recorded done as `expired`.
- `chat-slack-updates`: run events with the run's state, in order per workspace: the
  Slack messages showing a run are replaced as it moves (services/processes/chat/updates.py).
"""

from __future__ import annotations

from datetime import timedelta

import structlog

from events import chat as chat_agg
from events.run import RunState
from infra.consumer import Received, Subscription, by_subject
from infra.crypto import KeyRing
from infra.options import ConfigError
from services.app.commands import App
from services.processes.chat.config import ChatConfig
from services.processes.chat.poster import Poster
from services.processes.chat.updates import Updater
from services.processes.chat.worker import Worker
from services.processes.subscribers.context import SubscriberContext

log = structlog.get_logger(__name__)

MAX_AGE = timedelta(minutes=30)  # Slack's response_url lives 30 minutes
REQUESTS = ("rp.org.*.chat.slack.req.*",)
# The subscriptions' names (their durable consumers are rp-sub-<name>: deploy/README.md).
REQUESTS_NAME = "chat-slack-requests"
UPDATES_NAME = "chat-slack-updates"


def subscriptions(ctx: SubscriberContext) -> list[Subscription]:
    """The chat-ops subscriptions of a `runplane subscribers` host (registry.py); none
    without the encryption key (the api records no Slack request without it either)."""
    try:
        keyring = ctx.keys()
    except ConfigError as e:
        log.warning("chat_subscribers_off", reason=str(e))
        return []
    return build(ctx.app, keyring, Poster())


def build(app: App, keyring: KeyRing, poster: Poster) -> list[Subscription]:
    """The chat-ops subscriptions over `app` (its store's connection), posting with
    `poster`."""
    config = ChatConfig(app.store.nc, app, keyring)
    worker = Worker(app, config, poster)
    updater = Updater(app, config, poster)

    async def on_request(r: Received) -> None:
        event = r.event
        if not isinstance(event, chat_agg.SlackRequestReceived):
            return  # the request's own `done`
        if app.clock() - event.at > MAX_AGE:
            await worker.expire(r.org, event)
            return
        await worker.handle(r.org, event)

    async def on_run(r: Received) -> None:
        if isinstance(r.state, RunState) and r.state.exists:
            await updater.on_run_event(r.event, r.state)

    return [
        Subscription(
            name=REQUESTS_NAME,
            handle=on_request,
            subjects=REQUESTS,
            lane=by_subject,
            start="all",
        ),
        Subscription(name=UPDATES_NAME, handle=on_run, with_state=True),
    ]
