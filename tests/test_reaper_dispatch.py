"""The dispatch timeout, and the reaper's judgement of every run status (pure)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from events import run as R
from executor.terraform import TerraformConfig
from infra.heartbeats import Beat, Board, beat_interval, server_time
from infra.streams import DISPATCH
from services.app.commands import App
from services.processes.scheduler.reaper import Reaper, Verdict, judge
from services.processes.scheduler.watch import mark_dispatched
from tests.bootstrap_support import System
from tests.builders import queued_run
from tests.core_support import APPLY_LEASE, HISTORIES, PLAN_LEASE, REACHABLE
from tests.executor_support import dispatches_left
from tests.helpers import eventually
from tests.reaper_support import ORG, beat, claim, entry, failures, reaches, state, workspace

# ---------------------------------------------------------------- judge (pure)

Q, AQ, P, A = R.Status.QUEUED, R.Status.APPLY_QUEUED, R.Status.PLANNING, R.Status.APPLYING
EXPECTED = {  # (status, phase, lease of the entry) -> verdict; anything else: purge
    (Q, "plan", ""): Verdict.FAIL_UNCLAIMED,
    (Q, "plan", PLAN_LEASE): Verdict.KEEP,
    (Q, "plan", APPLY_LEASE): Verdict.KEEP,
    (AQ, "apply", ""): Verdict.FAIL_UNCLAIMED,
    (AQ, "apply", PLAN_LEASE): Verdict.KEEP,
    (AQ, "apply", APPLY_LEASE): Verdict.KEEP,
    (P, "plan", PLAN_LEASE): Verdict.FAIL_SILENT,
    (P, "plan", ""): Verdict.ADOPT,
    (P, "plan", APPLY_LEASE): Verdict.ADOPT,
    (A, "apply", APPLY_LEASE): Verdict.FAIL_SILENT,
    (A, "apply", ""): Verdict.ADOPT,
    (A, "apply", PLAN_LEASE): Verdict.ADOPT,
}


@pytest.mark.parametrize("status", REACHABLE)
@pytest.mark.parametrize("phase", ["plan", "apply"])
@pytest.mark.parametrize("lease", ["", PLAN_LEASE, APPLY_LEASE])
def test_judge_fails_only_the_phase_the_run_waits_for_or_runs_under_that_lease(
    status: R.Status, phase: str, lease: str
) -> None:
    run = R.fold(HISTORIES[status])
    expected = EXPECTED.get((status, phase, lease), Verdict.PURGE)
    assert judge(entry(phase, lease), run) == expected


def test_judge_purges_the_entry_of_a_run_that_does_not_exist() -> None:
    assert judge(entry("plan", PLAN_LEASE), R.INITIAL) == Verdict.PURGE


def test_server_timestamps_keep_microseconds_and_are_utc() -> None:
    assert server_time("2026-11-29T18:41:52.243973919Z") == datetime(
        2026, 11, 29, 18, 41, 52, 243973, tzinfo=UTC
    )
    assert server_time("2026-11-29T18:41:52Z") == datetime(2026, 11, 29, 18, 41, 52, tzinfo=UTC)


@pytest.mark.parametrize(
    ("configured", "timeout", "expected"),
    [(5.0, 600, 5.0), (5.0, 3, 1.0), (0.2, 3, 0.2), (5.0, 0, 5.0)],
)
def test_executors_beat_at_least_three_times_per_heartbeat_timeout(
    configured: float, timeout: int, expected: float
) -> None:
    assert beat_interval(configured, timeout) == expected


# ---------------------------------------------------------------- dispatch timeout


async def test_a_phase_nobody_claims_fails_after_the_dispatch_timeout(
    nc: NATS, app: App, system: System
) -> None:
    """dispatch_timeout 1 s and no executor: failed, the workspace admits the next run;
    a workspace without a dispatch timeout keeps its run queued."""
    await workspace(app, "net", dispatch=1)
    await workspace(app, "patient", dispatch=0)
    async with system.scheduler(), Reaper(nc, app, interval=0.1):
        first = str((await app.create_run(ORG, "net", "apply", "alice")).state.run_id)
        second = str((await app.create_run(ORG, "net", "apply", "alice")).state.run_id)
        waiting = str((await app.create_run(ORG, "patient", "apply", "alice")).state.run_id)
        failed = await reaches(app, "net", first, "failed")
        await reaches(app, "net", second, "queued")
    assert failed.reason == "executor_unavailable"
    assert failed.error_message == (
        "no executor picked up the plan phase within the dispatch timeout of 1s"
    )
    assert (await state(app, "patient", waiting)).status == R.Status.QUEUED
    marker = await Board(nc).last(waiting, "plan")
    assert marker is not None and marker.body.timeout == 0, "no dispatch clock, but watched"


async def test_a_phase_claimed_in_time_is_then_watched_by_its_heartbeats(
    nc: NATS, app: App
) -> None:
    """The claim's beats replace the dispatch marker: from then on the heartbeat timeout
    counts, and only once the executor goes silent does the run fail."""
    board = Board(nc)
    await workspace(app, "net", dispatch=1, heartbeat=1)
    run_id = await queued_run(app, "net")
    await mark_dispatched(nc, await state(app, "net", run_id), "plan")
    async with Reaper(nc, app, interval=0.1):
        lease = await claim(app, "net", run_id)
        for _ in range(8):  # 2.4 s: past the dispatch timeout, beating all along
            await beat(board, "net", run_id, lease, timeout=1)
            await asyncio.sleep(0.3)
            assert (await state(app, "net", run_id)).status == R.Status.PLANNING
        failed = await reaches(app, "net", run_id, "failed")
    assert "sent no heartbeat" in failed.error_message


async def test_a_claim_the_board_missed_gets_a_beat_from_the_reaper(nc: NATS, app: App) -> None:
    """No scheduler saw the claim (no `claimed` beat) and the executor died at once: the
    stale marker makes the reaper beat for the lease, and its silence then fails the run."""
    await workspace(app, "net", dispatch=1, heartbeat=1)
    run_id = await queued_run(app, "net")
    await mark_dispatched(nc, await state(app, "net", run_id), "plan")
    lease = await claim(app, "net", run_id)
    async with Reaper(nc, app, interval=0.1):
        adopted = await eventually(
            lambda: _lease_on_board(nc, run_id, lease), what="the reaper to beat for the lease"
        )
        assert adopted is not None and adopted.body.kind == "claimed"
        failed = await reaches(app, "net", run_id, "failed")
    assert "sent no heartbeat" in failed.error_message
    assert len(await failures(app, "net", run_id)) == 1


@pytest.mark.terraform
async def test_a_dispatch_left_in_the_queue_after_the_timeout_is_never_run(
    nc: NATS, app: App, system: System, tmp_path: Path
) -> None:
    """The work-queue message of a phase failed for its dispatch timeout reaches a real
    executor later: its claim is refused, the message is acked, nothing runs."""
    await workspace(app, "net", dispatch=1)
    async with system.scheduler(), Reaper(nc, app, interval=0.1):
        run_id = str((await app.create_run(ORG, "net", "apply", "alice")).state.run_id)
        failed = await reaches(app, "net", run_id, "failed")
    js = nc.jetstream()
    assert (await js.stream_info(DISPATCH)).state.messages == 1
    ex = system.executor(
        work_dir=tmp_path / "exec",
        executor_id="late",
        fetch_timeout=0.2,
        terraform=TerraformConfig(),  # its own provider mirror, as the tests' executors
    )
    async with ex:

        async def consumed() -> bool:
            return await dispatches_left(js) == 0

        await eventually(consumed, what="the leftover dispatch deleted")
    after = await state(app, "net", run_id)
    assert (after.status, after.version) == (R.Status.FAILED, failed.version)
    envs = await app.store.read(f"rp.run.{ORG}.net.{run_id}")
    assert not [e for e in envs if isinstance(e.event, R.PhaseStarted)]
    assert (await js.stream_info(DISPATCH)).state.messages == 0


async def _lease_on_board(nc: NATS, run_id: str, lease: str) -> Beat | None:
    last = await Board(nc).last(run_id, "plan")
    return last if last is not None and last.lease_id == lease else None
