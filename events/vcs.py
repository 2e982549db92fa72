"""VCS connections of an organization, and the webhook deliveries they accepted. Pure.

A connection (GitHub or GitLab, at an API base URL of the tenant's choosing, so GitHub
Enterprise and a self-hosted GitLab work) is an aggregate of its own on
`rp.org.<org>.vcs.<id>`; its id is made by the server and is unique across the
deployment, so the webhook URL (`/api/v1/vcs/<id>/webhook`) names it alone. Its webhook
secret and its token are write-only: events say only whether each is set (`has_secret`,
`has_token`); the sealed values live in the secrets bucket (services/processes/vcs/connections.py).

An accepted delivery is recorded on `rp.org.<org>.vcs.<id>.d.<digest of the delivery id>`
with the runs it started, appended expecting that subject empty: a redelivery, through
any replica and after any crash, finds it there and starts nothing.

A push is one (connection, ref, commit), whatever delivery id brings it: the first
delivery to start its runs claims it on `rp.org.<org>.vcs.<id>.p.<digest of ref and
commit>` (`PushClaimed`, expecting that subject empty), so the same push under a new
delivery id (a captured delivery replayed, GitHub's "Redeliver" of an old one) starts
nothing and is recorded as a `duplicate`. A push whose commit is no longer where its
ref is and does not move on from what its workspace applied is recorded as `stale`
(services/processes/vcs/deliveries.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from datetime import datetime
from typing import Any, assert_never
from urllib.parse import urlsplit

import msgspec

from events.base import Command, Event
from events.errors import AlreadyExists, Invalid, NotFound

PROVIDERS = ("github", "gitlab")
DEFAULT_API = {"github": "https://api.github.com", "gitlab": "https://gitlab.com/api/v4"}
MAX_NAME = 100
MAX_URL = 2048
MAX_CONNECTIONS = 100  # per organization


class VcsConnection(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    org: str
    name: str
    provider: str  # github | gitlab
    api_url: str  # the VCS's REST API base, e.g. https://api.github.com
    has_secret: bool = False
    has_token: bool = False
    created_at: datetime
    created_by: str


class ConnectionSaved(Event, frozen=True, kw_only=True, tag="org.vcs_connection_saved"):
    """The whole connection as it now is (created or changed); never a secret."""

    connection: VcsConnection


class ConnectionDeleted(Event, frozen=True, kw_only=True, tag="org.vcs_connection_deleted"):
    connection_id: str


class DeliveryAccepted(Event, frozen=True, kw_only=True, tag="org.vcs_delivery_accepted"):
    """A signed webhook delivery handled: what it was and the runs it started."""

    connection_id: str
    delivery: str  # as the VCS sent it (X-GitHub-Delivery, Idempotency-Key, ...)
    event: str  # push | tag | pull_request | ping | ignored
    repository: str = ""
    ref: str = ""
    commit: str = ""
    runs: list[str] = []  # "<workspace>/<run id>"
    # Why it started nothing although it was a push: `stale` (no workspace it concerns
    # may run its commit now) or `duplicate` (another delivery brought this push first).
    ignored: str = ""
    stale: list[str] = []  # the workspaces it did not start: its commit is stale for them
    duplicate_of: str = ""  # the delivery that claimed this push first (`duplicate`)


class PushClaimed(Event, frozen=True, kw_only=True, tag="org.vcs_push_claimed"):
    """The first delivery to start the runs of one push (connection, ref, commit): any
    other delivery of that push starts nothing."""

    connection_id: str
    ref: str
    commit: str
    delivery: str


VcsEvent = ConnectionSaved | ConnectionDeleted | DeliveryAccepted | PushClaimed

STALE, DUPLICATE = "stale", "duplicate"


def connection_subject(org: str, connection_id: str) -> str:
    return f"rp.org.{org}.vcs.{connection_id}"


def connections_subject(org: str) -> str:
    """Every connection of an organization (one token: not their deliveries)."""
    return f"rp.org.{org}.vcs.*"


def any_org_subject(connection_id: str) -> str:
    """The connection's subject whatever its organization (ids are deployment-unique)."""
    return f"rp.org.*.vcs.{connection_id}"


def delivery_key(delivery: str) -> str:
    """A subject-safe token for a delivery id the VCS chose (any characters)."""
    return "d" + hashlib.sha256(delivery.encode()).hexdigest()[:40]


def delivery_subject(org: str, connection_id: str, delivery: str) -> str:
    return f"rp.org.{org}.vcs.{connection_id}.d.{delivery_key(delivery)}"


def deliveries_subject(org: str, connection_id: str) -> str:
    """Every delivery recorded for the connection."""
    return f"rp.org.{org}.vcs.{connection_id}.d.*"


def push_key(ref: str, commit: str) -> str:
    """A subject-safe token for one push: a ref at a commit (both as the VCS sent them)."""
    return "p" + hashlib.sha256(f"{ref}\n{commit}".encode()).hexdigest()[:40]


def push_subject(org: str, connection_id: str, ref: str, commit: str) -> str:
    return f"rp.org.{org}.vcs.{connection_id}.p.{push_key(ref, commit)}"


def claimed_by(events: Sequence[Any]) -> str:
    """The delivery that claimed a push, from the events of its subject ("" none)."""
    return next((e.delivery for e in events if isinstance(e, PushClaimed)), "")


# ---------------------------------------------------------------- commands


class SaveConnection(Command, frozen=True, kw_only=True):
    """Create (`create=True`) or change a connection: fields left None are kept."""

    connection_id: str
    org: str
    create: bool = False
    name: str | None = None
    provider: str | None = None
    api_url: str | None = None
    has_secret: bool | None = None
    has_token: bool | None = None


class DeleteConnection(Command, frozen=True, kw_only=True):
    connection_id: str


class ConnectionState(msgspec.Struct, frozen=True, kw_only=True):
    connection: VcsConnection | None = None
    deleted: bool = False
    version: int = 0

    @property
    def exists(self) -> bool:
        return self.connection is not None and not self.deleted


def evolve(state: ConnectionState, event: VcsEvent) -> ConnectionState:
    s = msgspec.structs.replace(state, version=state.version + 1)
    match event:
        case ConnectionSaved():
            return msgspec.structs.replace(s, connection=event.connection)
        case ConnectionDeleted():
            return msgspec.structs.replace(s, deleted=True)
        case DeliveryAccepted() | PushClaimed():
            return s  # on the deliveries' and the pushes' own subjects
        case _:
            assert_never(event)


def fold(events: Sequence[Any], state: ConnectionState | None = None) -> ConnectionState:
    state = state or ConnectionState()
    for e in events:
        state = evolve(state, e)
    return state


def decide(
    state: ConnectionState, cmd: SaveConnection | DeleteConnection, *, now: datetime
) -> list[VcsEvent]:
    match cmd:
        case SaveConnection():
            return _save(state, cmd, now)
        case DeleteConnection():
            if not state.exists:
                raise NotFound(f"VCS connection {cmd.connection_id} not found")
            return [ConnectionDeleted(at=now, actor=cmd.actor, connection_id=cmd.connection_id)]
        case _:
            assert_never(cmd)


def _save(state: ConnectionState, cmd: SaveConnection, now: datetime) -> list[VcsEvent]:
    if cmd.create:
        if state.connection is not None:
            raise AlreadyExists(f"VCS connection {cmd.connection_id} exists")
        provider = cmd.provider or ""
        before = VcsConnection(
            id=cmd.connection_id,
            org=cmd.org,
            name="",
            provider=provider,
            api_url=DEFAULT_API.get(provider, ""),
            created_at=now,
            created_by=cmd.actor,
        )
    elif not state.exists or state.connection is None:
        raise NotFound(f"VCS connection {cmd.connection_id} not found")
    else:
        before = state.connection
    changes = {
        k: getattr(cmd, k)
        for k in ("name", "provider", "api_url", "has_secret", "has_token")
        if getattr(cmd, k) is not None
    }
    after = msgspec.structs.replace(before, **changes)
    check(after)
    if after == state.connection:
        return []
    return [ConnectionSaved(at=now, actor=cmd.actor, connection=after)]


def check(c: VcsConnection) -> None:
    """Invalid, saying why, unless the connection is well formed."""
    if not c.name.strip() or len(c.name) > MAX_NAME or any(ord(ch) < 32 for ch in c.name):
        raise Invalid(f"name is one line of 1 to {MAX_NAME} printable characters")
    if c.provider not in PROVIDERS:
        raise Invalid(f"provider must be one of {', '.join(PROVIDERS)}")
    check_api_url(c.api_url)


def check_api_url(url: str) -> None:
    """The API base is tenant input that runplane will call with the connection's token:
    an http(s) URL with a host, no credentials, no query or fragment, no control
    characters or spaces. (Which addresses it may reach is the sender's guard, at send.)"""
    if not url or len(url) > MAX_URL or any(ord(ch) <= 32 or ord(ch) == 127 for ch in url):
        raise Invalid(f"api_url must be an http(s) URL of at most {MAX_URL} characters")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a malformed port
    except ValueError as e:
        raise Invalid(f"api_url is not a URL: {e}") from e
    if parts.scheme not in ("https", "http") or not parts.hostname:
        raise Invalid("api_url must be an http:// or https:// URL with a host")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise Invalid("api_url may not carry credentials: the token is set apart (write-only)")
    if parts.query or parts.fragment or "?" in url or "#" in url:
        raise Invalid("api_url may not have a query or a fragment")


def repo_key(repository: str) -> str:
    """The path of a repository's URL, lowercase, without `.git` and slashes at the ends:
    `https://github.com/Acme/net.git`, `git@github.com:acme/net` and
    `ssh://git@host:22/acme/net.git` all give `acme/net`; "" for none. A workspace's
    repository and a webhook's clone URLs meet on it (the host is the connection's)."""
    r = repository.strip()
    if "://" in r:
        path = urlsplit(r).path
    elif ":" in r and "@" in r.split(":", 1)[0]:  # scp-like user@host:path
        path = r.split(":", 1)[1]
    else:
        path = r
    path = path.strip("/").lower()
    if path.endswith(".git"):
        path = path[:-4]
    return path.strip("/")
