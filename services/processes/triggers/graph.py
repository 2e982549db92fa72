"""An organization's run-trigger graph: load it, add and remove edges (events/run_triggers.py).

The graph is one subject (`rp.org.<org>.run_triggers`), and every change is decided on
the whole of it and appended with that subject's expected last sequence: of two changes
decided on the same graph only the first lands, the second conflicts, is decided again
on the graph with the first in it, and is refused if together they would close a cycle.
"""

from __future__ import annotations

import asyncio

import msgspec

from events import run_triggers as rt
from events.errors import NotFound
from services.app.aggregates import RUN_TRIGGERS
from services.app.commands import App


class Graph(msgspec.Struct, frozen=True, kw_only=True):
    """The graph as read: its state and the subject's last sequence (0: no event yet)."""

    state: rt.TriggerGraph
    seq: int


async def load(app: App, org: str, *, min_seq: int = 0, through: int = 0) -> Graph:
    """The organization's trigger graph (empty if it never had a trigger); with
    `through`, as it was at that stream sequence (its later changes left out)."""
    if not through:
        found = await app.load(RUN_TRIGGERS, rt.subject(org), min_seq=min_seq)
        return Graph(state=found.state, seq=found.seq)
    envs = [e for e in await app.store.read(rt.subject(org), min_seq=min_seq) if e.seq <= through]
    state = RUN_TRIGGERS.fold([e.event for e in envs], RUN_TRIGGERS.initial)
    return Graph(state=state, seq=envs[-1].seq if envs else 0)


async def add(app: App, org: str, target: str, source: str, actor: str) -> Graph:
    """`target` follows `source`: both must be workspaces of `org` (NotFound), the edge
    must close no cycle (`rt.TriggerCycle`) and stay within the caps."""
    await _exists(app, org, target, source)
    return await _change(app, org, rt.AddRunTrigger(actor=actor, source=source, target=target))


async def remove(app: App, org: str, target: str, source: str, actor: str) -> Graph:
    """`target` no longer follows `source` (NotFound if it did not)."""
    return await _change(app, org, rt.RemoveRunTrigger(actor=actor, source=source, target=target))


async def _exists(app: App, org: str, *names: str) -> None:
    """Each name is a live workspace of `org`: the subjects are the organization's own,
    so a workspace of another organization is simply not found; nor is a deleted one
    (its `deleted` flag comes with workspace deletion, issue 14 item 7)."""
    loaded = await asyncio.gather(*(app.load_ws(org, n) for n in names))
    for name, w in zip(names, loaded, strict=True):
        if not w.state.exists or getattr(w.state, "deleted", False):
            raise NotFound(f"workspace {name} not found")


async def _change(app: App, org: str, command: rt.RunTriggerCommand) -> Graph:
    """Decide and append on the organization's trigger graph (`Repository.execute`)."""
    done = await app.execute(RUN_TRIGGERS, rt.subject(org), command)
    return Graph(state=done.state, seq=done.seq)
