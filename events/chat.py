"""Chat-ops: an organization's Slack app, its Slack users, and the requests they send. Pure.

Three kinds of subject, all under the organization's `rp.org.<org>.` (the stream takes
`rp.org.>`), none the organization's own subject, so its history does not grow with chat:

- `rp.org.<org>.chat.slack` (`config_subject`): the aggregate. The app's team id (one
  runplane serves the Slack apps of many Slack workspaces: a request is matched to its
  organization by the team it names, then proven by that organization's signing secret),
  whether a bot token is set, and which Slack user is which runplane user. The signing
  secret and the bot token themselves are sealed in the secrets bucket
  (services/processes/chat/config.py): an event says only that they were set.
- `rp.org.<org>.chat.slack.req.<id>` (`request_subject`): one signed request from Slack,
  recorded before it is answered (so the work it asks for is never lost), then the
  record that it was worked (`chat.slack_request_done`). Its id is derived from the
  request's signature and it is appended on an empty subject only, so a replayed request
  (the same signature) is refused by the store, inside Slack's window or out of it.
- `rp.org.<org>.chat.slack.run.<run>` (`run_link_subject`): the Slack messages that show
  a run, each with its sealed `response_url`, updated in place as the run moves.

A Slack user not mapped to a runplane user can do nothing; what a mapped one may do is
decided elsewhere by the core's own rules (events/approval.py), as for any other caller.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Literal, assert_never

import msgspec

from events.base import Command, Event
from events.errors import Invalid, NotFound
from events.users import check_user

# Slack's ids: a team (T...), an enterprise (E...), a user (U... or W...). Upper case
# letters and digits; lowered nowhere (they are compared as Slack sends them).
SLACK_ID_RE = re.compile(r"^[A-Z0-9]{2,32}$")
Kind = Literal["command", "interaction"]


def valid_slack_id(value: str) -> bool:
    return SLACK_ID_RE.fullmatch(value) is not None


def config_subject(org: str) -> str:
    return f"rp.org.{org}.chat.slack"


def request_subject(org: str, request_id: str) -> str:
    return f"rp.org.{org}.chat.slack.req.{request_id}"


def run_link_subject(org: str, run_id: str) -> str:
    return f"rp.org.{org}.chat.slack.run.{run_id}"


# ---------------------------------------------------------------- events


class SlackConfigured(Event, frozen=True, kw_only=True, tag="chat.slack_configured"):
    """The organization's Slack app: its team, and whether a bot token is set (the
    signing secret always is; both are sealed apart, never in an event)."""

    team_id: str
    bot_token: bool = False


class SlackRemoved(Event, frozen=True, kw_only=True, tag="chat.slack_removed"):
    """The organization's Slack app was removed: no request of it is accepted."""


class SlackUserMapped(Event, frozen=True, kw_only=True, tag="chat.slack_user_mapped"):
    slack_id: str
    user: str


class SlackUserUnmapped(Event, frozen=True, kw_only=True, tag="chat.slack_user_unmapped"):
    slack_id: str


class SlackRequestReceived(Event, frozen=True, kw_only=True, tag="chat.slack_request_received"):
    """A signed request from Slack, as it came (its `actor` is the Slack user id).
    `response_url` is sealed (services/processes/chat/config.py): it lets its holder post in the
    channel for 30 minutes."""

    request_id: str
    kind: Kind
    team_id: str
    slack_user: str
    channel: str = ""
    message_ts: str = ""  # the message whose button was pressed (interactions)
    text: str = ""  # a slash command's text
    action_id: str = ""  # a button's
    value: str = ""  # a button's
    response_url: str = ""  # sealed, base64


class SlackRequestDone(Event, frozen=True, kw_only=True, tag="chat.slack_request_done"):
    """The request was worked: what it came to (`outcome`: "ok", a problem slug), the run
    it touched if any, and the runplane user it acted as."""

    request_id: str
    outcome: str
    user: str = ""
    run_id: str = ""


class SlackMessageLinked(Event, frozen=True, kw_only=True, tag="chat.slack_message_linked"):
    """A Slack message shows a run: updated through `response_url` (sealed) as it moves."""

    run_id: str
    request_id: str
    response_url: str
    channel: str = ""
    message_ts: str = ""


ChatEvent = (
    SlackConfigured
    | SlackRemoved
    | SlackUserMapped
    | SlackUserUnmapped
    | SlackRequestReceived
    | SlackRequestDone
    | SlackMessageLinked
)


# ---------------------------------------------------------------- the config aggregate


class ConfigureSlack(Command, frozen=True, kw_only=True):
    team_id: str
    bot_token: bool = False


class RemoveSlack(Command, frozen=True, kw_only=True):
    pass


class MapSlackUser(Command, frozen=True, kw_only=True):
    slack_id: str
    user: str


class UnmapSlackUser(Command, frozen=True, kw_only=True):
    slack_id: str


ChatCommand = ConfigureSlack | RemoveSlack | MapSlackUser | UnmapSlackUser


class SlackState(msgspec.Struct, frozen=True, kw_only=True):
    team_id: str = ""  # "": no app configured
    bot_token: bool = False
    configured_at: datetime | None = None
    configured_by: str = ""
    users: dict[str, str] = {}  # runplane user by Slack user id
    version: int = 0

    @property
    def configured(self) -> bool:
        return bool(self.team_id)


INITIAL = SlackState()


def evolve(state: SlackState, event: ChatEvent) -> SlackState:
    s = msgspec.structs.replace(state, version=state.version + 1)
    match event:
        case SlackConfigured():
            return msgspec.structs.replace(
                s,
                team_id=event.team_id,
                bot_token=event.bot_token,
                configured_at=event.at,
                configured_by=event.actor,
            )
        case SlackRemoved():
            return msgspec.structs.replace(s, team_id="", bot_token=False)
        case SlackUserMapped():
            return msgspec.structs.replace(s, users={**s.users, event.slack_id: event.user})
        case SlackUserUnmapped():
            users = {k: v for k, v in s.users.items() if k != event.slack_id}
            return msgspec.structs.replace(s, users=users)
        case SlackRequestReceived() | SlackRequestDone() | SlackMessageLinked():
            return s  # on subjects of their own, never the aggregate's
        case _:
            assert_never(event)


def fold(events: Sequence[ChatEvent], state: SlackState = INITIAL) -> SlackState:
    for e in events:
        state = evolve(state, e)
    return state


def decide(
    state: SlackState, command: ChatCommand, *, now: datetime, new_id: Callable[[], str]
) -> list[ChatEvent]:
    """The events of a command on the organization's Slack app (the shell checks the
    organization exists). A command that changes nothing records nothing."""
    who = command.actor
    match command:
        case ConfigureSlack():
            _check_slack_id("team id", command.team_id)
            if (state.team_id, state.bot_token) == (command.team_id, command.bot_token):
                return []  # the secrets may have changed (sealed apart): nothing to record
            return [
                SlackConfigured(
                    at=now, actor=who, team_id=command.team_id, bot_token=command.bot_token
                )
            ]
        case RemoveSlack():
            if not state.configured:
                raise NotFound("the organization has no Slack app")
            return [SlackRemoved(at=now, actor=who)]
        case MapSlackUser():
            _check_slack_id("Slack user id", command.slack_id)
            check_user(command.user)
            if state.users.get(command.slack_id) == command.user:
                return []
            return [
                SlackUserMapped(at=now, actor=who, slack_id=command.slack_id, user=command.user)
            ]
        case UnmapSlackUser():
            if command.slack_id not in state.users:
                raise NotFound(f"Slack user {command.slack_id} is not mapped")
            return [SlackUserUnmapped(at=now, actor=who, slack_id=command.slack_id)]
        case _:
            assert_never(command)


def _check_slack_id(what: str, value: str) -> None:
    if not valid_slack_id(value):
        raise Invalid(f"{what} {value!r} is not a Slack id (upper case letters and digits)")
