"""Stacks: a named set of one organization's workspaces with dependency edges. Pure.

An edge `source -> target` says target depends on source: a stack run applies source
first (and destroys it last). Each stack is ONE aggregate on its own subject
(`rp.org.<org>.stack.<name>`), and every change is decided on the whole definition and
appended with the subject's expected last sequence, as run triggers are
(events/run_triggers.py): two changes decided on the same definition cannot both land.

Every event carries the whole definition after it (nodes, edges, failure policy): the
projection writes it as it comes, and a reader never needs the history to know a stack.

The rules, each refused with its reason:

- the nodes are workspace names (the shell checks they are live workspaces of the
  organization: the core knows no workspaces), each once, at most MAX_NODES;
- an edge joins two nodes of the stack, once, at most MAX_EDGES;
- no edge closes a cycle (`StackCycle` names one, in dependency order, first and last
  the same), a workspace depending on itself included;
- the failure policy is one of POLICIES (`pause` by default).

A workspace may belong to any number of stacks: nothing here looks at other stacks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Final, assert_never

import msgspec

from events.base import Command, Event
from events.errors import AlreadyExists, Invalid, NotFound

MAX_NODES: Final = 200  # workspaces in one stack
MAX_EDGES: Final = 1000
# per organization (checked by the API on its read model): each is listed with its levels
# computed (about 1 ms for 200 nodes and 1,000 edges), so their number is bounded too
MAX_STACKS = 200
POLICIES: Final = ("pause", "abort", "continue")
DEFAULT_POLICY: Final = "pause"


class StackCycle(Invalid):
    """The edges close a cycle: `cycle` lists it, first and last the same."""

    code = "stack-cycle"

    def __init__(self, cycle: Sequence[str]) -> None:
        self.cycle = list(cycle)
        super().__init__(f"the stack's edges close a cycle: {' -> '.join(self.cycle)}")


class InvalidStack(Invalid):
    """A definition that breaks a rule other than a cycle (an unknown node, a limit)."""

    code = "invalid-stack"


class Edge(msgspec.Struct, frozen=True, kw_only=True):
    """`target` depends on `source`."""

    source: str
    target: str


class Definition(msgspec.Struct, frozen=True, kw_only=True):
    """What a stack is: its nodes (sorted), edges (sorted) and failure policy."""

    workspaces: list[str] = []
    edges: list[Edge] = []
    failure_policy: str = DEFAULT_POLICY


class StackCreated(Event, frozen=True, kw_only=True, tag="org.stack_created"):
    name: str
    definition: Definition


class StackChanged(Event, frozen=True, kw_only=True, tag="org.stack_changed"):
    """The whole definition after the change."""

    name: str
    definition: Definition


class StackDeleted(Event, frozen=True, kw_only=True, tag="org.stack_deleted"):
    name: str


StackEvent = StackCreated | StackChanged | StackDeleted


class CreateStack(Command, frozen=True, kw_only=True):
    name: str
    definition: Definition


class ChangeStack(Command, frozen=True, kw_only=True):
    name: str
    definition: Definition


class DeleteStack(Command, frozen=True, kw_only=True):
    name: str


StackCommand = CreateStack | ChangeStack | DeleteStack


class StackState(msgspec.Struct, frozen=True, kw_only=True):
    name: str = ""  # "": never created, or deleted
    definition: Definition = Definition()
    changed_at: datetime | None = None
    changed_by: str = ""
    version: int = 0

    @property
    def exists(self) -> bool:
        return bool(self.name)


INITIAL = StackState()


def subject(org: str, name: str) -> str:
    return f"rp.org.{org}.stack.{name}"


def decide(
    state: StackState,
    command: StackCommand,
    *,
    now: datetime,
    new_id: Callable[[], str],
) -> list[StackEvent]:
    """The events of a change to the stack, decided on its whole definition."""
    match command:
        case CreateStack():
            if state.exists:
                raise AlreadyExists(f"stack {command.name} exists already")
            d = normalized(command.definition)
            return [StackCreated(at=now, actor=command.actor, name=command.name, definition=d)]
        case ChangeStack():
            if not state.exists:
                raise NotFound(f"stack {command.name} not found")
            d = normalized(command.definition)
            return [StackChanged(at=now, actor=command.actor, name=command.name, definition=d)]
        case DeleteStack():
            if not state.exists:
                raise NotFound(f"stack {command.name} not found")
            return [StackDeleted(at=now, actor=command.actor, name=command.name)]
        case _:
            assert_never(command)


def normalized(d: Definition) -> Definition:
    """`d` checked against every rule, nodes and edges sorted (the same stack, the same
    bytes); raises InvalidStack or StackCycle."""
    nodes = set(d.workspaces)
    if len(nodes) != len(d.workspaces):
        raise InvalidStack("a workspace is listed twice")
    if not nodes:
        raise InvalidStack("a stack has at least one workspace")
    if len(nodes) > MAX_NODES:
        raise InvalidStack(f"a stack has at most {MAX_NODES} workspaces")
    if len(d.edges) > MAX_EDGES:
        raise InvalidStack(f"a stack has at most {MAX_EDGES} edges")
    if d.failure_policy not in POLICIES:
        raise InvalidStack(f"failure_policy is one of {', '.join(POLICIES)}")
    pairs = {(e.source, e.target) for e in d.edges}
    if len(pairs) != len(d.edges):
        raise InvalidStack("an edge is listed twice")
    for e in d.edges:
        for end in (e.source, e.target):
            if end not in nodes:
                raise InvalidStack(f"edge {e.source} -> {e.target}: {end} is not in the stack")
    edges = sorted(d.edges, key=lambda e: (e.source, e.target))
    cycle = find_cycle(nodes, edges)
    if cycle is not None:
        raise StackCycle(cycle)
    return Definition(workspaces=sorted(nodes), edges=edges, failure_policy=d.failure_policy)


def _dependents(edges: Iterable[Edge]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for e in edges:
        out.setdefault(e.source, []).append(e.target)
    return {s: sorted(ts) for s, ts in out.items()}


def find_cycle(nodes: Iterable[str], edges: Sequence[Edge]) -> list[str] | None:
    """A cycle of the edges (in dependency order, first and last the same), or None.
    Depth-first from each node in name order: the same graph names the same cycle."""
    after = _dependents(edges)
    colour: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(nodes):
        if colour.get(start):
            continue
        path = [start]
        todo = [iter(after.get(start, ()))]
        colour[start] = 1
        while todo:
            nxt = next(todo[-1], None)
            if nxt is None:
                colour[path.pop()] = 2
                todo.pop()
            elif colour.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            elif not colour.get(nxt):
                colour[nxt] = 1
                path.append(nxt)
                todo.append(iter(after.get(nxt, ())))
    return None


def prerequisites(d: Definition) -> dict[str, list[str]]:
    """Each node's direct prerequisites (the sources of its edges), sorted."""
    out: dict[str, list[str]] = {n: [] for n in d.workspaces}
    for e in d.edges:
        out[e.target].append(e.source)
    return {n: sorted(s) for n, s in out.items()}


def levels(d: Definition) -> list[list[str]]:
    """The nodes by DAG level: level 0 has no prerequisite, level n's deepest one is on
    level n - 1; each level sorted."""
    pre = prerequisites(d)
    level: dict[str, int] = {}
    for n in _topological(d):
        level[n] = 1 + max((level[p] for p in pre[n]), default=-1)
    out: list[list[str]] = [[] for _ in range(1 + max(level.values(), default=-1))]
    for n in sorted(level):
        out[level[n]].append(n)
    return out


def _topological(d: Definition) -> list[str]:
    pre = {n: set(ps) for n, ps in prerequisites(d).items()}
    after = _dependents(d.edges)
    ready = sorted(n for n, ps in pre.items() if not ps)
    out = []
    while ready:
        n = ready.pop(0)
        out.append(n)
        for t in after.get(n, ()):
            pre[t].discard(n)
            if not pre[t]:
                ready.append(t)
        ready.sort()
    return out


def with_dependencies(d: Definition, targets: Iterable[str]) -> list[str]:
    """`targets` and everything they depend on, directly or not, sorted."""
    pre = prerequisites(d)
    seen: set[str] = set()
    todo = list(targets)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(pre.get(n, ()))
    return sorted(seen)


def evolve(state: StackState, event: StackEvent) -> StackState:
    v = state.version + 1
    match event:
        case StackCreated() | StackChanged():
            return StackState(
                name=event.name,
                definition=event.definition,
                changed_at=event.at,
                changed_by=event.actor,
                version=v,
            )
        case StackDeleted():
            return StackState(changed_at=event.at, changed_by=event.actor, version=v)
        case _:
            assert_never(event)


def fold(events: Sequence[StackEvent], state: StackState = INITIAL) -> StackState:
    for event in events:
        state = evolve(state, event)
    return state
