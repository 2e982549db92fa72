"""The organization aggregate: its existence and the tokens scoped to it.

Tokens are stored as SHA-256 digests only; the clear token is shown once, to its creator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import assert_never

import msgspec

from events.base import Command, Event
from events.errors import AlreadyExists, Invalid, NotFound

ROLES = ("viewer", "operator", "approver", "admin")


class OrgCreated(Event, frozen=True, kw_only=True, tag="org.created"):
    name: str


class TokenIssued(Event, frozen=True, kw_only=True, tag="org.token_issued"):
    token_id: str
    token_hash: str
    user: str
    role: str


OrgEvent = OrgCreated | TokenIssued


class CreateOrg(Command, frozen=True, kw_only=True):
    name: str


class IssueToken(Command, frozen=True, kw_only=True):
    token_id: str
    token_hash: str
    user: str
    role: str = "admin"


OrgCommand = CreateOrg | IssueToken


class OrgState(msgspec.Struct, frozen=True, kw_only=True):
    name: str = ""
    created_at: datetime | None = None
    tokens: tuple[str, ...] = ()
    version: int = 0

    @property
    def exists(self) -> bool:
        return bool(self.name)


INITIAL = OrgState()


def evolve(state: OrgState, event: OrgEvent) -> OrgState:
    s = msgspec.structs.replace(state, version=state.version + 1)
    match event:
        case OrgCreated():
            return msgspec.structs.replace(s, name=event.name, created_at=event.at)
        case TokenIssued():
            return msgspec.structs.replace(s, tokens=(*s.tokens, event.token_id))
        case _:
            assert_never(event)


def fold(events: Sequence[OrgEvent], state: OrgState = INITIAL) -> OrgState:
    for e in events:
        state = evolve(state, e)
    return state


def decide(
    state: OrgState, command: OrgCommand, *, now: datetime, new_id: Callable[[], str]
) -> list[OrgEvent]:
    who = command.actor
    match command:
        case CreateOrg():
            if state.exists:
                raise AlreadyExists(f"organization {command.name} already exists")
            return [OrgCreated(at=now, actor=who, name=command.name)]
        case IssueToken():
            if not state.exists:
                raise NotFound("organization does not exist")
            if command.role not in ROLES:
                raise Invalid(f"unknown role {command.role!r}; one of {', '.join(ROLES)}")
            return [
                TokenIssued(
                    at=now,
                    actor=who,
                    token_id=command.token_id,
                    token_hash=command.token_hash,
                    user=command.user,
                    role=command.role,
                )
            ]
        case _:
            assert_never(command)
