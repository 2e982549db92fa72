"""Driving the projection's tests. Without I/O: `Stream` folds events into one working set,
`decide_all` and `random_history` make a run's events through the core. Live: the write
side driven through the App like production (`setup_org`, `new_run`, `plan`, `apply`,
`varied_history`: every terminal outcome) and `settle`, which waits for the projector.
Holds no tests itself."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from itertools import count

from hypothesis import strategies as st

from events import run as run_agg
from events.codec import AnyEvent, encode, run_subject
from events.errors import DomainError
from events.run import (
    AdmitRun,
    ApproveRun,
    CancelRun,
    ClaimPhase,
    CreateRun,
    DiscardRun,
    FailRun,
    FinishApply,
    FinishPlan,
    FinishStep,
    PlanSummary,
    RunCommand,
    StartStep,
    Workspace,
)
from infra.eventstore import EventStore
from projections import Projector
from projections.project import finish, project_event
from projections.working import Working, meta_of
from services.app.commands import App
from services.app.execute import Result

# ---------------------------------------------------------------- folds, without I/O

T0 = datetime(2025, 1, 1, tzinfo=UTC)
CONFIG = Workspace(repository="/repo")


class Stream:
    """Folds events into one working set, numbering them like a stream."""

    def __init__(self) -> None:
        self.w = Working()
        self.seq = count(1)

    def add(self, subject: str, *events: AnyEvent) -> None:
        for event in events:
            seq = next(self.seq)
            meta = meta_of(seq, subject, seq * 1_000_000)
            project_event(self.w, meta, event, encode(event))
        finish(self.w)

    def run(self, run_id: str) -> dict[str, object]:
        row = self.w.get("runs", (run_id,))
        assert row is not None
        return row


def decide_all(commands: list[RunCommand], start: int = 0) -> list[run_agg.RunEvent]:
    """Run commands through the core in order, dropping the ones it refuses; the first at
    `start` seconds after T0, the next a second later, and so on."""
    state, events, ticks = run_agg.INITIAL, [], count(start)
    for command in commands:
        now = T0 + timedelta(seconds=next(ticks))
        try:
            new = run_agg.decide(state, command, now=now, new_id=lambda: "id")
        except DomainError:
            continue
        state = run_agg.fold(new, state)
        events.extend(new)
    return events


CREATE = CreateRun(
    actor="alice", run_id="r1", org="acme", workspace="net", run_type="apply", config=CONFIG
)
SUBJECT = run_subject("acme", "net", "r1")


def _next_command(data: st.DataObject, state: run_agg.RunState, n: int) -> RunCommand:
    """A command that is plausible for the state (current lease, waiting phase), or noise."""
    noise = data.draw(st.integers(0, 9)) == 0  # now and then: a stale lease or an ending
    lease = "stale" if noise else state.lease_id or "l0"
    phase = state.waiting_phase or "plan"
    step = data.draw(st.sampled_from(["checkout", "init", "plan"]))
    summary = PlanSummary(add=data.draw(st.integers(0, 3)))
    flag = data.draw(st.booleans())
    options: list[RunCommand] = [
        AdmitRun(actor="s"),
        ClaimPhase(actor="x", phase=phase, lease_id=f"l{n}", executor_id=f"x{n}"),
        StartStep(actor="x", lease_id=lease, step=step),
        FinishStep(actor="x", lease_id=lease, step=step, ok=flag, started_at=T0),
        FinishPlan(
            actor="x",
            lease_id=lease,
            commit="c0",
            has_changes=flag or summary.add > 0,
            summary=summary,
            require_approval=data.draw(st.booleans()),
        ),
        FinishApply(actor="x", lease_id=lease, summary=summary),
        ApproveRun(actor="bob", acknowledged=["warning"] if flag else []),
    ]
    endings: list[RunCommand] = [
        DiscardRun(actor="bob"),
        CancelRun(actor="bob"),
        FailRun(actor="x", reason="boom", message="m", lease_id=state.lease_id if flag else ""),
    ]
    return data.draw(st.sampled_from(endings if noise else options))


def decide_next(events: list[run_agg.RunEvent], command: RunCommand) -> list[run_agg.RunEvent]:
    """The events one more command adds after `events`, or none if the core refuses it."""
    now = T0 + timedelta(seconds=len(events))
    try:
        return run_agg.decide(run_agg.fold(events), command, now=now, new_id=lambda: "id")
    except DomainError:
        return []


def random_history(run_type: str, length: int, data: st.DataObject) -> list[run_agg.RunEvent]:
    create = CreateRun(
        actor="alice", run_id="r1", org="acme", workspace="net", run_type=run_type, config=CONFIG
    )
    events = decide_all([create])
    for n in range(length):
        events += decide_next(events, _next_command(data, run_agg.fold(events), n))
    return events


# ---------------------------------------------------------------- driving the write side

ORG = "acme"
EXECUTOR = "exec-1"


async def cmd(app: App, ws: str, run_id: str, command: RunCommand) -> Result:
    return await app.run_command(ORG, ws, run_id, command)


async def new_run(app: App, ws: str, run_type: str = "apply", message: str = "") -> str:
    result = await app.create_run(ORG, ws, run_type, "alice", message=message)
    return str(result.state.run_id)


async def run_phase(app: App, ws: str, run_id: str, phase: str, *, fail_step: str = "") -> str:
    """Claim the phase and run its steps like an executor; stop at `fail_step`. The lease."""
    lease = f"{run_id}-{phase}"
    await cmd(
        app,
        ws,
        run_id,
        ClaimPhase(actor=EXECUTOR, phase=phase, lease_id=lease, executor_id=EXECUTOR),
    )
    for step in ("checkout", "init", phase):
        started = datetime.now(UTC)
        await cmd(app, ws, run_id, StartStep(actor=EXECUTOR, lease_id=lease, step=step))
        ok = step != fail_step
        finish = FinishStep(
            actor=EXECUTOR,
            lease_id=lease,
            step=step,
            ok=ok,
            started_at=started,
            log_object=f"{run_id}/{step}.log",
            error="" if ok else f"{step} broke",
        )
        await cmd(app, ws, run_id, finish)
        if not ok:
            break
    return lease


async def plan(
    app: App, ws: str, run_id: str, *, changes: bool = True, approval: bool = True
) -> Result:
    lease = await run_phase(app, ws, run_id, "plan")
    summary = PlanSummary(add=2, change=1, destroy=0) if changes else PlanSummary()
    return await cmd(
        app,
        ws,
        run_id,
        FinishPlan(
            actor=EXECUTOR,
            lease_id=lease,
            commit="abc123",
            has_changes=changes,
            summary=summary,
            plan_digest="sha256:feed",
            require_approval=approval,
        ),
    )


async def apply(app: App, ws: str, run_id: str) -> Result:
    lease = await run_phase(app, ws, run_id, "apply")
    return await cmd(
        app,
        ws,
        run_id,
        FinishApply(
            actor=EXECUTOR, lease_id=lease, summary=PlanSummary(add=2, change=1, destroy=0)
        ),
    )


async def setup_org(app: App, *workspaces: str) -> str:
    """An organization with a token for alice and the given workspaces; the clear token."""
    await app.create_org(ORG, "admin")
    token, _ = await app.issue_token(ORG, "alice", "admin", "admin")
    for ws in workspaces:
        config = Workspace(repository="/repo", variables={"region": "eu", "env": ws})
        await app.create_workspace(ORG, ws, config, "alice")
    return token


async def varied_history(app: App) -> dict[str, str]:
    """Every terminal outcome, plus runs left waiting. Run ids by the status they reach."""
    await setup_org(app, "net", "app")
    runs: dict[str, str] = {}
    runs["applied"] = await new_run(app, "net", message="bump vpc")
    runs["no_changes"] = await new_run(app, "net", "plan")  # queued behind the first
    await app.admit_next(ORG, "net")
    await plan(app, "net", runs["applied"])
    await cmd(app, "net", runs["applied"], ApproveRun(actor="bob", acknowledged=["destroys"]))
    await apply(app, "net", runs["applied"])
    await app.admit_next(ORG, "net")
    await plan(app, "net", runs["no_changes"], changes=False)
    runs["discarded"] = await new_run(app, "net")
    runs["canceled"] = await new_run(app, "net")
    await app.admit_next(ORG, "net")
    await plan(app, "net", runs["discarded"])
    await cmd(app, "net", runs["canceled"], CancelRun(actor="alice"))
    await cmd(app, "net", runs["discarded"], DiscardRun(actor="bob", reason="not today"))
    runs["awaiting_approval"] = await new_run(app, "net")
    runs["pending"] = await new_run(app, "net", "destroy")
    await app.admit_next(ORG, "net")
    await plan(app, "net", runs["awaiting_approval"])

    runs["failed_step"] = await new_run(app, "app")
    await app.admit_next(ORG, "app")
    lease = await run_phase(app, "app", runs["failed_step"], "plan", fail_step="init")
    await cmd(
        app,
        "app",
        runs["failed_step"],
        FailRun(actor=EXECUTOR, reason="init_failed", message="init broke", lease_id=lease),
    )
    runs["failed_reaped"] = await new_run(app, "app", "plan")
    await app.admit_next(ORG, "app")
    await run_phase(app, "app", runs["failed_reaped"], "plan")  # then the executor vanishes
    await cmd(
        app, "app", runs["failed_reaped"], FailRun(actor="reaper", reason="executor_unavailable")
    )
    runs["unattended_apply"] = await new_run(app, "app")
    await app.admit_next(ORG, "app")
    await plan(app, "app", runs["unattended_apply"], approval=False)
    await apply(app, "app", runs["unattended_apply"])
    for kind in ("planned", "drifted"):
        runs[kind] = await new_run(app, "app", "plan" if kind == "planned" else "drift")
        await app.admit_next(ORG, "app")
        await plan(app, "app", runs[kind])
    runs["queued"] = await new_run(app, "app")
    await app.admit_next(ORG, "app")
    return runs


async def settle(p: Projector, store: EventStore) -> None:
    """Wait until the projector has everything the stream has now."""
    assert await p.wait_for(await store.last_seq(), timeout=10)
