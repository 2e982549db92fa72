"""A hypothesis state machine of the run lifecycle and the workspace queue, driven through
`services.app.commands.App` against the real event store (a real nats-server started for the
test; the broker is never mocked).

Hypothesis' stateful tests are synchronous, so every step runs its coroutine on one event
loop kept in a thread for the whole test. Each example uses a fresh organization. After
every step the model and the store must agree: each run's status, each workspace's queue,
active run and lock; at most one active run per workspace. At the end of each example the
organization's whole event history is replayed (`history.replay`): FIFO admission and one
active run at every instant."""

from __future__ import annotations

import asyncio
import itertools
import tempfile
from collections import Counter
from collections.abc import Awaitable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from events import run as R
from events.errors import DomainError, Forbidden, IllegalTransition, StaleLease
from infra import streams
from infra.ids import new_id
from infra.natsserver import EmbeddedNats
from tests.bootstrap_support import built
from tests.reliability.history import replay
from tests.reliability.support import ThreadLoop

T = TypeVar("T")
S = R.Status
WORKSPACES = ("net", "db")
USERS = ("alice", "bob")


class Broker(ThreadLoop):
    """A nats-server, a connection and an App, owned by an event loop in a thread."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.TemporaryDirectory()
        self.server = EmbeddedNats(Path(self.dir.name))
        self.run(self.server.__aenter__())
        self.nc = self.run(self.server.connect())
        self.run(streams.declare(self.nc, self.nc.jetstream()))
        # the api's graph, as the composition root builds it (nothing in it is started)
        self.app = built(self.nc, AsyncExitStack(), Path(self.dir.name)).app
        self.steps = 0
        self.examples = 0
        self.ended: Counter[str] = Counter()

    def close(self) -> None:
        self.run(self.nc.close())
        self.run(self.server.__aexit__(None, None, None))
        super().close()
        self.dir.cleanup()


@dataclass
class Run:
    id: str
    ws: str
    type: str
    status: S = S.PENDING
    lease: str = ""
    stop_requested: bool = False


@dataclass
class Ws:
    queue: list[str] = field(default_factory=list)
    active: str = ""
    holder: str = ""  # the lock's holder; "" when unlocked


async def _awaited(step: Awaitable[T]) -> T:
    """`step` as a coroutine, which the loop's thread runs: App's commands are typed as
    returning an Awaitable (the tracing.command decorator)."""
    return await step


_orgs = itertools.count()
broker: Broker | None = None  # set by the test around run_state_machine_as_test


class RunLifecycle(RuleBasedStateMachine):
    """The model: runs with their status and lease, workspaces with queue, active, lock."""

    runs = Bundle("runs")

    def __init__(self) -> None:
        super().__init__()
        assert broker is not None
        self.b = broker
        self.app = broker.app
        self.org = f"st{next(_orgs)}"
        self.model: dict[str, Run] = {}
        self.ws: dict[str, Ws] = {w: Ws() for w in WORKSPACES}
        self.b.examples += 1

    # ------------------------------------------------------------ helpers

    def call(self, step: Awaitable[T]) -> T:
        self.b.steps += 1
        return self.b.run(_awaited(step))

    def command(self, run: Run, cmd: R.RunCommand, refused: type[DomainError] | None) -> None:
        """Send `cmd`; it must pass when `refused` is None, else raise exactly that."""
        coro = self.app.run_command(self.org, run.ws, run.id, cmd)
        if refused is None:
            self.call(coro)
            return
        with pytest.raises(DomainError) as e:
            self.call(coro)
        assert type(e.value) is refused, f"{cmd!r} on {run.status}: {e.value!r}"

    def end(self, run: Run, status: S) -> None:
        """The run reached a terminal status: it leaves the queue or frees the workspace."""
        run.status, run.lease = status, ""
        ws = self.ws[run.ws]
        if run.id in ws.queue:
            ws.queue.remove(run.id)
        if ws.active == run.id:
            ws.active = ""

    # ------------------------------------------------------------ rules

    @initialize()
    def setup(self) -> None:
        self.call(self.app.create_org(self.org, "admin"))
        for w in WORKSPACES:
            self.call(self.app.create_workspace(self.org, w, R.Workspace(repository="/r"), "a"))

    @rule(target=runs, ws=st.sampled_from(WORKSPACES), run_type=st.sampled_from(("apply", "plan")))
    def create_run(self, ws: str, run_type: str) -> Run:
        r = self.call(self.app.create_run(self.org, ws, run_type, "alice"))
        run = Run(id=r.state.run_id, ws=ws, type=run_type)
        self.model[run.id] = run
        self.ws[ws].queue.append(run.id)
        return run

    @rule(ws=st.sampled_from(WORKSPACES))
    def admit_next(self, ws: str) -> None:
        w = self.ws[ws]
        expected = "" if w.active or w.holder or not w.queue else w.queue[0]
        assert self.call(self.app.admit_next(self.org, ws)) == expected
        if expected:
            w.queue.pop(0)
            w.active = expected
            self.model[expected].status = S.QUEUED

    def _claim(self, run: Run, phase: str, waiting: S, running: S) -> None:
        lease = new_id()
        cmd = R.ClaimPhase(actor="ex", phase=phase, lease_id=lease, executor_id="ex")
        if run.status == waiting:
            self.command(run, cmd, None)
            run.status, run.lease = running, lease
        else:
            self.command(run, cmd, IllegalTransition)

    @rule(run=runs)
    def claim_plan(self, run: Run) -> None:
        self._claim(run, "plan", S.QUEUED, S.PLANNING)

    @rule(run=runs, has_changes=st.booleans(), stale=st.booleans())
    def finish_plan(self, run: Run, has_changes: bool, stale: bool) -> None:
        lease = new_id() if stale or not run.lease else run.lease
        cmd = R.FinishPlan(
            actor="ex",
            lease_id=lease,
            commit="c",
            has_changes=has_changes,
            summary=R.PlanSummary(add=int(has_changes)),
        )
        if lease != run.lease:
            self.command(run, cmd, StaleLease)  # fenced: not the run's current lease
        elif run.status != S.PLANNING:
            self.command(run, cmd, IllegalTransition)  # the apply's lease
        else:
            self.command(run, cmd, None)
            run.lease = ""
            if not has_changes:
                self.end(run, S.NO_CHANGES)
            elif run.type == "plan":
                self.end(run, S.PLANNED)
            else:
                run.status = S.AWAITING_APPROVAL

    @rule(run=runs)
    def approve(self, run: Run) -> None:
        if run.status == S.AWAITING_APPROVAL:
            self.command(run, R.ApproveRun(actor="bob"), None)
            run.status = S.APPLY_QUEUED
        else:
            self.command(run, R.ApproveRun(actor="bob"), IllegalTransition)

    @rule(run=runs)
    def discard(self, run: Run) -> None:
        if run.status == S.AWAITING_APPROVAL:
            self.command(run, R.DiscardRun(actor="bob"), None)
            self.end(run, S.DISCARDED)
        else:
            self.command(run, R.DiscardRun(actor="bob"), IllegalTransition)

    @rule(run=runs)
    def claim_apply(self, run: Run) -> None:
        self._claim(run, "apply", S.APPLY_QUEUED, S.APPLYING)

    @rule(run=runs, stale=st.booleans())
    def finish_apply(self, run: Run, stale: bool) -> None:
        lease = new_id() if stale or not run.lease else run.lease
        cmd = R.FinishApply(actor="ex", lease_id=lease, summary=R.PlanSummary(add=1))
        if lease != run.lease:
            self.command(run, cmd, StaleLease)
        elif run.status != S.APPLYING:
            self.command(run, cmd, IllegalTransition)
        else:
            self.command(run, cmd, None)
            self.end(run, S.APPLIED)

    @rule(run=runs)
    def cancel(self, run: Run) -> None:
        cmd = R.CancelRun(actor="alice")
        if run.status in R.CANCELABLE:
            self.command(run, cmd, None)
            self.end(run, S.CANCELED)
        elif run.status == S.PLANNING:
            self.command(run, cmd, None)  # a stop request, once; the run carries on
            run.stop_requested = True
        else:
            self.command(run, cmd, IllegalTransition)

    @rule(run=runs, stale=st.booleans())
    def executor_stops(self, run: Run, stale: bool) -> None:
        """The executor reports that it stopped the phase it was asked to stop."""
        lease = new_id() if stale or not run.lease else run.lease
        cmd = R.CancelRun(actor="ex", lease_id=lease)
        if lease != run.lease:
            self.command(run, cmd, StaleLease)
        elif run.status != S.PLANNING or not run.stop_requested:
            self.command(run, cmd, IllegalTransition)
        else:
            self.command(run, cmd, None)
            self.end(run, S.CANCELED)

    @rule(run=runs, with_lease=st.booleans())
    def fail(self, run: Run, with_lease: bool) -> None:
        lease = run.lease if with_lease else ""
        cmd = R.FailRun(actor="ex", reason="plan_failed", lease_id=lease)
        if run.status in R.TERMINAL:
            self.command(run, cmd, StaleLease if lease else IllegalTransition)
        else:
            self.command(run, cmd, None)
            self.end(run, S.FAILED)

    @rule(ws=st.sampled_from(WORKSPACES), who=st.sampled_from(USERS))
    def lock(self, ws: str, who: str) -> None:
        w = self.ws[ws]
        coro = self.app.lock_workspace(self.org, ws, "maintenance", who)
        if w.holder:
            with pytest.raises(IllegalTransition):
                self.call(coro)
        else:
            self.call(coro)
            w.holder = who

    @rule(ws=st.sampled_from(WORKSPACES), who=st.sampled_from(USERS), admin=st.booleans())
    def unlock(self, ws: str, who: str, admin: bool) -> None:
        w = self.ws[ws]
        coro = self.app.unlock_workspace(self.org, ws, who, admin=admin)
        if not w.holder:
            with pytest.raises(IllegalTransition):
                self.call(coro)
        elif who != w.holder and not admin:
            with pytest.raises(Forbidden):
                self.call(coro)
        else:
            self.call(coro)
            w.holder = ""

    @precondition(lambda self: any(r.status not in R.TERMINAL for r in self.model.values()))
    @rule(data=st.data())
    def progress(self, data: st.DataObject) -> None:
        """Take an open run one legal step on (the rules above mostly try illegal ones)."""
        open_ = [r for r in self.model.values() if r.status not in R.TERMINAL]
        run = data.draw(st.sampled_from(open_))
        match run.status:
            case S.PENDING:
                self.admit_next(run.ws)
            case S.QUEUED:
                self.claim_plan(run)
            case S.PLANNING:
                self.finish_plan(run, data.draw(st.booleans()), stale=False)
            case S.AWAITING_APPROVAL:
                (self.approve if data.draw(st.booleans()) else self.discard)(run)
            case S.APPLY_QUEUED:
                self.claim_apply(run)
            case S.APPLYING:
                self.finish_apply(run, stale=False)

    # Weigh legal progress above the rest: hypothesis picks among rules uniformly.
    progress_2 = progress
    progress_3 = progress
    progress_4 = progress

    @rule(run=consumes(runs))
    def forget(self, run: Run) -> None:
        """Stop picking a run (keeps the bundle small); it is still checked."""

    # ------------------------------------------------------------ invariants

    @invariant()
    def store_matches_model(self) -> None:
        if not self.model and not any(w.holder for w in self.ws.values()):
            return

        async def load() -> tuple[list[Any], list[Any]]:
            runs = await asyncio.gather(
                *(self.app.load_run(self.org, r.ws, r.id) for r in self.model.values())
            )
            wss = await asyncio.gather(*(self.app.load_ws(self.org, w) for w in WORKSPACES))
            return [x.state for x in runs], [x.state for x in wss]

        runs, wss = self.call(load())
        for run, state in zip(self.model.values(), runs, strict=True):
            assert state.status == run.status, f"{run.id}: store {state.status}, model {run}"
            assert state.lease_id == run.lease
            assert bool(state.stop_requested_by) == run.stop_requested
        for name, state in zip(WORKSPACES, wss, strict=True):
            w = self.ws[name]
            assert list(state.queue) == w.queue, name
            assert state.active == w.active, name
            assert (state.lock.holder if state.lock else "") == w.holder, name
            holding = [
                r.id
                for r in self.model.values()
                if r.ws == name and r.status not in R.TERMINAL and r.status != S.PENDING
            ]
            assert holding == ([w.active] if w.active else []), f"{name}: {holding}"

    def teardown(self) -> None:
        envs = self.call(self.app.store.read("rp.>"))
        mine = [e for e in envs if e.subject.split(".")[2] == self.org]
        seen = replay(mine)
        for run in self.model.values():
            assert seen.status[run.id] == run.status
            self.b.ended[str(run.status)] += 1


def _run_machine(max_examples: int, steps: int) -> None:
    global broker
    broker = Broker()
    try:
        run_state_machine_as_test(
            RunLifecycle,
            settings=settings(
                max_examples=max_examples,
                stateful_step_count=steps,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
                database=None,
            ),
        )
        print(
            f"{broker.examples} examples, {broker.steps} commands against the store; "
            f"final statuses {dict(broker.ended)}"
        )
    finally:
        broker.close()
        broker = None


def test_run_lifecycle_state_machine() -> None:
    """CI size: a few examples of a few dozen steps."""
    _run_machine(max_examples=50, steps=50)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_run_lifecycle_state_machine_at_length() -> None:
    _run_machine(max_examples=300, steps=80)
