"""Stack runs: start one, load it, resume it, and record what its children did
(events/stack_runs.py). The process that advances them is services/processes/stacks.

A stack run is its own subject (`rp.org.<org>.stack_run.<id>`), every change appended
at the subject's expected last sequence: two resumes decided at once cannot both land,
and a start or an end recorded twice decides nothing the second time.
"""

from __future__ import annotations

import msgspec

from events import stack_runs as sr
from events.errors import NotFound
from events.stack_run_events import StackRunState, subject
from infra.eventstore import LATEST
from services.app import stacks as stacks_app
from services.app.aggregates import STACK_RUN
from services.app.commands import App


class StackRun(msgspec.Struct, frozen=True, kw_only=True):
    """The stack run as read: its state and the subject's last sequence."""

    state: StackRunState
    seq: int


class Start(msgspec.Struct, frozen=True, kw_only=True):
    """What a stack run is asked to be."""

    run_type: str
    targets: list[str] = []
    skip_dependencies: bool = False
    failure_policy: str = ""  # "": the stack's
    message: str = ""


async def start(
    app: App, org: str, stack: str, ask: Start, actor: str, found: stacks_app.Stack | None = None
) -> StackRun:
    """A new stack run of the stack as the stream's leader has it (NotFound if none), or
    of `found`: the definition the caller's access was checked on (read again here, a
    change landed between would run workspaces nobody checked)."""
    if found is None:
        found = await stacks_app.load(app, org, stack, min_seq=LATEST)
    if not found.state.exists:
        raise NotFound(f"stack {stack} not found")
    stack_run_id = app.ids()
    command = sr.CreateStackRun(
        actor=actor,
        stack_run_id=stack_run_id,
        org=org,
        stack=stack,
        run_type=ask.run_type,
        definition=found.state.definition,
        stack_seq=found.seq,
        targets=ask.targets,
        skip_dependencies=ask.skip_dependencies,
        failure_policy=ask.failure_policy,
        message=ask.message,
    )
    return await execute(app, org, stack_run_id, command)


async def load(app: App, org: str, stack_run_id: str, *, min_seq: int = 0) -> StackRun:
    found = await app.load(STACK_RUN, subject(org, stack_run_id), min_seq=min_seq)
    return StackRun(state=found.state, seq=found.seq)


async def resume(app: App, org: str, stack_run_id: str, actor: str) -> StackRun:
    """Its failed, canceled and skipped nodes start again (IllegalTransition unless the
    run is paused, failed or aborted)."""
    return await execute(app, org, stack_run_id, sr.ResumeStackRun(actor=actor))


async def execute(app: App, org: str, stack_run_id: str, command: sr.StackRunCommand) -> StackRun:
    done = await app.execute(STACK_RUN, subject(org, stack_run_id), command)
    return StackRun(state=done.state, seq=done.seq)
