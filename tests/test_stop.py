"""Stopping a planning run through the HTTP API: real Terraform, held at a named pipe."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from events import run as R
from tests.builders import api_workspace
from tests.executor_support import GATED_PLAN_TF
from tests.helpers import eventually
from tests.plane_support import (  # noqa: F401  # registers the fixtures
    Plane,
    commit,
    plane_fixture,
)
from tests.stop_support import SLOW_APPLY_TF, at_the_gate, at_the_gate_not

pytestmark = pytest.mark.terraform


async def test_cancel_of_a_planning_run_interrupts_terraform_and_ends_canceled(
    plane: Plane, repo: Path, tmp_path: Path
) -> None:
    """Cancel on a planning run records who asked to stop; the executor interrupts
    Terraform, the run ends `canceled` with that reason, and the next run is admitted."""
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    writer = os.open(gate, os.O_RDWR)  # Terraform's open() returns, its read() waits
    try:
        commit(repo, {"main.tf": GATED_PLAN_TF})
        await api_workspace(plane.http, repo, variables={"gate": str(gate)})
        await plane.executor("e1")
        stopped = await plane.start("net")
        await plane.reaches("net", stopped, "planning")
        await eventually(lambda: at_the_gate(gate), timeout=60, what="Terraform at the gate")
        (tmp_path / "open").write_text("open")
        await plane.app.set_variables("acme", "net", {"gate": str(tmp_path / "open")}, "alice")
        following = await plane.start("net")
        shown = (await plane.http.get(f"/api/v1/orgs/acme/runs/{stopped}")).body
        assert shown["owner"]["executor_id"] == "e1"

        a = await plane.http.post(
            f"/api/v1/orgs/acme/runs/{stopped}/cancel", json={"reason": "wrong branch"}
        )
        assert a.status == 200, a.body
        assert a.body["status"] in ("planning", "canceled")  # canceled: the executor was quick
        await eventually(lambda: at_the_gate_not(gate), timeout=30, what="Terraform gone")
    finally:
        os.close(writer)
    run = await plane.reaches("net", stopped, "canceled")
    assert run.reason == "wrong branch"
    events = await plane.events("net", stopped)
    [asked] = [e for e in events if isinstance(e, R.RunStopRequested)]
    [ended] = [e for e in events if isinstance(e, R.RunCanceled)]
    assert (asked.actor, asked.reason) == ("admin", "wrong branch")
    assert ended.actor == "executor:e1"
    assert asked.at <= ended.at
    [step] = [e for e in events if isinstance(e, R.StepFinished) and e.step == "plan"]
    assert (step.ok, step.error) == (False, "interrupted (stop_requested)")
    await plane.reaches("net", following, "awaiting_approval")

    last = str(max(e.seq for e in await plane.app.store.read(f"rp.run.acme.net.{stopped}")))
    history = await plane.http.get(
        f"/api/v1/orgs/acme/runs/{stopped}/events", headers={"RP-Min-Seq": last}
    )
    kinds = [(e["type"], e["actor"]) for e in history.body["items"]]
    assert ("run.stop_requested", "admin") in kinds
    assert ("run.canceled", "executor:e1") in kinds


async def test_cancel_of_an_applying_run_is_refused_409_and_the_apply_completes(
    plane: Plane, repo: Path
) -> None:
    """Interrupting an apply can corrupt state: cancel answers 409 saying so."""
    commit(repo, {"main.tf": SLOW_APPLY_TF})
    await api_workspace(plane.http, repo)
    await plane.executor("e1")
    run_id = await plane.start("net")
    await plane.reaches("net", run_id, "awaiting_approval")
    await plane.approve(run_id)
    await plane.reaches("net", run_id, "applying")
    a = await plane.http.post(f"/api/v1/orgs/acme/runs/{run_id}/cancel", json={})
    problem = a.problem("conflict", 409)
    assert problem["current_status"] == "applying"
    assert "corrupt state" in problem["detail"]
    await plane.reaches("net", run_id, "applied")
