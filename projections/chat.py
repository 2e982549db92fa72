"""Chat-ops rows: each organization's Slack app (found by its team id when a signed
request comes in) and its Slack users. Requests and message links stay in the audit
history only: the subscriber reads them from their own subjects (events/chat.py)."""

from __future__ import annotations

from typing import assert_never

from events.chat import (
    ChatEvent,
    SlackConfigured,
    SlackMessageLinked,
    SlackRemoved,
    SlackRequestDone,
    SlackRequestReceived,
    SlackUserMapped,
    SlackUserUnmapped,
)
from projections.working import Meta, Working, iso


def project_chat(w: Working, meta: Meta, event: ChatEvent) -> None:
    org = meta.org
    match event:
        case SlackConfigured():
            row = {"org": org, "team_id": event.team_id, "bot_token": int(event.bot_token)}
            w.put(
                "slack_apps", row | {"configured_at": iso(event.at), "configured_by": event.actor}
            )
        case SlackRemoved():
            w.delete("slack_apps", (org,))
        case SlackUserMapped():
            row = {"org": org, "slack_id": event.slack_id, "user": event.user}
            w.put("slack_users", row | {"mapped_at": iso(event.at), "mapped_by": event.actor})
        case SlackUserUnmapped():
            w.delete("slack_users", (org, event.slack_id))
        case SlackRequestReceived() | SlackRequestDone() | SlackMessageLinked():
            pass  # the audit history has them
        case _:
            assert_never(event)
