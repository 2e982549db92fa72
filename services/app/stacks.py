"""An organization's stacks: load one, create, change and delete it (events/stacks.py).

A stack is one subject (`rp.org.<org>.stack.<name>`); every change is decided on its
whole definition and appended with that subject's expected last sequence. Every node
must be a live workspace of the organization when the change is made: the subjects
read are the organization's own, so a workspace of another organization is simply not
found (a later deletion of a workspace leaves the stack naming it: a stack run refuses
to start it, services/processes/stacks).
"""

from __future__ import annotations

import asyncio

import msgspec

from events import stacks as sk
from events.errors import NotFound
from services.app.aggregates import STACK
from services.app.commands import App


class Stack(msgspec.Struct, frozen=True, kw_only=True):
    """The stack as read: its state and the subject's last sequence (0: no event yet)."""

    state: sk.StackState
    seq: int


async def load(app: App, org: str, name: str, *, min_seq: int = 0) -> Stack:
    """The stack (its state's `exists` False if it never was or was deleted)."""
    found = await app.load(STACK, sk.subject(org, name), min_seq=min_seq)
    return Stack(state=found.state, seq=found.seq)


async def create(app: App, org: str, name: str, d: sk.Definition, actor: str) -> Stack:
    """A new stack: every node a live workspace of `org` (NotFound), the definition
    within the rules (`sk.InvalidStack`, `sk.StackCycle`), the name not taken."""
    await _exist(app, org, d.workspaces)
    return await _change(app, org, name, sk.CreateStack(actor=actor, name=name, definition=d))


async def change(app: App, org: str, name: str, d: sk.Definition, actor: str) -> Stack:
    """The stack's new whole definition, checked as at creation."""
    await _exist(app, org, d.workspaces)
    return await _change(app, org, name, sk.ChangeStack(actor=actor, name=name, definition=d))


async def delete(app: App, org: str, name: str, actor: str) -> Stack:
    return await _change(app, org, name, sk.DeleteStack(actor=actor, name=name))


async def _exist(app: App, org: str, names: list[str]) -> None:
    """Each name is a live workspace of `org`, checked 20 at a time."""
    unique = sorted(set(names))
    for i in range(0, len(unique), 20):
        chunk = unique[i : i + 20]
        loaded = await asyncio.gather(*(app.load_ws(org, n) for n in chunk))
        for n, w in zip(chunk, loaded, strict=True):
            if not w.state.exists or getattr(w.state, "deleted", False):
                raise NotFound(f"workspace {n} not found")


async def _change(app: App, org: str, name: str, command: sk.StackCommand) -> Stack:
    done = await app.execute(STACK, sk.subject(org, name), command)
    return Stack(state=done.state, seq=done.seq)
