"""Run types and failures end to end: real Terraform, through the HTTP API."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.builders import api_workspace
from tests.plane_support import (  # noqa: F401  # registers the fixtures
    Plane,
    commit,
    plane_fixture,
)

pytestmark = pytest.mark.terraform

TWO = """
resource "null_resource" "a" {}
resource "null_resource" "b" {}
"""

# b's provisioner fails; c depends on b so it never starts; a is independent and runs first.
PROVISIONER_FAILS = """
resource "null_resource" "a" {}
resource "null_resource" "b" {
  depends_on = [null_resource.a]
  provisioner "local-exec" { command = "echo about to fail; exit 3" }
}
resource "null_resource" "c" {
  depends_on = [null_resource.b]
}
"""


async def _apply(plane: Plane, ws: str = "net", run_type: str = "apply") -> str:
    run_id = await plane.start(ws, run_type)
    await plane.reaches(ws, run_id, "awaiting_approval")
    await plane.approve(run_id)
    await plane.reaches(ws, run_id, "applied", "failed")
    return run_id


async def test_a_destroy_run_plans_destroy_waits_for_approval_then_destroys(
    plane: Plane, repo: Path
) -> None:
    commit(repo, {"main.tf": TWO})
    await api_workspace(plane.http, repo)
    await plane.executor("e1")
    assert (await plane.run("net", await _apply(plane))).status == "applied"
    destroy = await plane.start("net", "destroy")
    planned = await plane.reaches("net", destroy, "awaiting_approval")
    assert planned.plan_summary is not None
    assert (planned.plan_summary.add, planned.plan_summary.destroy) == (0, 2)
    seq = str(await plane.app.store.last_seq())  # read once the projection holds the plan
    path = f"/api/v1/orgs/acme/runs/{destroy}/changes"
    changes = (await plane.http.get(path, headers={"RP-Min-Seq": seq})).body
    assert changes["summary_text"] == "2 delete"
    await plane.approve(destroy)
    done = await plane.reaches("net", destroy, "applied", "failed")
    assert done.status == "applied", done.error_message
    assert done.apply_summary is not None and done.apply_summary.destroy == 2
    # Nothing is left: a fresh plan would create both again.
    again = await plane.start("net", "plan")
    replanned = await plane.reaches("net", again, "planned", "no_changes", "failed")
    assert replanned.plan_summary is not None and replanned.plan_summary.add == 2


async def test_a_failing_provisioner_fails_its_resource_and_stops_what_follows(
    plane: Plane, repo: Path
) -> None:
    commit(repo, {"main.tf": PROVISIONER_FAILS})
    await api_workspace(plane.http, repo)
    await plane.executor("e1")
    run_id = await _apply(plane)
    run = await plane.run("net", run_id)
    assert run.status == "failed"
    assert run.reason == "apply_failed"
    assert "null_resource.b" in run.error_message and "exit status 3" in run.error_message
    seq = str(await plane.app.store.last_seq())  # read once the projection holds the end
    path = f"/api/v1/orgs/acme/runs/{run_id}/resources"
    items = (await plane.http.get(path, headers={"RP-Min-Seq": seq})).body["items"]
    states = {r["address"]: r["state"] for r in items}
    assert states == {
        "null_resource.a": "done",
        "null_resource.b": "failed",
        "null_resource.c": "not_applied",
    }
    failed = next(r for r in items if r["address"] == "null_resource.b")
    assert "exit status 3" in failed["error"]


COUNTED = """
variable "n" { default = "1" }
resource "null_resource" "hello" {
  count    = tonumber(var.n)
  triggers = { n = var.n }
}
"""


async def test_variables_changed_between_plan_and_apply_change_nothing_for_that_run(
    plane: Plane, repo: Path
) -> None:
    commit(repo, {"main.tf": COUNTED})
    body = {"name": "net", "repository": str(repo), "variables": {"n": "1"}}
    assert (await plane.http.post("/api/v1/orgs/acme/workspaces", json=body)).status == 201
    await plane.executor("e1")
    run_id = await plane.start("net")
    await plane.reaches("net", run_id, "awaiting_approval")
    patched = await plane.http.call(
        "PATCH", "/api/v1/orgs/acme/workspaces/net", json={"variables": {"n": "3"}}
    )
    assert patched.status == 200, patched.body
    assert patched.body["variables"] == {"n": "3"}
    await plane.approve(run_id)
    done = await plane.reaches("net", run_id, "applied", "failed")
    assert done.status == "applied", done.error_message
    assert done.apply_summary is not None and done.apply_summary.add == 1, "the plan's n=1"
    nxt = await plane.start("net", "plan")
    planned = await plane.reaches("net", nxt, "planned", "failed")
    assert planned.plan_summary is not None
    summary = planned.plan_summary
    # n=3: hello[0] is replaced (its trigger changed) and two more are created.
    assert (summary.add, summary.destroy) == (3, 1), "the next run plans with the new n=3"


async def test_step_logs_are_readable_text_not_terraforms_json(plane: Plane, repo: Path) -> None:
    commit(repo, {"main.tf": PROVISIONER_FAILS.replace("exit 3", "exit 0")})
    await api_workspace(plane.http, repo)
    await plane.executor("e1")
    run_id = await _apply(plane)
    logs = (await plane.http.get(f"/api/v1/orgs/acme/runs/{run_id}/logs")).body["items"]
    plan = [i["text"] for i in logs if (i["phase"], i["step"]) == ("plan", "plan")]
    apply = [i["text"] for i in logs if (i["phase"], i["step"]) == ("apply", "apply")]
    assert "Plan: 3 to add, 0 to change, 0 to destroy." in plan
    assert any("Creation complete" in t for t in apply)
    assert not [t for t in plan + apply if t.startswith('{"@level"')]
    everything = [i["text"] for i in logs]
    assert not [t for t in everything if "[DEBUG]" in t and "127.0.0.1" in t], "backend chatter"
