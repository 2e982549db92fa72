"""The workspace aggregate: its configuration and its FIFO run queue.

The queue lives here so that admission is one optimistic append on the workspace subject:
two schedulers racing to admit can never both win, and the order of `ws.run_enqueued`
events on the subject *is* the FIFO order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import assert_never

import msgspec

from events.base import Command, Event
from events.errors import AlreadyExists, Invalid, NotFound
from events.run import Workspace


class WorkspaceCreated(Event, frozen=True, kw_only=True, tag="ws.created"):
    org: str
    name: str
    config: Workspace


class RunEnqueued(Event, frozen=True, kw_only=True, tag="ws.run_enqueued"):
    run_id: str


class RunAdmitted(Event, frozen=True, kw_only=True, tag="ws.run_admitted"):
    run_id: str


class RunReleased(Event, frozen=True, kw_only=True, tag="ws.run_released"):
    """A run left the queue or gave the workspace back: it reached a terminal status."""

    run_id: str
    status: str


class VariablesSet(Event, frozen=True, kw_only=True, tag="ws.variables_set"):
    """The workspace's plain variables were replaced; runs already created keep theirs."""

    variables: dict[str, str]


WorkspaceEvent = WorkspaceCreated | RunEnqueued | RunAdmitted | RunReleased | VariablesSet


class CreateWorkspace(Command, frozen=True, kw_only=True):
    org: str
    name: str
    config: Workspace


class EnqueueRun(Command, frozen=True, kw_only=True):
    run_id: str


class AdmitNext(Command, frozen=True, kw_only=True):
    pass


class ReleaseRun(Command, frozen=True, kw_only=True):
    run_id: str
    status: str


class SetVariables(Command, frozen=True, kw_only=True):
    variables: dict[str, str]


WorkspaceCommand = CreateWorkspace | EnqueueRun | AdmitNext | ReleaseRun | SetVariables


class WorkspaceState(msgspec.Struct, frozen=True, kw_only=True):
    org: str = ""
    name: str = ""
    config: Workspace | None = None
    created_at: datetime | None = None
    queue: tuple[str, ...] = ()
    active: str = ""
    version: int = 0

    @property
    def exists(self) -> bool:
        return self.config is not None


INITIAL = WorkspaceState()


def evolve(state: WorkspaceState, event: WorkspaceEvent) -> WorkspaceState:
    s = msgspec.structs.replace(state, version=state.version + 1)
    match event:
        case WorkspaceCreated():
            return msgspec.structs.replace(
                s, org=event.org, name=event.name, config=event.config, created_at=event.at
            )
        case RunEnqueued():
            return msgspec.structs.replace(s, queue=(*s.queue, event.run_id))
        case RunAdmitted():
            queue = tuple(r for r in s.queue if r != event.run_id)
            return msgspec.structs.replace(s, queue=queue, active=event.run_id)
        case RunReleased():
            queue = tuple(r for r in s.queue if r != event.run_id)
            active = "" if s.active == event.run_id else s.active
            return msgspec.structs.replace(s, queue=queue, active=active)
        case VariablesSet():
            assert s.config is not None, "variables of a workspace that was never created"
            config = msgspec.structs.replace(s.config, variables=dict(event.variables))
            return msgspec.structs.replace(s, config=config)
        case _:
            assert_never(event)


def fold(events: Sequence[WorkspaceEvent], state: WorkspaceState = INITIAL) -> WorkspaceState:
    for e in events:
        state = evolve(state, e)
    return state


def decide(
    state: WorkspaceState,
    command: WorkspaceCommand,
    *,
    now: datetime,
    new_id: Callable[[], str],
) -> list[WorkspaceEvent]:
    """Decide the workspace events of a command. AdmitNext may decide nothing."""
    who = command.actor
    match command:
        case CreateWorkspace():
            if state.exists:
                raise AlreadyExists(f"workspace {command.name} already exists")
            return [
                WorkspaceCreated(
                    at=now, actor=who, org=command.org, name=command.name, config=command.config
                )
            ]
        case EnqueueRun():
            if not state.exists:
                raise NotFound("workspace does not exist")
            if command.run_id in state.queue or command.run_id == state.active:
                raise Invalid(f"run {command.run_id} is already queued")
            return [RunEnqueued(at=now, actor=who, run_id=command.run_id)]
        case AdmitNext():
            if state.active or not state.queue:
                return []
            return [RunAdmitted(at=now, actor=who, run_id=state.queue[0])]
        case ReleaseRun():
            if command.run_id not in state.queue and command.run_id != state.active:
                return []
            return [RunReleased(at=now, actor=who, run_id=command.run_id, status=command.status)]
        case SetVariables():
            if not state.exists:
                raise NotFound("workspace does not exist")
            return [VariablesSet(at=now, actor=who, variables=dict(command.variables))]
        case _:
            assert_never(command)
