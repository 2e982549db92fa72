"""Stack runs: what to start next, and what a child's end, a failure policy and a resume
lead to. Pure (events/stack_run_events.py holds the events and the fold).

The process that advances stack runs (services/processes/stacks) derives everything
from the log: `ready(state)` names the nodes to start now, each with its child run id
(derived from the stack run, the node and the attempt), the shell creates those runs
(a second creation finds the first) and records each with `RecordStarted`; a child
run's end is recorded with `RecordEnded`. Both are idempotent: a start or an end
already recorded decides nothing, so a process killed at any line and started again
neither starts a node twice nor forgets one. An end recorded before its start (the
run's end delivered before the start was recorded) records both.

Dependency order: a node starts once every prerequisite in the selection succeeded
(`applied`/`no_changes` for apply and destroy, `planned`/`no_changes` for plan); a
destroy goes the other way round (a node is destroyed once everything depending on it
is). Failure policy, on a node that failed or was canceled:

- `pause` (default): nothing new starts, the children running finish; resumable;
- `abort`: nothing new starts, the running children are canceled (the shell, from the
  `org.stack_run_aborting` event), and the run ends `aborted` once none runs;
- `continue`: every node depending on the failed one (directly or not) is skipped;
  the independent ones go on, and the run ends `failed`.

`ResumeStackRun` on a paused, failed or aborted run: the failed, canceled and skipped
nodes wait again at their next attempt (new runs, linked through the node's `runs`);
ended-good nodes are not repeated. Two resumes decided at once cannot both land (the
append is checked): the second finds the run running and is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Final, assert_never

from events import stacks as sk
from events.base import Command
from events.errors import IllegalTransition
from events.stack_run_events import (
    BAD_CANCELED,
    CANCELED,
    FAILED,
    GOOD,
    INITIAL,
    REDO,
    RUN_TYPES,
    RUNNING,
    S_ABORTED,
    S_COMPLETED,
    S_FAILED,
    S_PAUSED,
    S_RUNNING,
    SUCCEEDED,
    WAITING,
    StackNodeEnded,
    StackNodesSkipped,
    StackNodeStarted,
    StackRunAborting,
    StackRunCreated,
    StackRunEnded,
    StackRunEvent,
    StackRunPaused,
    StackRunResumed,
    StackRunState,
    child_run_id,
    evolve,
)

__all__ = ["INITIAL", "decide", "evolve", "fold", "ready", "select"]

RESUMABLE: Final = frozenset({S_PAUSED, S_FAILED, S_ABORTED})


class CreateStackRun(Command, frozen=True, kw_only=True):
    stack_run_id: str
    org: str
    stack: str
    run_type: str
    definition: sk.Definition
    stack_seq: int = 0
    targets: list[str] = []
    skip_dependencies: bool = False
    failure_policy: str = ""  # "": the stack's
    message: str = ""


class RecordStarted(Command, frozen=True, kw_only=True):
    node: str
    run_id: str
    attempt: int
    ended_status: str = ""  # the run had ended already when its creation found it


class RecordEnded(Command, frozen=True, kw_only=True):
    node: str
    run_id: str  # "": its run could not be created
    run_status: str = ""
    reason: str = ""


class ResumeStackRun(Command, frozen=True, kw_only=True):
    pass


StackRunCommand = CreateStackRun | RecordStarted | RecordEnded | ResumeStackRun


def fold(events: Sequence[StackRunEvent], state: StackRunState = INITIAL) -> StackRunState:
    for e in events:
        state = evolve(state, e)
    return state


def select(d: sk.Definition, run_type: str, targets: list[str], skip: bool) -> list[str]:
    """The nodes a run covers: every node, or the targets with what they need first
    (their prerequisites; a destroy's: what depends on them) unless `skip`."""
    unknown = sorted(set(targets) - set(d.workspaces))
    if unknown:
        raise sk.InvalidStack(f"targets not in the stack: {', '.join(unknown)}")
    if not targets:
        return list(d.workspaces)
    if skip:
        return sorted(set(targets))
    if run_type == "destroy":
        flipped = [sk.Edge(source=e.target, target=e.source) for e in d.edges]
        d = sk.Definition(workspaces=d.workspaces, edges=flipped)
    return sk.with_dependencies(d, targets)


def _before(s: StackRunState) -> dict[str, list[str]]:
    """Each selected node's nodes that must succeed first (within the selection)."""
    chosen = set(s.selected)
    pre: dict[str, list[str]] = {n: [] for n in s.selected}
    for e in s.definition.edges:
        first, then = (e.target, e.source) if s.run_type == "destroy" else (e.source, e.target)
        if first in chosen and then in chosen:
            pre[then].append(first)
    return pre


def ready(s: StackRunState) -> list[tuple[str, int, str]]:
    """(node, attempt, child run id) of every node to start now, in name order."""
    if s.status != S_RUNNING or s.aborting:
        return []
    pre = _before(s)
    out = []
    for name in s.selected:
        node = s.nodes[name]
        if node.status == WAITING and all(s.nodes[p].status == SUCCEEDED for p in pre[name]):
            out.append((name, node.attempt, child_run_id(s.stack_run_id, name, node.attempt)))
    return out


def decide(
    state: StackRunState,
    command: StackRunCommand,
    *,
    now: datetime,
    new_id: Callable[[], str],
) -> list[StackRunEvent]:
    match command:
        case CreateStackRun():
            return [_created(state, command, now)]
        case RecordStarted():
            return _started(state, command, now)
        case RecordEnded():
            return _ended(state, command, now)
        case ResumeStackRun():
            return _resumed(state, command, now)
        case _:
            assert_never(command)


def _created(s: StackRunState, c: CreateStackRun, now: datetime) -> StackRunCreated:
    if s.exists:
        raise IllegalTransition(f"stack run {c.stack_run_id} exists already", status=s.status)
    if c.run_type not in RUN_TYPES:
        raise sk.InvalidStack(f"type is one of {', '.join(RUN_TYPES)}")
    policy = c.failure_policy or c.definition.failure_policy
    if policy not in sk.POLICIES:
        raise sk.InvalidStack(f"failure_policy is one of {', '.join(sk.POLICIES)}")
    selected = select(c.definition, c.run_type, c.targets, c.skip_dependencies)
    return StackRunCreated(
        at=now, actor=c.actor, stack_run_id=c.stack_run_id, org=c.org, stack=c.stack,
        run_type=c.run_type, definition=c.definition, stack_seq=c.stack_seq,
        selected=selected, targets=sorted(set(c.targets)),
        skip_dependencies=c.skip_dependencies, failure_policy=policy, message=c.message,
    )  # fmt: skip


def _started(s: StackRunState, c: RecordStarted, now: datetime) -> list[StackRunEvent]:
    node = s.nodes.get(c.node)
    if node is None or node.status != WAITING or node.attempt != c.attempt:
        return []  # recorded already (or a stale attempt): nothing to do
    if c.run_id != child_run_id(s.stack_run_id, c.node, c.attempt):
        return []  # not this node's run at this attempt
    if any(s.nodes[p].status != SUCCEEDED for p in _before(s)[c.node]):
        return []  # never made: a node's run is made once its prerequisites succeeded
    out: list[StackRunEvent] = [
        StackNodeStarted(at=now, actor=c.actor, node=c.node, run_id=c.run_id, attempt=c.attempt)
    ]
    if s.aborting or s.status == S_ABORTED:  # created as the run was being aborted
        out.append(StackRunAborting(at=now, actor=c.actor, node=c.node, cancel=[c.run_id]))
    if c.ended_status:
        after = fold(out, s)
        end = RecordEnded(actor=c.actor, node=c.node, run_id=c.run_id, run_status=c.ended_status)
        out += _ended(after, end, now)
    return out


def _outcome(run_type: str, run_status: str) -> str:
    if run_status in GOOD[run_type]:
        return SUCCEEDED
    return CANCELED if run_status in BAD_CANCELED else FAILED


def _ended(s: StackRunState, c: RecordEnded, now: datetime) -> list[StackRunEvent]:
    node = s.nodes.get(c.node)
    if node is None:
        return []
    out: list[StackRunEvent] = []
    if node.status == WAITING and c.run_id == child_run_id(s.stack_run_id, c.node, node.attempt):
        # its end came before its start was recorded: record both
        out += _started(s, RecordStarted(actor=c.actor, node=c.node, run_id=c.run_id,
                                         attempt=node.attempt), now)  # fmt: skip
        if not out:
            return []
    elif node.status == WAITING and not c.run_id:
        pass  # its run could not be created
    elif node.status != RUNNING or node.run_id != c.run_id:
        return []  # recorded already, or another attempt's run
    outcome = _outcome(s.run_type, c.run_status) if c.run_id else FAILED
    out.append(StackNodeEnded(at=now, actor=c.actor, node=c.node, run_id=c.run_id,
                              run_status=c.run_status, outcome=outcome,
                              reason=c.reason))  # fmt: skip
    after = fold(out, s)
    if outcome != SUCCEEDED:
        policy = _policy(after, c.node, c.actor, now)
        out += policy
        after = fold(policy, after)
    return out + _end(after, c.actor, now)


def _policy(s: StackRunState, node: str, actor: str, now: datetime) -> list[StackRunEvent]:
    """What the failure policy does about `node`'s failure."""
    match s.failure_policy:
        case "pause":
            if s.status == S_RUNNING and not s.aborting:
                return [StackRunPaused(at=now, actor=actor, node=node)]
            return []
        case "abort":
            if s.aborting or s.ended:
                return []
            cancel = sorted(n.run_id for n in s.nodes.values() if n.status == RUNNING)
            return [StackRunAborting(at=now, actor=actor, node=node, cancel=cancel)]
        case _:  # continue
            skipped = _dependents(s, node)
            if not skipped:
                return []
            return [StackNodesSkipped(at=now, actor=actor, nodes=skipped, because_of=node)]


def _dependents(s: StackRunState, node: str) -> list[str]:
    """The waiting nodes that need `node` first, directly or not."""
    after: dict[str, list[str]] = {}
    for n, firsts in _before(s).items():
        for f in firsts:
            after.setdefault(f, []).append(n)
    seen: set[str] = set()
    todo = [node]
    while todo:
        for n in after.get(todo.pop(), ()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return sorted(n for n in seen if s.nodes[n].status == WAITING)


def _end(s: StackRunState, actor: str, now: datetime) -> list[StackRunEvent]:
    """The run's end, once nothing runs and nothing is left to start."""
    if s.ended or any(n.status == RUNNING for n in s.nodes.values()):
        return []
    if s.aborting:
        return [StackRunEnded(at=now, actor=actor, status=S_ABORTED)]
    if s.status != S_RUNNING or any(n.status == WAITING for n in s.nodes.values()):
        return []  # paused (resumable), or more to start
    good = all(n.status == SUCCEEDED for n in s.nodes.values())
    return [StackRunEnded(at=now, actor=actor, status=S_COMPLETED if good else S_FAILED)]


def _resumed(s: StackRunState, c: ResumeStackRun, now: datetime) -> list[StackRunEvent]:
    if not s.exists:
        raise IllegalTransition("no such stack run", status="")
    if s.status not in RESUMABLE:
        raise IllegalTransition(f"a {s.status} stack run cannot be resumed", status=s.status)
    redo = sorted(n for n, node in s.nodes.items() if node.status in REDO)
    out: list[StackRunEvent] = [StackRunResumed(at=now, actor=c.actor, nodes=redo)]
    return out + _end(fold(out, s), c.actor, now)
