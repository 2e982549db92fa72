"""The apply of a plan that needs no approval follows it on the executor that planned, at
once (issue 26, the overhead over Terraform by hand): the executor claims it as its plan
ends, without waiting for the scheduler to see `run.plan_finished`, dispatch the apply
and for its own intake to read the pool's queue.

Real nats-server, real Terraform, a real executor; no scheduler: the tests dispatch what
the scheduler would (tests/executor_support.py `Harness`), so an apply that nobody
dispatches runs only if its planner claimed it. On main it never did: the first test
times out there with the run `apply_queued`."""

from __future__ import annotations

from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from events import run as R
from executor import Executor
from tests import bootstrap_support
from tests.bootstrap_support import Process, System, pinned_by
from tests.executor_support import MAIN_TF, Harness, commit, dispatches_left
from tests.helpers import eventually

pytestmark = pytest.mark.terraform


async def _snapshot(run: R.RunState) -> R.Snapshot:
    """The admission snapshot (the branch's head: no commit pinned)."""
    return R.Snapshot()


async def _started(h: Harness, ws: str, org: str = "acme") -> str:
    """A run created, admitted, pinned and its plan dispatched; its workspace's runs
    apply without an approval."""
    await h.app.set_workspace_settings(org, ws, {"require_approval": False}, "alice")
    run_id = str((await h.app.create_run(org, ws, "apply", "alice")).state.run_id)
    assert await h.app.admit_next(org, ws) == run_id
    assert await h.app.pin_run(org, ws, run_id)
    await h.dispatch(ws, run_id, "plan", org)
    return run_id


async def _reaches(h: Harness, ws: str, run_id: str, *status: str, org: str = "acme") -> None:
    async def probe() -> bool:
        state = await h.run(ws, run_id, org)
        assert str(state.status) in status, f"{state.status} {state.error_message}"
        return True

    await eventually(probe, timeout=60, what=f"run {run_id} {status}")


def _claims(events: list[object], phase: str) -> list[R.PhaseStarted]:
    return [e for e in events if isinstance(e, R.PhaseStarted) and e.phase == phase]


async def test_the_apply_follows_its_plan_on_the_planner_without_a_dispatch(
    nc: NATS, process: Process, repo: Path, executor: Executor
) -> None:
    """Nobody dispatches the apply, yet the run is applied, warm, by the executor that
    planned; the dispatch the scheduler then publishes finds the apply claimed and is
    dropped: the apply ran once."""
    h = Harness(nc, process(pinning=pinned_by(_snapshot)).app)
    commit(repo, MAIN_TF)
    await h.workspace("net", R.Workspace(repository=str(repo)))
    run_id = await _started(h, "net")

    await _reaches(h, "net", run_id, "applied")
    applied = await h.run("net", run_id)
    assert applied.apply_summary is not None and applied.apply_summary.add == 1
    events = await h.events("net", run_id)
    [claim] = _claims(events, "apply")
    assert claim.executor_id == executor.executor_id
    steps = [
        e.step for e in events if isinstance(e, R.StepFinished) and e.lease_id == claim.lease_id
    ]
    assert steps == ["warm", "apply"]

    await h.dispatch("net", run_id, "apply")  # what the scheduler publishes meanwhile

    async def consumed() -> bool:
        return await dispatches_left(nc.jetstream()) == 0

    await eventually(consumed, what="the apply's dispatch dropped")
    assert len(_claims(await h.events("net", run_id), "apply")) == 1
    assert str((await h.run("net", run_id)).status) == "applied"


async def test_another_organizations_waiting_phase_goes_before_the_apply(
    nc: NATS, process: Process, system: System, repo: Path, tmp_path: Path
) -> None:
    """With another organization's plan waiting in the pool as its plan ends, the planner
    does not claim the apply at once: the other's plan takes its turn (executor/turns.py)
    and the apply waits for its dispatch, as before."""
    h = Harness(nc, process(pinning=pinned_by(_snapshot)).app)
    commit(repo, MAIN_TF)
    await h.workspace("net", R.Workspace(repository=str(repo)))
    await h.workspace("net", R.Workspace(repository=str(repo)), org="beta")
    one = bootstrap_support.executor(system, work_dir=tmp_path / "one", executor_id="one")
    async with one:
        first = await _started(h, "net")

        async def planning() -> bool:
            return str((await h.run("net", first)).status) == "planning"

        await eventually(planning, what="the first plan claimed")
        other = await _started(h, "net", org="beta")  # waits: the executor has one slot

        await _reaches(h, "net", other, "applying", "applied", org="beta")
        # the first run's apply was not taken before the other organization's plan
        first_state = await h.run("net", first)
        assert str(first_state.status) == "apply_queued", first_state.status
        await h.dispatch("net", first, "apply")
        await h.reaches("net", first, "applied")
        await h.reaches("net", other, "applied", org="beta")
