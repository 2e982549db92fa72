"""SIGTERM drains an executor: no run lost to an upgrade (issue 26, item 4).

Real `runplane executor` processes over a real nats-server, real Terraform; the api and the
scheduler in-process (tests/plane_support.py). Before the drain, SIGTERM failed the phase
(`executor_stopped`) within half a second: each test here failed then."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from events import run as R
from infra.natsserver import EmbeddedNats
from tests.builders import api_workspace
from tests.executor_support import GATED_PLAN_TF
from tests.helpers import eventually
from tests.plane_support import (  # noqa: F401  # registers the fixtures
    Plane,
    commit,
    plane_fixture,
)
from tests.procs import Proc
from tests.stop_support import at_the_gate

pytestmark = pytest.mark.terraform

SLOW_APPLY_TF = """
resource "null_resource" "slow" {
  provisioner "local-exec" { command = "sleep 6" }
}
"""

FOREVER_APPLY_TF = """
resource "null_resource" "forever" {
  provisioner "local-exec" { command = "sleep 3600" }
}
"""


async def executor_proc(plane: Plane, server: EmbeddedNats, name: str) -> Proc:
    """A `runplane executor` of the plane's deployment (its key: the plane's key file)."""
    data = plane.root / name
    data.mkdir(mode=0o700)
    shutil.copy(plane.system.opts.data_dir / "encryption.key", data / "encryption.key")
    os.chmod(data / "encryption.key", 0o600)
    args = ["executor", "--nats-url", server.url, "--data-dir", str(data)]
    env = {"RUNPLANE_ENCRYPTION_KEY": ""}
    return await Proc(args, plane.root / f"{name}.log", env).start()


async def _in_apply_step(plane: Plane) -> str:
    """An apply run on `net`, approved, once Terraform's `apply` step is under way."""
    run_id = await plane.start("net")
    await plane.reaches("net", run_id, "awaiting_approval")
    await plane.approve(run_id)

    async def applying() -> bool:
        run = await plane.run("net", run_id)
        assert (run.status, run.phase_step) == (R.Status.APPLYING, "apply")
        return True

    await eventually(applying, timeout=60, what="the apply step under way")
    return run_id


async def test_sigterm_mid_plan_gives_the_plan_to_another_executor_and_the_run_ends_well(
    plane: Plane, repo: Path, tmp_path: Path, nats_server: EmbeddedNats
) -> None:
    """SIGTERM to the executor planning: it gives the plan back at once and exits; the next
    executor plans it (a second claim, not a failure) and the run awaits approval. The
    attempt is recorded (`run.phase_released`: who, which attempt), the interrupted step
    too, and the old lease's reports are fenced off (the executor's last word was the
    release)."""
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    writer = os.open(gate, os.O_RDWR)  # Terraform's open() returns, its read() waits
    commit(repo, {"main.tf": GATED_PLAN_TF})
    await api_workspace(plane.http, repo, variables={"gate": str(gate)})
    first = await executor_proc(plane, nats_server, "e1")
    second: Proc | None = None
    try:
        run_id = await plane.start("net")
        await plane.reaches("net", run_id, "planning")
        await eventually(lambda: at_the_gate(gate), timeout=60, what="Terraform at the gate")
        began = time.monotonic()
        assert await first.stop(signal.SIGTERM, timeout=30) == 0, first.output()[-3000:]
        drained_in = time.monotonic() - began
        run = await plane.reaches("net", run_id, "queued")
        assert run.released == 1 and not run.lease_id
        # the gate opens for the next attempt: a plain file where the pipe was
        os.close(writer)
        gate.unlink()
        gate.write_text("open")
        second = await executor_proc(plane, nats_server, "e2")
        run = await plane.reaches("net", run_id, "awaiting_approval")
    finally:
        for p in (first, second):
            if p is not None:
                await p.stop(signal.SIGKILL)
    # Terraform blocked reading the pipe ignores its SIGINT: killed after the stop grace
    # (20 s by default); a plan that honours SIGINT is given back within a second.
    assert drained_in < 28, f"the drain took {drained_in:.1f} s"
    events = await plane.events("net", run_id)
    claims = [e for e in events if isinstance(e, R.PhaseStarted)]
    [given_back] = [e for e in events if isinstance(e, R.PhaseReleased)]
    assert not [e for e in events if isinstance(e, R.RunFailed)]
    assert [c.phase for c in claims] == ["plan", "plan"]
    assert (given_back.attempt, given_back.reason) == (1, "executor_draining")
    assert (given_back.lease_id, given_back.executor_id) == (
        claims[0].lease_id,
        claims[0].executor_id,
    )
    assert claims[1].executor_id != claims[0].executor_id
    assert given_back.actor == f"executor:{claims[0].executor_id}"
    # nothing under the first lease after its release: its reports would be refused
    after = events[events.index(given_back) + 1 :]
    assert all(getattr(e, "lease_id", "") != claims[0].lease_id for e in after)
    interrupted = [
        e for e in events if isinstance(e, R.StepFinished) and e.lease_id == claims[0].lease_id
    ]
    assert interrupted[-1].ok is False
    assert interrupted[-1].error == "interrupted (executor_draining)"
    shown = (await plane.http.get(f"/api/v1/orgs/acme/runs/{run_id}/events")).body
    assert "run.phase_released" in [e["type"] for e in shown["items"]]


async def test_sigterm_mid_apply_lets_the_apply_finish_then_the_executor_exits(
    plane: Plane, repo: Path, nats_server: EmbeddedNats
) -> None:
    """SIGTERM while Terraform applies: the apply is never given back (exactly once); it
    runs to its end, the run is applied, and only then does the executor exit (0). It
    takes nothing new meanwhile: a run queued behind waits for the next executor."""
    commit(repo, {"main.tf": SLOW_APPLY_TF})
    await api_workspace(plane.http, repo)
    await api_workspace(plane.http, repo, name="other")
    ex = await executor_proc(plane, nats_server, "e1")
    try:
        run_id = await _in_apply_step(plane)
        ex.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        waiting = await plane.start("other", run_type="plan")
        code = await ex.stop(signal.SIGCONT, timeout=60)  # waits for its own exit
        assert code == 0, ex.output()[-3000:]
        run = await plane.run("net", run_id)
        assert run.status == R.Status.APPLIED, (run.status, run.reason, run.error_message)
        other = await plane.run("other", waiting)
        assert other.status in (R.Status.PENDING, R.Status.QUEUED), other.status
    finally:
        await ex.stop(signal.SIGKILL)
    events = await plane.events("net", run_id)
    assert not [e for e in events if isinstance(e, (R.PhaseReleased, R.RunFailed))]
    applies = [e for e in events if isinstance(e, R.PhaseStarted) and e.phase == "apply"]
    assert len(applies) == 1


async def test_a_tenant_apply_that_never_ends_holds_a_drain_no_longer_than_its_timeout(
    plane: Plane, repo: Path
) -> None:
    """Hostile code (an apply whose provisioner never ends) cannot hold an upgrade
    hostage: the drain waits for it `drain_timeout`, then stops hard as a second SIGTERM
    does (Terraform interrupted, killed after the apply's stop grace), the run fails
    `executor_stopped` and the executor is free to go. Meanwhile it took nothing new."""
    commit(repo, {"main.tf": FOREVER_APPLY_TF})
    await api_workspace(plane.http, repo)
    await api_workspace(plane.http, repo, name="other")
    ex = await plane.executor("e1")
    ex.apply_grace_period = 2.0
    run_id = await _in_apply_step(plane)
    waiting = await plane.start("other", run_type="plan")
    began = time.monotonic()
    await ex.drained(timeout=2.0)
    took = time.monotonic() - began
    assert took < 20, f"the drain held {took:.1f} s"
    run = await plane.reaches("net", run_id, "failed")
    assert run.reason == "executor_stopped"
    other = await plane.run("other", waiting)
    assert other.status in (R.Status.PENDING, R.Status.QUEUED), other.status


async def test_a_second_sigterm_stops_a_draining_executor_hard(
    plane: Plane, repo: Path, nats_server: EmbeddedNats
) -> None:
    """The first SIGTERM drains (the apply goes on); a second stops hard, as one did
    before the drain: Terraform interrupted, the run failed `executor_stopped`, exit 0."""
    commit(repo, {"main.tf": FOREVER_APPLY_TF})
    await api_workspace(plane.http, repo)
    ex = await executor_proc(plane, nats_server, "e1")
    try:
        run_id = await _in_apply_step(plane)
        assert ex.proc is not None
        ex.proc.send_signal(signal.SIGTERM)

        async def draining() -> bool:
            return "executor_draining" in ex.output()

        await eventually(draining, timeout=30, what="the drain to begin")
        assert (await plane.run("net", run_id)).status == R.Status.APPLYING
        code = await ex.stop(signal.SIGTERM, timeout=60)
        assert code == 0, ex.output()[-3000:]
    finally:
        await ex.stop(signal.SIGKILL)
    run = await plane.reaches("net", run_id, "failed")
    assert run.reason == "executor_stopped", run.error_message
