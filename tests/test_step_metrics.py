"""Step metrics: each step's CPU seconds, peak memory and wall time, measured from the
phase's control group (executor/usage.py), recorded on its `run.step_finished` and shown
by the run answer (`usage`), the steps list and table (UI) and `/metrics`, aggregated
with no tenant's name in a label.

A real plan with real Terraform on the executor as tests run it (root, the uid mode,
cgroup v1 here). An event recorded before these fields existed still decodes and folds.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest

from events.codec import run_subject
from events.run import StepFinished, Workspace
from tests.plane_support import (  # noqa: F401  # registers the fixtures
    Plane,
    commit,
    plane_fixture,
)
from tests.ui.support import Browser

THREE = {"main.tf": 'resource "null_resource" "n" {\n  count = 3\n}\n'}
MIB = 1024 * 1024


def test_an_old_step_finished_without_the_figures_still_decodes_as_not_measured() -> None:
    old = {
        "type": "run.step_finished",
        "at": "2026-01-01T00:00:00Z",
        "actor": "executor",
        "lease_id": "l",
        "step": "plan",
        "ok": True,
        "started_at": "2026-01-01T00:00:00Z",
        "metrics": {"duration_ms": 5},
    }
    event = msgspec.json.decode(msgspec.json.encode(old), type=StepFinished)
    assert (event.cpu_seconds, event.peak_memory_bytes, event.wall_seconds) == (None, None, None)
    assert event.at == datetime(2026, 1, 1, tzinfo=UTC)


@pytest.mark.terraform
async def test_a_real_plan_records_what_each_step_used(plane: Plane, repo: Path) -> None:
    commit(repo, THREE)
    ws = "zq-private-ws"
    await plane.app.create_workspace("acme", ws, Workspace(repository=str(repo)), "admin")
    await plane.executor("ex1")
    run_id = await plane.start(ws, "plan")
    await plane.reaches(ws, run_id, "planned")
    envelopes = await plane.app.store.read(run_subject("acme", ws, run_id))
    finished = {e.event.step: e.event for e in envelopes if isinstance(e.event, StepFinished)}
    assert set(finished) >= {"checkout", "init", "plan"}, finished
    cores = os.cpu_count() or 1
    for step in finished.values():
        assert step.cpu_seconds is not None and step.wall_seconds is not None, step
        assert step.peak_memory_bytes is not None, step
        assert step.wall_seconds >= step.cpu_seconds / cores - 0.05, step
    plan = finished["plan"]
    assert plan.cpu_seconds is not None and plan.cpu_seconds > 0.05, plan
    assert plan.peak_memory_bytes is not None and plan.peak_memory_bytes > 8 * MIB, plan
    assert plan.peak_memory_bytes < 2048 * MIB  # the phase's cap: it is a group's figure
    assert plan.wall_seconds is not None and 0.1 < plan.wall_seconds < 60

    # the run answer: summed, the highest peak, each step's
    got = await plane.http.get(f"/api/v1/orgs/acme/runs/{run_id}")
    usage = got.body["usage"]
    assert usage["cpu_seconds"] >= plan.cpu_seconds and usage["wall_seconds"] >= plan.wall_seconds
    assert usage["peak_memory_bytes"] == max(s.peak_memory_bytes or 0 for s in finished.values())
    assert {s["step"] for s in usage["steps"]} == set(finished)
    steps = await plane.http.get(f"/api/v1/orgs/acme/runs/{run_id}/steps")
    shown = {s["step"]: s["metrics"] for s in steps.body["items"]}
    assert shown["plan"]["cpu_seconds"] == plan.cpu_seconds
    assert shown["plan"]["peak_memory_bytes"] == plan.peak_memory_bytes

    # /metrics: aggregated by kind of phase, no organization or workspace named
    async with plane.http.client.get(
        "/metrics", headers={"Authorization": "Bearer test-admin-token"}
    ) as resp:
        assert resp.status == 200
        text = await resp.text()
    cpu_line = next(
        ln for ln in text.splitlines() if ln.startswith("runplane_step_cpu_seconds_total{")
    )
    assert 'phase="plan"' in text and float(cpu_line.split()[-1]) >= 0
    plan_cpu = [
        ln
        for ln in text.splitlines()
        if ln.startswith('runplane_step_cpu_seconds_total{phase="plan"}')
    ]
    assert plan_cpu and float(plan_cpu[0].split()[-1]) >= plan.cpu_seconds
    assert 'runplane_step_peak_memory_bytes_max{phase="plan"}' in text
    assert "acme" not in text and ws not in text and run_id not in text

    # the UI's steps table: CPU and peak memory per step
    browser = Browser(plane.http.client.server)
    try:
        await browser.signin("test-admin-token", org="acme")
        page = await browser.get(f"/orgs/acme/runs/{run_id}")
        assert page.status == 200 and "Peak memory" in page.text
        assert f"{plan.peak_memory_bytes / MIB:.1f} MiB" in page.text, page.text[-2000:]
    finally:
        await browser.close()
