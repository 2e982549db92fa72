"""State rollback end to end with real Terraform: apply 3 null resources, apply 5 (and
a slow one), roll back to the first apply's version, and the next plan is made against
that state (3 to add again), while `terraform state pull`'s endpoints serve the rolled
back content with the new serial. A rollback tried while the second apply runs is
refused, and changes nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from yarl import URL

from events.run import Workspace
from tests.helpers import eventually
from tests.plane_support import (  # noqa: F401  # registers the fixtures
    Plane,
    commit,
    plane_fixture,
)

pytestmark = [pytest.mark.terraform, pytest.mark.slow]

V1 = 'resource "null_resource" "n" {\n  count = 3\n}\n'
V2 = (
    'resource "null_resource" "n" {\n  count = 5\n}\n'
    'resource "null_resource" "slow" {\n'
    '  provisioner "local-exec" {\n    command = "sleep 3"\n  }\n}\n'
)
WS = "/api/v1/orgs/acme/workspaces/net"


async def _apply(plane: Plane, *, while_applying: bool = False) -> tuple[str, dict[str, object]]:
    """An apply run, approved; with `while_applying`, a rollback tried mid-apply (the
    answer returned) before it ends."""
    run_id = await plane.start("net")
    await plane.reaches("net", run_id, "awaiting_approval")
    await plane.approve(run_id)
    tried: dict[str, object] = {}
    if while_applying:
        await plane.reaches("net", run_id, "applying")
        assert (await plane.http.post(f"{WS}/lock", json={"reason": "roll back"})).status == 200
        versions = (await plane.http.get(f"{WS}/state-versions")).body["items"]
        a = await plane.http.post(
            f"{WS}/state-versions/{versions[-1]['id']}/rollback", json={"reason": "now"}
        )
        tried = {
            "status": a.status,
            "type": a.body["type"],
            "run": (await plane.run("net", run_id)).status,
        }
    await plane.reaches("net", run_id, "applied")
    await eventually(lambda: _released(plane), timeout=30, what="the workspace released")
    return run_id, tried


async def _released(plane: Plane) -> bool:
    """The workspace's read row has no active run: a run's end releases the workspace a
    moment after (the scheduler's reaction), and a rollback before that is 409 run-active
    (the slow suite saw it once)."""
    row = (await plane.http.get(WS)).body
    assert row["active_run"] is None, row["active_run"]
    return True


async def _pulled(plane: Plane) -> tuple[dict[str, Any], dict[str, Any]]:
    """What `terraform state pull` gets: the current version and its content."""
    got = await plane.http.get("/api/v2/workspaces/ws-acme.net/current-state-version")
    assert got.status == 200, got.body
    attrs = got.body["data"]["attributes"]
    async with plane.http.client.get(URL(attrs["hosted-state-download-url"]).path) as resp:
        assert resp.status == 200
        return attrs, json.loads(await resp.read())


def _instances(state: dict[str, Any]) -> dict[str, int]:
    resources = state["resources"]
    assert isinstance(resources, list)
    return {r["name"]: len(r["instances"]) for r in resources}


async def test_a_rollback_is_what_the_next_plan_and_state_pull_read(
    plane: Plane, repo: Path
) -> None:
    commit(repo, {"main.tf": V1})
    await plane.app.create_workspace("acme", "net", Workspace(repository=str(repo)), "admin")
    await plane.executor("ex1")
    run1, _ = await _apply(plane)
    commit(repo, {"main.tf": V2})
    _, tried = await _apply(plane, while_applying=True)
    # mid-apply: refused as a problem, and the apply went on
    assert tried == {
        "status": 409,
        "type": "https://runplane.dev/problems/run-active",
        "run": "applying",
    }, tried
    before, state2 = await _pulled(plane)
    assert _instances(state2) == {"n": 5, "slow": 1}

    versions = (await plane.http.get(f"{WS}/state-versions")).body["items"]
    v1 = next(v for v in versions if v["run_id"] == run1)  # newest first: run 1's last
    a = await plane.http.post(
        f"{WS}/state-versions/{v1['id']}/rollback", json={"reason": "v2 is broken"}
    )
    assert a.status == 201, a.body
    assert a.body["serial"] == before["serial"] + 1 and a.body["lineage"] == v1["lineage"]

    # terraform state pull's endpoints: v1's content under the new serial
    attrs, state = await _pulled(plane)
    assert attrs["serial"] == a.body["serial"] == state["serial"]
    assert state["lineage"] == v1["lineage"] and _instances(state) == {"n": 3}

    # the next plan (the code is still v2's) is made against v1's state
    assert (await plane.http.post(f"{WS}/unlock", json={})).status == 200
    run3 = await plane.start("net", "plan")
    planned = await plane.reaches("net", run3, "planned", "no_changes", "failed")
    assert str(planned.status) == "planned", planned
    summary = planned.plan_summary
    assert summary is not None and (summary.add, summary.change, summary.destroy) == (3, 0, 0)

    # listed as a rollback, with who and why
    listed = await plane.http.get(f"{WS}/state-versions")
    newest = listed.body["items"][0]
    assert newest["id"] == a.body["id"] and newest["rollback_of"] == v1["object"], newest
    assert (newest["reason"], newest["pushed_by"]) == ("v2 is broken", "admin"), newest
