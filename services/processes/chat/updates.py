"""Slack messages that show a run, kept current as it moves.

A subscriber on run events, with the run's state folded through each: when the reaction
table (events/react.py) raises a notification trigger for a run (planning, awaiting
approval, applying, its end), every message linked to that run
(`chat.slack_message_linked`, services/processes/chat/worker.py) is replaced in place through its
`response_url`. Replacing a message with the same content is harmless, so a redelivered
event (at least once) changes nothing a person sees. Slack takes up to 5 posts to one
`response_url` within 30 minutes; later ones fail and are logged.
"""

from __future__ import annotations

import structlog

from events import chat as chat_agg
from events.codec import AnyEvent
from events.react import Notify, react
from events.run import RunState
from services.app.commands import App
from services.processes.chat import text as tx
from services.processes.chat.config import ChatConfig
from services.processes.chat.poster import Poster
from services.processes.chat.worker import run_view

log = structlog.get_logger(__name__)


class Updater:
    """Replaces the Slack messages of a run when it moves."""

    def __init__(self, app: App, config: ChatConfig, poster: Poster) -> None:
        self.app = app
        self.config = config
        self.poster = poster

    async def on_run_event(self, event: AnyEvent, state: RunState) -> int:
        """Update the run's messages if `event` moved it; how many were posted."""
        notes = [a.trigger for a in react(event, state) if isinstance(a, Notify)]
        if not notes:
            return 0
        envs = await self.app.store.read(chat_agg.run_link_subject(state.org, state.run_id))
        links = [e.event for e in envs if isinstance(e.event, chat_agg.SlackMessageLinked)]
        card = tx.run_card(state.org, run_view(state), replace=True)
        posted = 0
        for link in _distinct(links):
            url = self.config.open_url(state.org, link.request_id, link.response_url)
            if await self.poster.post(url, card):
                posted += 1
        if posted:
            log.info("slack_messages_updated", run_id=state.run_id, triggers=notes, n=posted)
        return posted


def _distinct(links: list[chat_agg.SlackMessageLinked]) -> list[chat_agg.SlackMessageLinked]:
    """One per request (a request links its run once, a redelivered one again)."""
    seen: dict[str, chat_agg.SlackMessageLinked] = {}
    for link in links:
        seen.setdefault(link.request_id, link)
    return list(seen.values())
