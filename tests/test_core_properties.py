"""Properties of the pure core that must hold for every sequence of commands:

- the run lifecycle only moves along the transitions of the ARCHITECTURE status table
  (written out again here, independently of `events/run.py`), terminal statuses never
  change, executor reports are fenced, and `decide` raises nothing but DomainErrors;
- the workspace queue keeps at most one active run, admits strictly FIFO, and its queue is
  always the enqueue order minus the runs admitted or released.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from events import run
from events import workspace as ws
from events.errors import DomainError, Invalid
from events.run import (
    AdmitRun,
    ApplyFinished,
    ApproveRun,
    CancelRun,
    ClaimPhase,
    CreateRun,
    DiscardRun,
    FailRun,
    FinishApply,
    FinishPlan,
    FinishStep,
    PlanFinished,
    PlanSummary,
    RunFailed,
    RunState,
    RunStopRequested,
    StartStep,
    StepFinished,
    StepStarted,
)
from tests.gwt import NOW, Ids

FAST = settings(max_examples=500, deadline=None, database=None)

# ------------------------------------------------- the lifecycle, as the ARCHITECTURE table says

TERMINAL = {"applied", "planned", "no_changes", "drifted", "discarded", "failed", "canceled"}
_BEFORE_PLAN = {
    (None, "pending"),
    ("pending", "queued"),
    ("pending", "canceled"),
    ("pending", "failed"),
    ("queued", "planning"),
    ("queued", "canceled"),
    ("queued", "failed"),
    ("planning", "no_changes"),
    ("planning", "failed"),
    ("planning", "canceled"),  # stopped: a stop request, then the executor's cancel
}
_APPROVE_AND_APPLY = {
    ("planning", "awaiting_approval"),
    ("planning", "apply_queued"),  # the workspace requires no approval
    ("awaiting_approval", "apply_queued"),
    ("awaiting_approval", "discarded"),
    ("awaiting_approval", "failed"),  # timed out waiting for a person
    ("apply_queued", "applying"),
    ("apply_queued", "canceled"),
    ("apply_queued", "failed"),
    ("applying", "applied"),
    ("applying", "failed"),
}
LEGAL: dict[str, set[tuple[str | None, str]]] = {
    "plan": _BEFORE_PLAN | {("planning", "planned")},
    "drift": _BEFORE_PLAN | {("planning", "drifted")},
    "apply": _BEFORE_PLAN | _APPROVE_AND_APPLY,
    "destroy": _BEFORE_PLAN | _APPROVE_AND_APPLY,
}
# A step report leaves the status alone, and only a running phase has steps.
STEP_STATUSES = {"planning", "applying"}

# ------------------------------------------------- random run commands

CURRENT = "<current lease>"
LEASES = ["lease-a", "lease-b", "lease-c", ""]
SUMMARY = PlanSummary(add=1)


@dataclass(frozen=True)
class Move:
    """One command, built against the state it meets (so `CURRENT` can name its lease)."""

    kind: str
    lease: str = ""
    arg: str = ""
    flag: bool = True
    flag2: bool = True

    def command(self, state: RunState) -> Any:
        lease = state.lease_id if self.lease == CURRENT else self.lease
        match self.kind:
            case "create":
                return CreateRun(
                    actor="alice",
                    run_id="run-1",
                    org="acme",
                    workspace="network",
                    run_type=self.arg,
                    config=run.Workspace(repository="r"),
                )
            case "admit":
                return AdmitRun(actor="scheduler")
            case "claim":
                return ClaimPhase(actor="exec", phase=self.arg, lease_id=lease, executor_id="exec")
            case "start_step":
                return StartStep(actor="exec", lease_id=lease, step="init")
            case "finish_step":
                return FinishStep(
                    actor="exec", lease_id=lease, step="init", ok=self.flag, started_at=NOW
                )
            case "finish_plan":
                return FinishPlan(
                    actor="exec",
                    lease_id=lease,
                    commit="c0ffee",
                    has_changes=self.flag,
                    summary=SUMMARY,
                    require_approval=self.flag2,
                )
            case "finish_apply":
                return FinishApply(actor="exec", lease_id=lease, summary=SUMMARY)
            case "approve":
                return ApproveRun(actor="bob")
            case "discard":
                return DiscardRun(actor="bob")
            case "cancel":  # with a lease: the executor's report that it stopped a phase
                return CancelRun(actor="alice", lease_id=lease)
            case "fail":
                return FailRun(actor="exec", reason="boom", lease_id=lease)
            case "next":
                return self.next_command(state)
        raise AssertionError(self.kind)

    def next_command(self, state: RunState) -> Any:
        """The lifecycle's natural next command, so random walks also reach deep statuses."""
        fresh = f"lease-{state.version}"
        by_status: dict[str | None, Move] = {
            None: Move("create", arg="apply"),
            "pending": Move("admit"),
            "queued": Move("claim", lease=fresh, arg="plan"),
            "planning": Move("finish_plan", lease=CURRENT, flag=self.flag, flag2=self.flag2),
            "awaiting_approval": Move("approve" if self.flag else "discard"),
            "apply_queued": Move("claim", lease=fresh, arg="apply"),
            "applying": Move("finish_apply", lease=CURRENT),
        }
        return by_status.get(state.status, Move("admit")).command(state)


KINDS = [
    "create",
    "admit",
    "claim",
    "start_step",
    "finish_step",
    "finish_plan",
    "finish_apply",
    "approve",
    "discard",
    "cancel",
    "fail",
]
ARGS = ["plan", "apply", "destroy", "drift", "bogus"]  # a run type to create, a phase to claim
leases = st.sampled_from([CURRENT, CURRENT, *LEASES])
flags = st.booleans()
next_move = st.builds(Move, st.just("next"), flag=flags, flag2=flags)
any_move = st.builds(
    Move, st.sampled_from(KINDS), lease=leases, arg=st.sampled_from(ARGS), flag=flags, flag2=flags
)
# A walk along the lifecycle to a random depth, then anything at all (half of it the walk's
# next step), so every status meets every kind of command, current leases and stale ones.
# The exhaustive test below covers every single command in every state; this one covers
# long random sequences.
mostly = st.sampled_from([True, True, True, False])  # keep walking: changes, approve
walk_move = st.builds(Move, st.just("next"), flag=mostly, flag2=flags)
runs = st.tuples(
    st.sampled_from(run.RUN_TYPES),
    st.integers(0, 7).flatmap(lambda n: st.lists(walk_move, min_size=n, max_size=n)),
    # the walk is followed by at least one arbitrary command, then by anything
    st.builds(
        lambda first, tail: [first, *tail],
        any_move,
        st.lists(st.one_of(next_move, any_move), max_size=20),
    ),
)


def check_event(before: RunState, event: Any, after: RunState) -> None:
    """One event moved `before` to `after`: it must be a legal step of the lifecycle."""
    assert before.status not in TERMINAL, f"{type(event).__name__} after terminal {before.status}"
    assert after.version == before.version + 1
    if isinstance(event, StepStarted | StepFinished | RunStopRequested):
        assert before.status in STEP_STATUSES
        assert after.status == before.status
    else:
        move = (None if before.status is None else str(before.status), str(after.status))
        assert move in LEGAL[after.run_type], f"{after.run_type}: {move} is not a legal transition"
    # fencing: an executor's report carries the lease that was current when it was decided
    reported = isinstance(event, StepStarted | StepFinished | PlanFinished | ApplyFinished)
    if reported or (isinstance(event, RunFailed) and event.lease_id):
        assert event.lease_id, f"{type(event).__name__} without a lease"
        assert event.lease_id == before.lease_id, f"{type(event).__name__} under a stale lease"


def step(state: RunState, move: Move, now: datetime) -> list[RunState]:
    """Decide one move and evolve its events, checking each; return the states passed."""
    try:
        events = run.decide(state, move.command(state), now=now, new_id=Ids())
    except DomainError:
        return []  # refused: nothing happens, which is always legal
    seen = []
    for event in events:
        after = run.evolve(state, event)
        check_event(state, event, after)
        state = after
        seen.append(state)
    return seen


def play(run_type: str, walk: list[Move], moves: list[Move]) -> list[RunState]:
    """Create a run of `run_type`, then play every move; check every step."""
    state, seen = run.INITIAL, []
    for i, move in enumerate([Move("create", arg=run_type), *walk, *moves]):
        passed = step(state, move, NOW + timedelta(seconds=i))
        seen += passed
        state = passed[-1] if passed else state
    return seen


@FAST
@given(runs)
def test_random_run_commands_only_move_along_legal_transitions_and_terminal_is_final(
    case: tuple[str, list[Move], list[Move]],
) -> None:
    """Any non-DomainError escaping decide or evolve fails this test, too."""
    play(*case)


@pytest.mark.parametrize("end", sorted(TERMINAL))
def test_the_random_run_commands_can_reach_every_terminal_status(end: str) -> None:
    """Guards the property above against a generator that never gets anywhere."""
    find(
        runs,
        lambda case: any(s.status == end for s in play(*case)),
        settings=settings(
            max_examples=1_000,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.generate],  # finding one is enough: no need to shrink it
        ),
    )


def every_move() -> list[Move]:
    """Each kind of command with every variation that can matter to the run aggregate."""
    out = [Move("create", arg=a) for a in ARGS]
    out += [Move("claim", lease=lease, arg=a) for lease in [CURRENT, *LEASES] for a in ARGS]
    for kind in ["start_step", "finish_step", "finish_plan", "finish_apply", "fail"]:
        for lease in [CURRENT, *LEASES]:
            out += [
                Move(kind, lease=lease, flag=f, flag2=g)
                for f in (True, False)
                for g in (True, False)
            ]
    out += [Move(kind) for kind in ["admit", "approve", "discard"]]
    out += [Move("cancel", lease=lease) for lease in [CURRENT, *LEASES]]
    return out


def test_every_command_in_every_reachable_state_takes_exactly_the_architecture_transitions() -> (
    None
):
    """Exhaustive: explore every state the run aggregate can reach (by run type, status and
    lease) with every command; every step is checked as in the property above, and the
    transitions taken are exactly the legal ones, none missing."""
    key = lambda s: (s.run_type, s.status, s.lease_id, s.phase, s.stop_requested_by)  # noqa: E731  # a short key
    frontier, known = [run.INITIAL], {key(run.INITIAL)}
    taken: dict[str, set[tuple[str | None, str]]] = {t: set() for t in run.RUN_TYPES}
    while frontier:
        state = frontier.pop()
        for move in every_move():
            before = state
            for after in step(state, move, NOW):
                if after.status != before.status:
                    prev = None if before.status is None else str(before.status)
                    taken[after.run_type].add((prev, str(after.status)))
                if key(after) not in known:
                    known.add(key(after))
                    frontier.append(after)
                before = after
    assert taken == LEGAL


# ------------------------------------------------- the workspace queue against a model

CREATED = ws.WorkspaceCreated(
    at=NOW, actor="alice", org="acme", name="network", config=run.Workspace(repository="r")
)
RELEASE_STATUSES = st.sampled_from(sorted(TERMINAL))


class WorkspaceQueueIsFifoWithOneActiveRun(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.state = ws.evolve(ws.INITIAL, CREATED)
        self.enqueue_order: list[str] = []
        self.admitted: list[str] = []
        self.released: set[str] = set()
        self.queue: list[str] = []  # the model: waiting runs, oldest first
        self.active = ""

    def apply(self, command: Any) -> list[Any]:
        events = ws.decide(self.state, command, now=NOW, new_id=Ids())
        for event in events:
            self.state = ws.evolve(self.state, event)
        return events

    @rule()
    def enqueue_a_new_run(self) -> None:
        run_id = f"run-{len(self.enqueue_order)}"
        events = self.apply(ws.EnqueueRun(actor="alice", run_id=run_id))
        assert [e.run_id for e in events] == [run_id]
        self.enqueue_order.append(run_id)
        self.queue.append(run_id)

    @precondition(lambda self: self.queue or self.active)
    @rule(data=st.data())
    def enqueue_a_waiting_or_active_run_again(self, data: st.DataObject) -> None:
        run_id = data.draw(st.sampled_from([*self.queue, *filter(None, [self.active])]))
        with pytest.raises(Invalid):
            self.apply(ws.EnqueueRun(actor="alice", run_id=run_id))

    @rule()
    def admit_next(self) -> None:
        events = self.apply(ws.AdmitNext(actor="scheduler"))
        if self.active or not self.queue:
            assert events == []
            return
        assert [(type(e), e.run_id) for e in events] == [(ws.RunAdmitted, self.queue[0])]
        self.active = self.queue.pop(0)
        self.admitted.append(self.active)

    @precondition(lambda self: self.enqueue_order)
    @rule(data=st.data(), status=RELEASE_STATUSES)
    def release_a_known_run(self, data: st.DataObject, status: str) -> None:
        run_id = data.draw(st.sampled_from(self.enqueue_order))
        events = self.apply(ws.ReleaseRun(actor="scheduler", run_id=run_id, status=status))
        if run_id != self.active and run_id not in self.queue:
            assert events == []  # finished already: nothing to release
            return
        assert [(e.run_id, e.status) for e in events] == [(run_id, status)]
        self.released.add(run_id)
        self.queue = [r for r in self.queue if r != run_id]
        self.active = "" if self.active == run_id else self.active

    @rule()
    def release_a_run_never_enqueued(self) -> None:
        assert self.apply(ws.ReleaseRun(actor="x", run_id="ghost", status="failed")) == []

    @invariant()
    def state_matches_the_model(self) -> None:
        assert self.state.queue == tuple(self.queue)
        assert self.state.active == self.active

    @invariant()
    def at_most_one_run_is_admitted_and_not_yet_released(self) -> None:
        holding = set(self.admitted) - self.released
        assert len(holding) <= 1
        assert holding == ({self.state.active} if self.state.active else set())
        assert self.state.active not in self.state.queue

    @invariant()
    def queue_is_the_enqueue_order_minus_admitted_and_released(self) -> None:
        gone = set(self.admitted) | self.released
        assert list(self.state.queue) == [r for r in self.enqueue_order if r not in gone]

    @invariant()
    def admission_order_is_enqueue_order(self) -> None:
        admitted = set(self.admitted)
        assert self.admitted == [r for r in self.enqueue_order if r in admitted]


TestWorkspaceQueueIsFifoWithOneActiveRun = WorkspaceQueueIsFifoWithOneActiveRun.TestCase
TestWorkspaceQueueIsFifoWithOneActiveRun.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
