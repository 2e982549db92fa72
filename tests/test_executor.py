"""The executor against a real nats-server and real Terraform (null provider, offline)."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from events.run import (
    ClaimPhase,
    FailRun,
    StepStarted,
    Workspace,
)
from executor import Executor
from executor.objects import PLANS_BUCKET
from services.app.commands import App
from tests.executor_support import MAIN_TF, Harness, commit, dispatches_left, step_results
from tests.helpers import eventually
from tests.state_support import current_state, opened_plan

pytestmark = pytest.mark.terraform

BAD_REFERENCE_TF = """
resource "null_resource" "hello" {
  triggers = { n = var.missing }
}
"""

SLOW_TF = """
variable "marker" {}
resource "null_resource" "slow" {
  provisioner "local-exec" { command = "touch ${var.marker} && sleep 60" }
}
"""


@pytest.fixture
def h(nc: NATS, app: App) -> Harness:
    return Harness(nc, app)


async def test_plan_awaits_approval_then_apply_stores_state(
    h: Harness, repo: Path, executor: Executor
) -> None:
    """A plan stores its plan file by digest at the branch's commit; apply stores the state."""
    sha = commit(repo, MAIN_TF)
    await h.workspace("net", Workspace(repository=str(repo), variables={"n": "2"}))
    run_id = await h.start_run("net")

    planned = await h.reaches("net", run_id, "awaiting_approval")
    assert planned.commit == sha
    assert planned.plan_summary is not None
    assert (planned.plan_summary.add, planned.plan_summary.destroy) == (2, 0)
    plan_bytes = await opened_plan(h.nc, executor.vault.keyring, planned.plan_object)
    assert hashlib.sha256(plan_bytes).hexdigest() == planned.plan_digest
    steps = step_results(await h.events("net", run_id))
    assert [s for s, e in steps.items() if e.ok] == ["checkout", "init", "plan"]
    assert b"Plan: 2 to add" in await h.get("rp-logs", steps["plan"].log_object)

    await h.approve("net", run_id)
    applied = await h.reaches("net", run_id, "applied")
    assert applied.apply_summary is not None
    assert applied.apply_summary.add == 2
    state = await current_state(h.nc, executor.vault.keyring, "acme", "net")
    assert state is not None
    assert len(state["resources"][0]["instances"]) == 2
    await eventually(_empty(executor.jobs_dir), what="phase directories removed")


async def test_second_run_plans_against_the_stored_state(
    h: Harness, repo: Path, executor: Executor
) -> None:
    """After one applied run, the next plan sees the existing resources (state carried over)."""
    commit(repo, MAIN_TF)
    await h.workspace("net", Workspace(repository=str(repo)))
    first = await h.start_run("net")
    await h.reaches("net", first, "awaiting_approval")
    await h.approve("net", first)
    await h.reaches("net", first, "applied")

    sha = commit(repo, MAIN_TF.replace('default = "1"', 'default = "3"'))
    second = await h.start_run("net")
    planned = await h.reaches("net", second, "awaiting_approval")
    assert planned.commit == sha
    # Without the stored state the plan would add 3; with it, the existing one is
    # replaced (its trigger changed) and two are added.
    assert planned.plan_summary is not None
    assert (planned.plan_summary.add, planned.plan_summary.destroy) == (3, 1)
    await h.approve("net", second)
    await h.reaches("net", second, "applied")
    state = await current_state(h.nc, executor.vault.keyring, "acme", "net")
    assert state is not None
    assert len(state["resources"][0]["instances"]) == 3


async def test_failing_plan_fails_the_run_with_terraforms_error(
    h: Harness, repo: Path, executor: Executor
) -> None:
    """A plan error fails the run with `plan_failed` and Terraform's diagnostic as message."""
    commit(repo, BAD_REFERENCE_TF)
    await h.workspace("net", Workspace(repository=str(repo)))
    run_id = await h.start_run("net")

    failed = await h.reaches("net", run_id, "failed")
    assert failed.reason == "plan_failed"
    assert "Error: Reference to undeclared input variable" in failed.error_message
    assert "main.tf line 3" in failed.error_message
    plan_step = step_results(await h.events("net", run_id))["plan"]
    assert not plan_step.ok and "undeclared input variable" in plan_step.error
    assert plan_step.log_object


async def test_invalid_configuration_fails_init(h: Harness, repo: Path, executor: Executor) -> None:
    """HCL that does not parse fails at init (Terraform parses before installing providers)."""
    commit(repo, 'resource "null_resource" "x" {\n')
    await h.workspace("net", Workspace(repository=str(repo)))
    run_id = await h.start_run("net")
    failed = await h.reaches("net", run_id, "failed")
    assert failed.reason == "init_failed"
    assert failed.error_message.startswith("Error: ")
    assert "main.tf line 2" in failed.error_message


async def test_unknown_branch_fails_checkout(h: Harness, repo: Path, executor: Executor) -> None:
    """A branch that does not exist fails the run at checkout, saying what git said."""
    commit(repo, MAIN_TF)
    await h.workspace("net", Workspace(repository=str(repo), branch="nope"))
    run_id = await h.start_run("net")
    failed = await h.reaches("net", run_id, "failed")
    assert failed.reason == "checkout_failed"
    assert "nope" in failed.error_message


async def test_dispatch_for_a_claimed_phase_is_dropped(
    h: Harness, repo: Path, nc: NATS, app: App, executor: Executor
) -> None:
    """A dispatch whose phase another executor holds is acked and nothing runs."""
    commit(repo, MAIN_TF)
    await h.workspace("net", Workspace(repository=str(repo)))
    run_id = (await app.create_run("acme", "net", "apply", "alice")).state.run_id
    await app.admit_next("acme", "net")
    claim = ClaimPhase(actor="executor:other", phase="plan", lease_id="l1", executor_id="other")
    before = (await app.run_command("acme", "net", run_id, claim)).state

    await h.dispatch("net", run_id, "plan")

    async def consumed() -> bool:
        return await dispatches_left(nc.jetstream()) == 0

    await eventually(consumed, what="the dispatch message deleted")
    after = await h.run("net", run_id)
    assert (after.version, after.lease_id, after.executor_id) == (before.version, "l1", "other")
    assert not [e for e in await h.events("net", run_id) if isinstance(e, StepStarted)]


async def test_tampered_plan_is_not_applied(h: Harness, repo: Path, executor: Executor) -> None:
    """A plan object whose digest differs from the approved one fails the run, unapplied."""
    commit(repo, MAIN_TF)
    await h.workspace("net", Workspace(repository=str(repo)))
    run_id = await h.start_run("net")
    planned = await h.reaches("net", run_id, "awaiting_approval")
    store = await h.js.object_store(PLANS_BUCKET)
    await store.put(planned.plan_object, b"not the approved plan")

    await h.approve("net", run_id)
    failed = await h.reaches("net", run_id, "failed")
    assert failed.reason == "plan_digest_mismatch"
    assert await current_state(h.nc, executor.vault.keyring, "acme", "net") is None


async def test_drift_run_without_drift_has_no_changes(
    h: Harness, repo: Path, executor: Executor
) -> None:
    """A refresh-only plan with nothing drifted ends `no_changes` (not Terraform's exit 2)."""
    commit(repo, MAIN_TF)
    await h.workspace("net", Workspace(repository=str(repo)))
    run_id = await h.start_run("net", run_type="drift")
    done = await h.reaches("net", run_id, "no_changes")
    assert done.plan_object == ""


async def test_stop_interrupts_apply_and_keeps_the_state(
    h: Harness, repo: Path, executor: Executor, tmp_path: Path
) -> None:
    """Stopping mid-apply interrupts Terraform, stores the state it wrote, fails the run."""
    marker = tmp_path / "provisioner-started"
    commit(repo, SLOW_TF)
    await h.workspace("net", Workspace(repository=str(repo), variables={"marker": str(marker)}))
    run_id = await h.start_run("net")
    await h.reaches("net", run_id, "awaiting_approval")
    await h.approve("net", run_id)

    await eventually(_exists(marker), what="the provisioner to start")
    executor.stop()

    failed = await h.reaches("net", run_id, "failed")
    assert failed.reason == "executor_stopped"
    assert "apply" in failed.error_message
    state = await current_state(h.nc, executor.vault.keyring, "acme", "net")
    assert state is not None
    assert state["resources"][0]["instances"][0]["status"] == "tainted"
    apply_step = step_results(await h.events("net", run_id))["apply"]
    assert not apply_step.ok and b"Interrupt received" in await h.get(
        "rp-logs", apply_step.log_object
    )


async def test_lost_lease_interrupts_terraform_and_keeps_the_state(
    h: Harness, repo: Path, app: App, executor: Executor, tmp_path: Path
) -> None:
    """A run failed under a running apply (the reaper) interrupts it; the state it wrote
    is refused by the lease fence and kept on the executor's host instead."""
    marker = tmp_path / "provisioner-started"
    commit(repo, SLOW_TF)
    await h.workspace("net", Workspace(repository=str(repo), variables={"marker": str(marker)}))
    run_id = await h.start_run("net")
    await h.reaches("net", run_id, "awaiting_approval")
    await h.approve("net", run_id)
    await eventually(_exists(marker), what="the provisioner to start")

    reap = FailRun(actor="scheduler", reason="executor_unavailable", message="no heartbeat")
    await app.run_command("acme", "net", run_id, reap)

    kept = executor.work_dir / "unsaved-state" / f"acme.net.{run_id}.tfstate"
    await eventually(_exists(kept), timeout=15, what="the state kept on the host")
    state = json.loads(kept.read_bytes())
    assert state["resources"][0]["instances"][0]["status"] == "tainted"
    assert await current_state(h.nc, executor.vault.keyring, "acme", "net") is None
    await eventually(_empty(executor.jobs_dir), what="the phase directory removed")
    failed = await h.run("net", run_id)
    assert (failed.reason, failed.error_message) == ("executor_unavailable", "no heartbeat")


def _empty(path: Path) -> Callable[[], Any]:
    async def probe() -> bool:
        return not any(path.iterdir())

    return probe


def _exists(path: Path) -> Callable[[], Any]:
    async def probe() -> bool:
        return path.exists()

    return probe


async def test_a_heartbeat_whose_cancel_is_lost_still_ends_with_its_phase(
    h: Harness, repo: Path, executor: Executor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancellation swallowed under the heartbeat (as Python 3.11's wait_for may, in a
    NATS request) must not leave it beating for the rest of the process's life."""
    lost: list[str] = []
    beat = executor.runner._beat

    async def swallowing(subject: str, job: Any) -> None:
        await beat(subject, job)
        if lost:  # lost once is enough
            return
        try:
            await asyncio.sleep(3600)  # until the phase is over: its beat's cancel, lost
        except asyncio.CancelledError:
            lost.append(job.ctx.run_id)

    monkeypatch.setattr(executor.runner, "_beat", swallowing)
    commit(repo, MAIN_TF)
    await h.workspace("net", Workspace(repository=str(repo), variables={"n": "1"}))
    run_id = await h.start_run("net")
    await h.reaches("net", run_id, "awaiting_approval")

    def beating() -> list[asyncio.Task[Any]]:
        return [t for t in asyncio.all_tasks() if t.get_name() == f"{run_id}-plan-beat"]

    async def over() -> bool:
        assert lost == [run_id], lost
        assert not beating(), "the plan's heartbeat beats on"
        return True

    await eventually(over, timeout=10, what="the heartbeat ended")


async def test_a_claim_whose_delete_times_out_still_runs_its_phase(
    h: Harness, repo: Path, monkeypatch: pytest.MonkeyPatch, executor: Executor
) -> None:
    """The attack review: the claim landed, then deleting the dispatch timed out (a
    leader election). The phase is ours: it runs; the message left is refused its
    claim later and deleted."""
    from infra.streams import delete_dispatch as deleting

    failed: list[int] = []

    async def timing_out(nc: NATS, seq: int, **kw: Any) -> bool:
        if not failed:
            failed.append(seq)
            raise TimeoutError("no answer from the stream's leader")
        return await deleting(nc, seq, **kw)

    monkeypatch.setattr("executor.intake.delete_dispatch", timing_out)
    commit(repo, MAIN_TF)
    await h.workspace("net", Workspace(repository=str(repo)))
    run_id = await h.start_run("net")
    planned = await h.reaches("net", run_id, "awaiting_approval")
    assert failed and planned.plan_summary is not None


async def test_an_idle_executor_after_a_put_off_does_not_poll_the_stream(
    nc: NATS, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retryable refusal puts a message off for a second; once that second has passed
    and nothing waits, the executor waits for a dispatch (or its fetch timeout), not 50 ms
    over and over."""
    from executor.intake import Intake, Taken

    intake = Intake(nc.jetstream(), None, "default", "e", asyncio.Event(), 0.5, nc)  # type: ignore[arg-type]
    await intake.open()
    intake._put_off(Taken(seq=7, org="acme", data=b"", headers={}), 0.01)
    await asyncio.sleep(0.05)
    calls = 0
    info = intake.js.stream_info

    async def counted(*a: Any, **kw: Any) -> Any:
        nonlocal calls
        calls += 1
        return await info(*a, **kw)

    monkeypatch.setattr(intake.js, "stream_info", counted)
    started = asyncio.get_running_loop().time()
    while asyncio.get_running_loop().time() - started < 1.0:
        assert await intake.next() is None
    await intake.close()
    assert calls <= 6, f"{calls} reads of the stream in an idle second"
