"""Notification configurations and their deliveries. Pure.

A configuration belongs to an organization, or to one of its workspaces (`workspace`);
the two add up: a run of a workspace is notified to every enabled configuration of its
organization and of itself whose triggers name what happened. Each configuration is an
aggregate of its own on `rp.org.<org>.notify.<id>`; its token (write-only) is never in an
event: the event says only whether one is set (`has_token`), and the sealed value lives
in the secrets bucket (services/processes/notifications/tokens.py).

A delivery is one (configuration, triggering event, trigger): its id is derived from
those three (`delivery_id`), so a crash and a retry reuse it, and it is an aggregate of
its own on `rp.org.<org>.notify.<id>.d.<delivery>`: `org.notify_delivery_scheduled` carries
the body to send (the log is the outbox: nothing is sent that is not there first), each
attempt is a `org.notify_delivery_attempted`, and the backoff (`next_retry`) is a pure
function of the attempts so far and of the receiver's `Retry-After`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any, assert_never

import msgspec

from events.base import Command, Event
from events.errors import AlreadyExists, Invalid, NotFound

TRIGGERS = (
    "run:created",
    "run:planning",
    "run:needs_attention",
    "run:applying",
    "run:completed",
    "run:errored",
    "run:drifted",
    "run:policy_failed",
    "run:discarded",
    "run:canceled",
)
VERIFICATION = "verification"  # the trigger of a `verify` delivery
DESTINATIONS = ("generic", "slack", "teams")
MAX_NAME = 100
MAX_CONFIGS = 100  # per organization, its workspaces' included
MAX_URL = 2048
MAX_EXCERPT = 512  # characters of a receiver's answer kept per attempt
# Seconds between attempts (HCP Terraform retries on a similar curve), and when to stop.
SCHEDULE: tuple[float, ...] = (10, 60, 300, 1800, 7200)
GIVE_UP_AFTER = timedelta(hours=24)

DELIVERED, RETRY, FAILED, GAVE_UP = "delivered", "retry", "failed", "gave_up"
FINAL = frozenset({DELIVERED, FAILED, GAVE_UP})


class NotificationConfig(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    org: str
    workspace: str = ""  # "": the organization's, for every workspace
    name: str
    destination: str
    url: str
    triggers: list[str] = []
    enabled: bool = True
    has_token: bool = False
    created_at: datetime
    created_by: str


class ConfigSaved(Event, frozen=True, kw_only=True, tag="org.notify_config_saved"):
    """The whole configuration as it now is (created or changed)."""

    config: NotificationConfig


class ConfigDeleted(Event, frozen=True, kw_only=True, tag="org.notify_config_deleted"):
    config_id: str


class DeliveryScheduled(Event, frozen=True, kw_only=True, tag="org.notify_delivery_scheduled"):
    delivery_id: str
    config_id: str
    org: str
    workspace: str
    run_id: str
    trigger: str
    event_seq: int  # the triggering event's stream sequence (0: a verification)
    content_type: str = "application/json"
    body: str  # exactly what is sent, every time


class DeliveryAttempted(Event, frozen=True, kw_only=True, tag="org.notify_delivery_attempted"):
    delivery_id: str
    config_id: str
    attempt: int  # 1, 2, ...
    trigger: str
    run_id: str
    status_code: int = 0  # 0: no answer (timeout, connection refused, refused address)
    excerpt: str = ""  # the start of the answer's body, at most MAX_EXCERPT characters
    error: str = ""
    outcome: str  # DELIVERED | RETRY | FAILED | GAVE_UP
    next_retry_at: datetime | None = None


NotificationEvent = ConfigSaved | ConfigDeleted | DeliveryScheduled | DeliveryAttempted


def config_subject(org: str, config_id: str) -> str:
    return f"rp.org.{org}.notify.{config_id}"


def configs_subject(org: str) -> str:
    """Every configuration of an organization (one token: not their deliveries)."""
    return f"rp.org.{org}.notify.*"


def delivery_subject(org: str, config_id: str, delivery: str) -> str:
    return f"rp.org.{org}.notify.{config_id}.d.{delivery}"


def delivery_id(config_id: str, event_seq: int, trigger: str) -> str:
    """The stable id of one delivery: the same for every retry and every replica."""
    digest = hashlib.sha256(f"{config_id}\0{event_seq}\0{trigger}".encode()).hexdigest()
    return f"d{digest[:31]}"


# ---------------------------------------------------------------- configurations


class SaveConfig(Command, frozen=True, kw_only=True):
    """Create (`create=True`) or change a configuration: fields left None are kept."""

    config_id: str
    org: str
    workspace: str = ""
    create: bool = False
    name: str | None = None
    destination: str | None = None
    url: str | None = None
    triggers: list[str] | None = None
    enabled: bool | None = None
    has_token: bool | None = None


class DeleteConfig(Command, frozen=True, kw_only=True):
    config_id: str


class ConfigState(msgspec.Struct, frozen=True, kw_only=True):
    config: NotificationConfig | None = None
    deleted: bool = False
    version: int = 0

    @property
    def exists(self) -> bool:
        return self.config is not None and not self.deleted


def evolve(state: ConfigState, event: NotificationEvent) -> ConfigState:
    s = msgspec.structs.replace(state, version=state.version + 1)
    match event:
        case ConfigSaved():
            return msgspec.structs.replace(s, config=event.config)
        case ConfigDeleted():
            return msgspec.structs.replace(s, deleted=True)
        case DeliveryScheduled() | DeliveryAttempted():
            return s  # on the deliveries' own subjects
        case _:
            assert_never(event)


def fold(events: Sequence[Any], state: ConfigState | None = None) -> ConfigState:
    state = state or ConfigState()
    for e in events:
        state = evolve(state, e)
    return state


def decide(
    state: ConfigState, cmd: SaveConfig | DeleteConfig, *, now: datetime
) -> list[NotificationEvent]:
    match cmd:
        case SaveConfig():
            return _save(state, cmd, now)
        case DeleteConfig():
            if not state.exists:
                raise NotFound(f"notification configuration {cmd.config_id} not found")
            return [ConfigDeleted(at=now, actor=cmd.actor, config_id=cmd.config_id)]
        case _:
            assert_never(cmd)


def _save(state: ConfigState, cmd: SaveConfig, now: datetime) -> list[NotificationEvent]:
    if cmd.create:
        if state.config is not None:
            raise AlreadyExists(f"notification configuration {cmd.config_id} exists")
        for field in ("name", "destination", "url"):
            if getattr(cmd, field) is None:
                raise Invalid(f"a notification configuration needs {field}")
        before = NotificationConfig(
            id=cmd.config_id,
            org=cmd.org,
            workspace=cmd.workspace,
            name="",
            destination="generic",
            url="",
            created_at=now,
            created_by=cmd.actor,
        )
    elif not state.exists or state.config is None:
        raise NotFound(f"notification configuration {cmd.config_id} not found")
    else:
        before = state.config
    changes = {
        k: getattr(cmd, k)
        for k in ("name", "destination", "url", "triggers", "enabled", "has_token")
        if getattr(cmd, k) is not None
    }
    after = msgspec.structs.replace(before, **changes)
    check(after)
    if after == state.config:
        return []
    return [ConfigSaved(at=now, actor=cmd.actor, config=after)]


def check(config: NotificationConfig) -> None:
    """Invalid, saying why, unless the configuration is well formed (the address itself
    is judged by the shell: it needs DNS)."""
    if not config.name.strip() or len(config.name) > MAX_NAME:
        raise Invalid(f"name is 1 to {MAX_NAME} characters")
    if any(ord(c) < 32 for c in config.name):
        raise Invalid("name is one line of printable characters")
    if config.destination not in DESTINATIONS:
        raise Invalid(f"destination must be one of {', '.join(DESTINATIONS)}")
    url = config.url
    if len(url) > MAX_URL or not url.startswith(("https://", "http://")):
        raise Invalid(f"url must be an http(s) URL of at most {MAX_URL} characters")
    if any(ord(c) <= 32 for c in url):
        raise Invalid("url may not contain spaces or control characters")
    unknown = [t for t in config.triggers if t not in TRIGGERS]
    if unknown:
        raise Invalid(f"unknown trigger {unknown[0]!r}; triggers are {', '.join(TRIGGERS)}")
    if len(set(config.triggers)) != len(config.triggers):
        raise Invalid("a trigger is listed twice")


def applies(config: NotificationConfig, org: str, ws: str, trigger: str) -> bool:
    """Whether the configuration wants this trigger of a run of `org`/`ws`."""
    if not config.enabled or config.org != org or trigger not in config.triggers:
        return False
    return not config.workspace or config.workspace == ws


# ---------------------------------------------------------------- deliveries


class DeliveryState(msgspec.Struct, frozen=True, kw_only=True):
    scheduled: DeliveryScheduled | None = None
    attempts: int = 0
    outcome: str = ""  # the last attempt's
    next_retry_at: datetime | None = None

    @property
    def done(self) -> bool:
        return self.outcome in FINAL


def delivery_fold(events: Sequence[Any]) -> DeliveryState:
    state = DeliveryState()
    for e in events:
        if isinstance(e, DeliveryScheduled) and state.scheduled is None:
            state = msgspec.structs.replace(state, scheduled=e)
        elif isinstance(e, DeliveryAttempted) and not state.done:
            state = msgspec.structs.replace(
                state,
                attempts=max(state.attempts, e.attempt),
                outcome=e.outcome,
                next_retry_at=e.next_retry_at,
            )
    return state


def retryable_status(code: int) -> bool:
    """429 and 5xx are tried again; any other answer but 2xx is permanent."""
    return code == 429 or code >= 500


def next_retry(
    *,
    first_at: datetime,
    now: datetime,
    attempt: int,
    retry_after: float | None = None,
    schedule: Sequence[float] = SCHEDULE,
    give_up_after: timedelta = GIVE_UP_AFTER,
) -> datetime | None:
    """When to try again after failed attempt number `attempt` (1-based), or None to
    give up: the schedule's delay (its last one repeats), or the receiver's Retry-After
    if it asks for longer; never past `give_up_after` from the first attempt."""
    if not schedule:
        return None
    delay = schedule[min(attempt, len(schedule)) - 1]
    if retry_after is not None and retry_after > delay:
        delay = retry_after
    # A receiver's Retry-After is any digits: past the bound it is a give-up, judged
    # before a timedelta or datetime of it overflows (which left the attempt unrecorded).
    if not delay <= (give_up_after - (now - first_at)).total_seconds():
        return None
    at = now + timedelta(seconds=delay)
    return at if at - first_at <= give_up_after else None


def excerpt(text: str) -> str:
    return text[:MAX_EXCERPT]
