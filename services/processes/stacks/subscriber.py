"""The stack-run subscriber: advances stack runs, derived from the log alone.

On every event of a stack run (`rp.org.<org>.stack_run.<id>`, its own durable consumer
`rp-sub-stack-runs`) it reads the stack run at least as new as that event and:

- creates the child run of each node `ready` names, its id derived from the stack
  run, the node and the attempt (`child_run_id`: a second creation finds the first,
  `existed`), caused by the stack run (`Cause(kind="stack_run", ...)`) and created by
  the person who started it, or after a resume by who resumed it (their approvals
  rules hold as for any of their runs: four-eyes keeps a resumer from approving the
  runs their resume started), then
  records it started (`RecordStarted`: a start recorded already decides nothing). The
  person's access is read again first: one removed, suspended or no longer granted the
  run type starts nothing more (the node fails, saying why). A
  run found ended already is recorded ended with it. A node whose run cannot be made
  (its workspace gone, its template no longer suits) is recorded failed with why;
- while the run is aborting, cancels every running child (one already applying
  finishes: its end is recorded as any other).

A child run's end comes through the run-triggers subscription (it sees every run event
with its state: events/react.py `StackChild`), recorded by `child_ended`.

Killed at any line, nothing is lost or done twice: the event is delivered again (no
ack), the same nodes are found ready, their runs found existing, their starts recorded
once; an end delivered before its start was recorded records both (events/stack_runs.py).
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Final

import structlog

from events import access
from events import run as run_agg
from events import stack_runs as sr
from events.errors import DomainError, Forbidden, IllegalTransition, NotFound
from events.members import user_id_of
from events.react import StackChild
from events.run import RunState
from events.stack_run_events import RUNNING, StackRunState
from events.values import Cause
from infra.consumer import Received, Subscription, by_subject
from infra.eventstore import LATEST
from services.app import stack_runs as runs_app
from services.app.commands import App
from services.app.execute import Result
from services.processes.subscribers.context import SubscriberContext

log = structlog.get_logger(__name__)

NAME: Final = "stack-runs"
ACTOR: Final = "stack-run"  # who records what the process learned
SUBJECTS: Final = ("rp.org.*.stack_run.*",)
CREATE_AT_ONCE: Final = 16  # child runs created concurrently by one advance
Made = Result[RunState] | DomainError


class StackRuns:
    """The handler of stack-run events, and the recorder of child runs' ends."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.started = 0  # child runs this process created (not those found existing)

    async def handle(self, r: Received) -> None:
        parts = r.subject.split(".")
        if len(parts) != 5 or parts[3] != "stack_run":
            return
        await self.advance(parts[2], parts[4], min_seq=r.seq)

    async def advance(self, org: str, stack_run_id: str, *, min_seq: int = 0) -> None:
        """Start what is ready, cancel what an abort cancels: as the log says now. The
        ready nodes' runs are created at once (CREATE_AT_ONCE at a time), then their
        starts recorded one by one (each an append at the subject's expected sequence:
        recorded at once they would only collide)."""
        s = (await runs_app.load(self.app, org, stack_run_id, min_seq=min_seq)).state
        if not s.exists:
            return
        if s.aborting:
            await self._cancel(s)
        ready = sr.ready(s)
        gate = asyncio.Semaphore(CREATE_AT_ONCE)

        async def create(node: str, attempt: int, run_id: str) -> Made:
            async with gate:
                return await self._create(s, node, attempt, run_id)

        made = await asyncio.gather(*(create(*r) for r in ready))
        for (node, attempt, run_id), result in zip(ready, made, strict=True):
            await self._record(s, node, attempt, run_id, result)

    async def _create(self, s: StackRunState, node: str, attempt: int, run_id: str) -> Made:
        """The node's child run (created now, or found), or why it can never be."""
        by = s.starter  # the last resumer's runs are theirs (four-eyes holds them)
        cause = Cause(kind="stack_run", user=by, stack=s.stack,
                      stack_run=s.stack_run_id, attempt=attempt)  # fmt: skip
        message = s.message or f"stack {s.stack} run {s.stack_run_id}"
        try:
            refused = await self._refusal(s, by, node)
            if (
                refused is not None
                and not (await self.app.load_run(s.org, node, run_id, min_seq=LATEST)).state.exists
            ):
                return refused  # (one made before, while they could, is found as usual)
            return await self.app.create_run(
                s.org, node, s.run_type, by, message, cause=cause, run_id=run_id
            )
        except DomainError as e:
            if e.retryable:
                raise  # contention outlasted create_run's retries: the event comes again
            return e

    async def _refusal(self, s: StackRunState, by: str, node: str) -> DomainError | None:
        """Why `by` may no longer start the stack run's type of run on `node` (None: they
        may). A person's access is read as it is now: removed from the organization,
        suspended or no longer granted it, they start nothing more through a stack run
        begun before. Others (organization and team tokens: no member) are not judged."""
        if "@" not in by:
            return None
        org = (await self.app.load_org(s.org)).state
        who = access.for_member(s.org, org.members.get(user_id_of(by)), org.teams)
        if who is None:
            return Forbidden(f"{by} is no longer an active user of {s.org}")
        folder = (await self.app.load_ws(s.org, node)).state.folder
        target = access.Target(org=s.org, workspace=node, folders=(folder,) if folder else ())
        action = access.run_action(s.run_type)
        if not access.allowed(access.inherited(who, org.folders), action, target):
            return Forbidden(f"{by} may no longer start a {s.run_type} run on {node}")
        return None

    async def _record(
        self, s: StackRunState, node: str, attempt: int, run_id: str, made: Made
    ) -> None:
        if isinstance(made, DomainError):  # its workspace gone, its template unsuited
            log.warning("stack_node_refused", org=s.org, stack_run=s.stack_run_id, node=node,
                        reason=str(made))  # fmt: skip
            end = sr.RecordEnded(actor=ACTOR, node=node, run_id="", reason=str(made))
            await _recorded(self.app, s.org, s.stack_run_id, end)
            return
        if not made.existed:
            self.started += 1
        child = made.state
        ended = str(child.status) if child.terminal else ""
        record = sr.RecordStarted(actor=ACTOR, node=node, run_id=run_id, attempt=attempt,
                                  ended_status=ended)  # fmt: skip
        await _recorded(self.app, s.org, s.stack_run_id, record)
        log.info("stack_node_started", org=s.org, stack_run=s.stack_run_id, node=node,
                 run_id=run_id, attempt=attempt, existed=made.existed)  # fmt: skip

    async def _cancel(self, s: StackRunState) -> None:
        for node, n in sorted(s.nodes.items()):
            if n.status != RUNNING:
                continue
            cancel = run_agg.CancelRun(actor=ACTOR, reason=f"stack run {s.stack_run_id} aborted")
            try:
                await self.app.run_command(s.org, node, n.run_id, cancel)
            except (IllegalTransition, NotFound):
                pass  # ended, or applying: it finishes and its end is recorded


async def child_ended(app: App, action: StackChild, status: str) -> None:
    """Record a stack run's child run's end (`status`: its terminal status)."""
    end = sr.RecordEnded(actor=ACTOR, node=action.ws, run_id=action.run_id, run_status=status)
    try:
        await _recorded(app, action.org, action.stack_run, end)
    except NotFound:  # no such stack run: a cause made up by no stack run
        log.warning("stack_child_orphan", org=action.org, run_id=action.run_id)


# One writer at a time per stack run in this process: the ends of a level's children
# arrive on as many lanes at once, and appended at once they collide at the expected
# sequence, each loser reading the run again (100 children canceled together cost the
# subscribers 19 ms of CPU each, against 3 ms for their starts). Replicas still collide
# among themselves, rarely; the append's check keeps that correct.
_writing: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()


async def _recorded(app: App, org: str, stack_run_id: str, command: sr.StackRunCommand) -> None:
    lock = _writing.setdefault(f"{org}.{stack_run_id}", asyncio.Lock())
    async with lock:
        await runs_app.execute(app, org, stack_run_id, command)


def subscription(runs: StackRuns) -> Subscription:
    """Stack-run events, one lane per stack run."""
    return Subscription(name=NAME, handle=runs.handle, subjects=SUBJECTS, lane=by_subject)


def subscriptions(ctx: SubscriberContext) -> list[Subscription]:
    """The registry's entry (services/processes/subscribers/registry.py)."""
    return [subscription(StackRuns(ctx.app))]
