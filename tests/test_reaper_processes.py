"""Executors as real `runplane executor` processes, killed, paused and stopped mid-phase.

The scheduler and reaper run in the test's process (their behaviour under test is not
about their own process); nats-server and Terraform are real.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from events import run as R
from executor.worker import default_jobs_dir
from infra.natsserver import EmbeddedNats
from infra.streams import dispatch_subject
from services.app.commands import App
from services.processes.scheduler.reaper import Reaper
from tests.bootstrap_support import System
from tests.executor_support import GATED_PLAN_TF, MAIN_TF, commit, dispatches_left
from tests.helpers import eventually
from tests.procs import Proc, descendants
from tests.reaper_support import (
    KEY,
    ORG,
    count,
    reaches,
    run_events,
    setup_workspace,
    signal_tree,
    state,
)

pytestmark = pytest.mark.terraform

# Each apply appends a line to the marker, then takes long enough to be caught mid-way.
SLOW_APPLY_TF = """
variable "marker" {}
resource "null_resource" "slow" {
  provisioner "local-exec" { command = "echo applied >> ${var.marker} && sleep 30" }
}
"""


# ---------------------------------------------------------------- helpers


@asynccontextmanager
async def executor_proc(nats: EmbeddedNats, tmp: Path, name: str) -> AsyncIterator[Proc]:
    """`runplane executor` on its own data directory; killed (with its children) at exit."""
    args = ["executor", "--nats-url", nats.url, "--data-dir", str(tmp / name)]
    proc = await Proc(args, tmp / f"{name}.log", env={"RUNPLANE_ENCRYPTION_KEY": KEY}).start()
    try:
        await eventually(
            lambda: _says(proc, "runplane executor running"), timeout=30, what=f"{name} ready"
        )
        yield proc
    finally:
        signal_tree(proc, signal.SIGKILL)
        assert proc.proc is not None
        await proc.proc.wait()


async def _says(proc: Proc, text: str) -> bool:
    assert proc.proc is not None
    if proc.proc.returncode is not None and text not in proc.output():
        raise RuntimeError(f"exited {proc.proc.returncode}: {proc.output()[-2000:]}")
    return text in proc.output()


def reading(proc: Proc, path: Path) -> Callable[[], Any]:
    """A probe: has one of the process's descendants `path` open (Terraform at the gate)?"""

    async def probe() -> bool:
        assert proc.proc is not None
        for pid in descendants(proc.proc.pid):
            try:
                fds = list(Path(f"/proc/{pid}/fd").iterdir())
            except OSError:
                continue
            for fd in fds:
                try:
                    if os.readlink(fd) == str(path):
                        return True
                except OSError:
                    continue
        return False

    return probe


async def queue_drained(nc: NATS) -> bool:
    return await dispatches_left(nc.jetstream()) == 0


# ---------------------------------------------------------------- tests


async def test_killed_mid_apply_the_run_fails_the_workspace_frees_and_no_one_reapplies(
    nats_server: EmbeddedNats, nc: NATS, app: App, system: System, repo: Path, tmp_path: Path
) -> None:
    """kill -9 (the executor and its Terraform) mid-apply, heartbeat timeout 3 s: the run
    fails with executor_unavailable, the next run is admitted and planned by the other
    executor, and the apply is never run a second time."""
    marker = tmp_path / "applies"
    commit(repo, SLOW_APPLY_TF)
    await setup_workspace(app, "net", repo, heartbeat_timeout=3, variables={"marker": str(marker)})
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(system.scheduler())
        await stack.enter_async_context(Reaper(nc, app, interval=0.2))
        a = await stack.enter_async_context(executor_proc(nats_server, tmp_path, "exec-a"))
        first = str((await app.create_run(ORG, "net", "apply", "alice")).state.run_id)
        await reaches(app, "net", first, "awaiting_approval", timeout=60)
        second = str((await app.create_run(ORG, "net", "apply", "alice")).state.run_id)
        await app.run_command(ORG, "net", first, R.ApproveRun(actor="bob"))
        await eventually(lambda: _exists(marker), timeout=60, what="the apply's provisioner")
        await stack.enter_async_context(executor_proc(nats_server, tmp_path, "exec-b"))

        signal_tree(a, signal.SIGKILL)
        killed = time.monotonic()
        failed = await reaches(app, "net", first, "failed", timeout=20)
        elapsed = time.monotonic() - killed
        print(f"kill -9 -> failed: {elapsed:.2f}s (heartbeat timeout 3s)")
        await reaches(app, "net", second, "awaiting_approval", timeout=60)
        await eventually(lambda: queue_drained(nc), what="nothing left to hand out")
    assert failed.reason == "executor_unavailable"
    assert "sent no heartbeat" in failed.error_message and "apply" in failed.error_message
    assert 1.5 < elapsed < 6, elapsed
    events = await run_events(app, "net", first)
    assert count(events, R.PhaseStarted, phase="apply") == 1
    assert count(events, R.RunFailed) == 1
    assert marker.read_text().splitlines() == ["applied"], "the apply ran exactly once"
    planned = await state(app, "net", second)
    assert planned.executor_id != (await state(app, "net", first)).executor_id


async def test_an_executor_paused_past_its_timeout_is_fenced_when_it_resumes(
    nats_server: EmbeddedNats, nc: NATS, app: App, system: System, repo: Path, tmp_path: Path
) -> None:
    """SIGSTOP mid-apply for longer than the heartbeat timeout, then SIGCONT: the reaper
    failed the run meanwhile; the resumed executor's reports are refused, it interrupts
    its Terraform and leaves the phase, and goes on to take the next run."""
    marker = tmp_path / "applies"
    commit(repo, SLOW_APPLY_TF)
    await setup_workspace(app, "net", repo, heartbeat_timeout=3, variables={"marker": str(marker)})
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(system.scheduler())
        await stack.enter_async_context(Reaper(nc, app, interval=0.2))
        ex = await stack.enter_async_context(executor_proc(nats_server, tmp_path, "exec"))
        first = str((await app.create_run(ORG, "net", "apply", "alice")).state.run_id)
        await reaches(app, "net", first, "awaiting_approval", timeout=60)
        await app.run_command(ORG, "net", first, R.ApproveRun(actor="bob"))
        await eventually(lambda: _exists(marker), timeout=60, what="the apply's provisioner")

        signal_tree(ex, signal.SIGSTOP)
        paused = time.monotonic()
        failed = await reaches(app, "net", first, "failed", timeout=20)
        print(f"SIGSTOP -> failed: {time.monotonic() - paused:.2f}s (heartbeat timeout 3s)")
        second = str((await app.create_run(ORG, "net", "plan", "alice")).state.run_id)
        resumed = time.monotonic()
        signal_tree(ex, signal.SIGCONT)

        await eventually(lambda: _says(ex, "lease_lost"), timeout=10, what="the lease check")
        jobs = default_jobs_dir(tmp_path / "exec" / "work") / "jobs"
        await eventually(lambda: _only_run(jobs, second), timeout=20, what="the phase left")
        left = time.monotonic() - resumed
        print(f"SIGCONT -> phase left: {left:.2f}s")
        await reaches(app, "net", second, "planned", timeout=60)
    assert left < 15, f"the resumed executor kept at its 30 s apply ({left:.1f}s)"
    events = await run_events(app, "net", first)
    assert events[-1] == failed_event(events), "nothing was recorded after the reaper's failure"
    assert (failed.reason, events[-1].actor) == ("executor_unavailable", "reaper")
    assert count(events, R.ApplyFinished) == 0
    assert "stale-lease" in ex.output() or "not the run's current lease" in ex.output()


def failed_event(events: list[Any]) -> Any:
    [event] = [e for e in events if isinstance(e, R.RunFailed)]
    return event


async def test_sigterm_mid_plan_gives_the_plan_back_cleanly_and_exits_0(
    nats_server: EmbeddedNats, nc: NATS, app: App, system: System, repo: Path, tmp_path: Path
) -> None:
    """`runplane executor` gets SIGTERM while Terraform plans: it drains (interrupts
    Terraform, reports the plan step interrupted and gives the phase back to the pool:
    the run waits `queued` again, its first claim released) and exits 0. (Before the
    drain it failed the run `executor_stopped`: tests/test_drain.py.)"""
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    # Held open for writing, so Terraform's open() returns and its read() waits for data.
    writer = os.open(gate, os.O_RDWR)
    commit(repo, GATED_PLAN_TF)
    await setup_workspace(app, "net", repo, variables={"gate": str(gate)})
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(system.scheduler())
        ex = await stack.enter_async_context(executor_proc(nats_server, tmp_path, "exec"))
        run_id = str((await app.create_run(ORG, "net", "plan", "alice")).state.run_id)
        await eventually(reading(ex, gate), timeout=60, what="Terraform planning, at the gate")

        assert ex.proc is not None
        ex.proc.send_signal(signal.SIGTERM)
        await eventually(lambda: _says(ex, "executor_draining"), what="the drain to begin")
        os.write(writer, b"open")  # the plan may go on, to find it was interrupted
        os.close(writer)
        code = await asyncio.wait_for(ex.proc.wait(), 30)
    assert code == 0, ex.output()[-3000:]
    waiting = await state(app, "net", run_id)
    assert (waiting.status, waiting.released, waiting.lease_id) == (R.Status.QUEUED, 1, "")
    events = await run_events(app, "net", run_id)
    [plan] = [e for e in events if isinstance(e, R.StepFinished)][-1:]
    assert (plan.step, plan.ok, plan.error) == ("plan", False, "interrupted (executor_draining)")
    [released] = [e for e in events if isinstance(e, R.PhaseReleased)]
    assert (released.phase, released.attempt) == ("plan", 1)


@pytest.mark.slow  # ~20 s: the chaos suite races executors too
async def test_two_executors_racing_for_duplicated_dispatches_claim_each_phase_once(
    nats_server: EmbeddedNats, nc: NATS, app: App, system: System, repo: Path, tmp_path: Path
) -> None:
    """Every phase is put in the work queue twice (as a redelivery or a second scheduler
    would) while two executor processes pull: each phase is claimed and run once."""
    commit(repo, MAIN_TF)
    runs = []
    for i in range(8):
        await setup_workspace(app, f"ws{i}", repo)
    async with AsyncExitStack() as stack:
        for name in ("exec-a", "exec-b"):
            await stack.enter_async_context(executor_proc(nats_server, tmp_path, name))
        for i in range(8):
            ws = f"ws{i}"
            run_id = str((await app.create_run(ORG, ws, "plan", "alice")).state.run_id)
            assert await app.admit_next(ORG, ws) == run_id
            for copy in ("a", "b"):
                body = {"org": ORG, "workspace": ws, "run_id": run_id, "phase": "plan"}
                await nc.jetstream().publish(
                    dispatch_subject("default", ORG),
                    json.dumps(body).encode(),
                    headers={"Nats-Msg-Id": f"{run_id}:plan:{copy}"},
                )
            runs.append((ws, run_id))
        for ws, run_id in runs:
            await reaches(app, ws, run_id, "planned", timeout=90)
        await eventually(lambda: queue_drained(nc), what="every copy handled")
    executors = set()
    for ws, run_id in runs:
        events = await run_events(app, ws, run_id)
        assert count(events, R.PhaseStarted) == 1, run_id
        assert count(events, R.StepStarted, step="checkout") == 1, run_id
        executors.add(failed_or_planned_by(events))
    assert len(executors) == 2, f"both executors took work: {executors}"


def failed_or_planned_by(events: list[Any]) -> str:
    [started] = [e for e in events if isinstance(e, R.PhaseStarted)]
    return str(started.executor_id)


async def _exists(path: Path) -> bool:
    return path.exists()


async def _only_run(jobs: Path, allowed: str) -> bool:
    """The executor holds no phase directory but (perhaps) the allowed run's."""
    return all(d.name.startswith(allowed) for d in jobs.iterdir()) if jobs.exists() else True
