"""A stack run's events, its state and their fold (events/stack_runs.py decides). Pure.

A stack run is an aggregate of its own on `rp.org.<org>.stack_run.<id>`. It records
the stack's definition as it was at the start (a later change of the stack changes no
run under way), which nodes were selected, and then each node's child runs: started
(`org.stack_node_started`, its run id derived from the stack run, the node and the
attempt: the same node of the same attempt is always the same run) and ended
(`org.stack_node_ended`, with the child run's status). What the policy does about a
failure, a resume and the end are events too; the fold only copies facts.
"""

from __future__ import annotations

import base64
import hashlib
from datetime import datetime
from typing import Final, assert_never

import msgspec

from events.base import Event
from events.stacks import Definition

# Node statuses
WAITING, RUNNING, SUCCEEDED, FAILED, CANCELED, SKIPPED = (
    "waiting", "running", "succeeded", "failed", "canceled", "skipped",
)  # fmt: skip
REDO: Final = frozenset({FAILED, CANCELED, SKIPPED})  # what a resume starts again
# Stack run statuses: running and paused may go on; the other three ended (and a
# failed or aborted one may still be resumed).
S_RUNNING, S_PAUSED, S_COMPLETED, S_FAILED, S_ABORTED = (
    "running", "paused", "completed", "failed", "aborted",
)  # fmt: skip
RUN_TYPES: Final = ("plan", "apply", "destroy")
# The child run statuses that let a dependent go on, by stack run type.
GOOD: Final = {
    "plan": frozenset({"planned", "no_changes"}),
    "apply": frozenset({"applied", "no_changes"}),
    "destroy": frozenset({"applied", "no_changes"}),
}
BAD_CANCELED: Final = frozenset({"canceled", "discarded"})


class StackRunCreated(Event, frozen=True, kw_only=True, tag="org.stack_run_created"):
    stack_run_id: str
    org: str
    stack: str
    run_type: str  # RUN_TYPES
    definition: Definition  # the stack's as of the start
    stack_seq: int = 0  # the stream sequence of the stack's definition read
    selected: list[str]  # the nodes this run covers, sorted
    targets: list[str] = []  # as asked ([]: every node)
    skip_dependencies: bool = False
    failure_policy: str  # the run's own (the stack's unless asked otherwise)
    message: str = ""


class StackNodeStarted(Event, frozen=True, kw_only=True, tag="org.stack_node_started"):
    node: str
    run_id: str
    attempt: int


class StackNodeEnded(Event, frozen=True, kw_only=True, tag="org.stack_node_ended"):
    node: str
    run_id: str  # "": its run could not be created (`reason` says why)
    run_status: str = ""  # the child run's terminal status
    outcome: str  # SUCCEEDED, FAILED or CANCELED
    reason: str = ""


class StackNodesSkipped(Event, frozen=True, kw_only=True, tag="org.stack_nodes_skipped"):
    """Policy `continue`: the dependents of a failed node will not run."""

    nodes: list[str]
    because_of: str


class StackRunPaused(Event, frozen=True, kw_only=True, tag="org.stack_run_paused"):
    """Policy `pause`: nothing new starts; what runs finishes."""

    node: str  # the node whose failure paused it


class StackRunAborting(Event, frozen=True, kw_only=True, tag="org.stack_run_aborting"):
    """Policy `abort`: nothing new starts and the running children are to be canceled."""

    node: str
    cancel: list[str]  # the run ids of the children running then


class StackRunResumed(Event, frozen=True, kw_only=True, tag="org.stack_run_resumed"):
    """The failed, canceled and skipped nodes wait again, each at its next attempt."""

    nodes: list[str]


class StackRunEnded(Event, frozen=True, kw_only=True, tag="org.stack_run_ended"):
    status: str  # S_COMPLETED, S_FAILED or S_ABORTED


StackRunEvent = (
    StackRunCreated
    | StackNodeStarted
    | StackNodeEnded
    | StackNodesSkipped
    | StackRunPaused
    | StackRunAborting
    | StackRunResumed
    | StackRunEnded
)
STACK_RUN_EVENTS = (
    StackRunCreated,
    StackNodeStarted,
    StackNodeEnded,
    StackNodesSkipped,
    StackRunPaused,
    StackRunAborting,
    StackRunResumed,
    StackRunEnded,
)


class Node(msgspec.Struct, frozen=True, kw_only=True):
    status: str = WAITING
    attempt: int = 1  # the attempt its next (or current) run is
    run_id: str = ""  # its current or last run
    run_status: str = ""
    runs: list[str] = []  # every run it had, in order (a resume's are linked by this)


class StackRunState(msgspec.Struct, frozen=True, kw_only=True):
    stack_run_id: str = ""
    org: str = ""
    stack: str = ""
    run_type: str = ""
    definition: Definition = Definition()
    selected: list[str] = []
    targets: list[str] = []
    skip_dependencies: bool = False
    failure_policy: str = ""
    message: str = ""
    created_by: str = ""
    created_at: datetime | None = None
    status: str = ""
    nodes: dict[str, Node] = {}
    resumes: int = 0
    # who resumed it last: the runs started after a resume are that person's doing, so
    # they are created as them (four-eyes holds the resumer, not the first starter)
    resumed_by: str = ""
    aborting: bool = False
    version: int = 0

    @property
    def starter(self) -> str:
        """Who the next child runs are created as: the last resumer, else the starter."""
        return self.resumed_by or self.created_by

    @property
    def exists(self) -> bool:
        return bool(self.stack_run_id)

    @property
    def ended(self) -> bool:
        return self.status in (S_COMPLETED, S_FAILED, S_ABORTED)


INITIAL = StackRunState()


def subject(org: str, stack_run_id: str) -> str:
    return f"rp.org.{org}.stack_run.{stack_run_id}"


def child_run_id(stack_run_id: str, node: str, attempt: int) -> str:
    """The run id of `node`'s child run at `attempt`: a second creation finds the first
    (the same derivation as infra/ids.py `derived_id`, kept pure here)."""
    parts = ("stack-run", stack_run_id, node, str(attempt))
    digest = hashlib.sha256("\x1f".join(parts).encode()).digest()
    return base64.b32encode(digest).decode().lower()[:26]


def _node(s: StackRunState, name: str, **changes: object) -> dict[str, Node]:
    return {**s.nodes, name: msgspec.structs.replace(s.nodes[name], **changes)}


def evolve(s: StackRunState, e: StackRunEvent) -> StackRunState:
    s = msgspec.structs.replace(s, version=s.version + 1)
    match e:
        case StackRunCreated():
            return msgspec.structs.replace(
                s, stack_run_id=e.stack_run_id, org=e.org, stack=e.stack, run_type=e.run_type,
                definition=e.definition, selected=e.selected, targets=e.targets,
                skip_dependencies=e.skip_dependencies, failure_policy=e.failure_policy,
                message=e.message, created_by=e.actor, created_at=e.at, status=S_RUNNING,
                nodes={n: Node() for n in e.selected},
            )  # fmt: skip
        case StackNodeStarted():
            runs = [*s.nodes[e.node].runs, e.run_id]
            nodes = _node(s, e.node, status=RUNNING, run_id=e.run_id, attempt=e.attempt,
                          run_status="", runs=runs)  # fmt: skip
            return msgspec.structs.replace(s, nodes=nodes)
        case StackNodeEnded():
            nodes = _node(s, e.node, status=e.outcome, run_id=e.run_id, run_status=e.run_status)
            return msgspec.structs.replace(s, nodes=nodes)
        case StackNodesSkipped():
            nodes = dict(s.nodes)
            for n in e.nodes:
                nodes[n] = msgspec.structs.replace(nodes[n], status=SKIPPED)
            return msgspec.structs.replace(s, nodes=nodes)
        case StackRunPaused():
            return msgspec.structs.replace(s, status=S_PAUSED)
        case StackRunAborting():
            return msgspec.structs.replace(s, aborting=True)
        case StackRunResumed():
            nodes = dict(s.nodes)
            for n in e.nodes:
                old = nodes[n]
                nodes[n] = msgspec.structs.replace(old, status=WAITING, attempt=old.attempt + 1)
            return msgspec.structs.replace(
                s, nodes=nodes, status=S_RUNNING, aborting=False, resumes=s.resumes + 1,
                resumed_by=e.actor,
            )  # fmt: skip
        case StackRunEnded():
            return msgspec.structs.replace(s, status=e.status, aborting=False)
        case _:
            assert_never(e)
