"""The run-triggers subscriber: an apply that changed something starts a run in each
workspace that follows its workspace.

It also records the end of a stack run's child run in its stack run (the `StackChild`
actions: services/processes/stacks/subscriber.py), since it sees every run event with
its state already: a consumer of its own would cost every run's events once more.

It acts on the `Follow` actions of the reaction table (events/react.py: the event that
ends a run `applied` having changed a resource), reads the organization's trigger graph
as it was at that event (its stream sequence: the graph is on the same stream) and
creates an `apply` run in each follower, caused by the source run
(`Cause(kind="run_trigger", ...)`).

Effectively once: each follower's run id is derived from the source run and the
follower (`derived_id`), so a redelivery (a replica killed before its ack, a nak) finds
the runs the first delivery made (`Result.existed`) and makes none twice. A follower
that refuses the run for good (gone or deleted since it followed, its default template
no longer suits) is skipped, logged; an error that may pass (the broker, contention) is
raised, and the event comes again.
"""

from __future__ import annotations

from typing import Final, get_args

import structlog

from events.errors import DomainError, NotFound
from events.react import Follow, StackChild, react
from events.run import RunEvent, RunState
from events.values import Cause
from infra.consumer import Received, Subscription
from infra.ids import derived_id
from services.app.commands import App
from services.processes.stacks.subscriber import child_ended
from services.processes.subscribers.context import SubscriberContext
from services.processes.triggers import graph

log = structlog.get_logger(__name__)

NAME: Final = "run-triggers"
ACTOR: Final = "run-trigger"  # who creates a follower's run (its cause names the source)
RUN_TYPE: Final = "apply"
_RUN_EVENTS = get_args(RunEvent)


class Triggers:
    """The handler: a run event and the run's state through it -> followers' runs."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.started = 0  # runs this process created (not those found existing)

    async def handle(self, r: Received) -> None:
        if not isinstance(r.event, _RUN_EVENTS) or not isinstance(r.state, RunState):
            return
        for action in react(r.event, r.state):
            if isinstance(action, Follow):
                await self.follow(action, at=r.seq)
            elif isinstance(action, StackChild):  # its stack run's (processes/stacks)
                await child_ended(self.app, action, str(r.state.status))

    async def follow(self, action: Follow, *, at: int = 0) -> list[str]:
        """A run in each workspace that followed the action's when its run ended (stream
        sequence `at`; 0: now); returns their ids. The graph as of the event, so every
        delivery of it, however late, starts the same runs: a trigger added after the
        apply ended starts nothing for it, one removed after still does."""
        g = await graph.load(self.app, action.org, through=at)
        made = []
        for target in g.state.followers_of(action.ws):
            run_id = await self._start(action, target)
            if run_id:
                made.append(run_id)
        return made

    async def _start(self, action: Follow, target: str) -> str:
        cause = Cause(kind="run_trigger", source_workspace=action.ws, source_run=action.run_id)
        message = f"run trigger: {action.ws} run {action.run_id} applied changes"
        try:
            result = await self.app.create_run(
                action.org,
                target,
                RUN_TYPE,
                ACTOR,
                message,
                cause=cause,
                run_id=derived_id("run-trigger", action.run_id, target),
            )
        except NotFound as e:  # gone since it followed
            log.info("run_trigger_skipped", org=action.org, workspace=target, reason=str(e))
            return ""
        except DomainError as e:
            if e.retryable:  # contention outlasted create_run's retries: the event comes again
                raise
            # never will: deleted since it followed, its default template no longer suits
            log.warning("run_trigger_refused", org=action.org, workspace=target, reason=str(e))
            return ""
        if not result.existed:
            self.started += 1
        log.info("run_triggered", org=action.org, workspace=target, source=action.ws,
                 source_run=action.run_id, run_id=result.state.run_id,
                 existed=result.existed)  # fmt: skip
        return str(result.state.run_id)


def subscription(triggers: Triggers) -> Subscription:
    """Run events, one lane per workspace (the default), the run's state folded through."""
    return Subscription(name=NAME, handle=triggers.handle, subjects=("rp.run.>",), with_state=True)


def subscriptions(ctx: SubscriberContext) -> list[Subscription]:
    """The registry's entry (services/processes/subscribers/registry.py)."""
    return [subscription(Triggers(ctx.app))]
