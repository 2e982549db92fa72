"""Approvals that record who and what, end to end: real Terraform, through the HTTP API.

Who may approve or discard (approvers by person and by group, four-eyes), what they must
acknowledge (confirm_destructive), and a workspace that needs no approval at all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.builders import api_workspace
from tests.plane_support import (  # noqa: F401  # registers the fixtures
    Plane,
    commit,
    plane_fixture,
)

pytestmark = pytest.mark.terraform

V1 = "/api/v1/orgs/acme"
KEPT = 'resource "null_resource" "a" {\n  triggers = { v = "%s" }\n}\n'
TWO = KEPT % "1" + 'resource "null_resource" "b" {}\n'


async def _setup(plane: Plane, repo: Path, settings: dict[str, Any]) -> dict[str, str]:
    """Workspace `net` with `settings`; tokens of alice, bob, carol (and their roles)."""
    commit(repo, {"main.tf": TWO})
    await api_workspace(plane.http, repo, settings=settings)
    tokens = {}
    for user, role in (("alice", "approver"), ("bob", "operator"), ("carol", "operator")):
        a = await plane.http.post(f"{V1}/tokens", json={"user": user, "role": role})
        assert a.status == 201, a.body
        tokens[user] = a.body["token"]
    await plane.executor("e1")
    return tokens


async def _awaiting(plane: Plane, run_type: str = "apply", token: str | None = None) -> str:
    kw = {"token": token} if token else {}
    a = await plane.http.post(f"{V1}/workspaces/net/runs", json={"type": run_type}, **kw)
    assert a.status == 201, a.body
    run_id = str(a.body["id"])
    await plane.reaches("net", run_id, "awaiting_approval")
    return run_id


async def _read(plane: Plane, path: str) -> Any:
    """GET once the projection holds everything written so far."""
    seq = await plane.app.store.last_seq()
    answer = await plane.http.get(path, headers={"RP-Min-Seq": str(seq)})
    assert answer.status == 200, answer.body
    return answer.body


async def _approve(plane: Plane, run_id: str, token: str, acked: list[str] | None = None) -> Any:
    return await plane.http.post(
        f"{V1}/runs/{run_id}/approve", json={"acknowledged": acked or []}, token=token
    )


async def test_only_the_workspaces_approvers_by_person_or_group_may_approve_or_discard(
    plane: Plane, repo: Path
) -> None:
    """approvers ["carol", "group:ops"]: alice (role approver, not listed) is refused 403
    with the reason; carol approves as a person, bob as a member of group ops."""
    tokens = await _setup(plane, repo, {"approvers": ["carol", "group:ops"]})
    g = await plane.http.post(f"{V1}/groups", json={"name": "ops", "members": ["dave"]})
    assert g.status == 201, g.body
    g = await plane.http.call("PUT", f"{V1}/groups/ops/members", json={"members": ["bob"]})
    assert (g.status, g.body) == (200, {"name": "ops", "members": ["bob"]})
    listed = await plane.http.get(f"{V1}/groups", token=tokens["alice"])
    assert listed.body["items"] == [{"name": "ops", "members": ["bob"]}]

    run_id = await _awaiting(plane)
    refused = (await _approve(plane, run_id, tokens["alice"])).problem("forbidden", 403)
    assert "alice is not among the workspace's approvers" in refused["detail"]
    a = await plane.http.post(f"{V1}/runs/{run_id}/discard", json={}, token=tokens["alice"])
    assert "not among the workspace's approvers" in a.problem("forbidden", 403)["detail"]
    a = await _approve(plane, run_id, tokens["carol"])
    assert (a.status, a.body["approved_by"]) == (200, "carol"), a.body
    assert (await plane.reaches("net", run_id, "applied")).approved_by == "carol"

    destroy = await _awaiting(plane, "destroy")
    a = await _approve(plane, destroy, tokens["bob"])
    assert (a.status, a.body["approved_by"]) == (200, "bob"), a.body
    await plane.reaches("net", destroy, "applied")


async def test_four_eyes_refuses_the_runs_creator_and_lets_another_approve(
    plane: Plane, repo: Path
) -> None:
    """four_eyes: alice created the run and may not approve it (403, saying so), not
    even through the admin token's bypass; another approver may."""
    tokens = await _setup(plane, repo, {"four_eyes": True})
    erin = (await plane.http.post(f"{V1}/tokens", json={"user": "erin", "role": "approver"})).body
    run_id = await _awaiting(plane, token=tokens["alice"])
    refused = (await _approve(plane, run_id, tokens["alice"])).problem("forbidden", 403)
    assert "four_eyes" in refused["detail"] and "alice created this run" in refused["detail"]
    a = await _approve(plane, run_id, erin["token"])
    assert (a.status, a.body["approved_by"]) == (200, "erin"), a.body
    await plane.reaches("net", run_id, "applied")

    by_admin = await _awaiting(plane, "destroy")  # created with the admin token
    (await _approve(plane, by_admin, "test-admin-token")).problem("forbidden", 403)
    a = await _approve(plane, by_admin, tokens["alice"])
    assert (a.status, a.body["approved_by"]) == (200, "alice"), a.body
    await plane.reaches("net", by_admin, "applied")


async def test_confirm_destructive_needs_every_deletion_and_replacement_acknowledged(
    plane: Plane, repo: Path
) -> None:
    """With confirm_destructive on, approving without acknowledging a deletion or a
    replacement is 409 naming the missing addresses; a full list is recorded with the
    approver and the time, in the run and in its run.approved event."""
    tokens = await _setup(plane, repo, {"confirm_destructive": True})
    first = await _awaiting(plane)
    assert (await _approve(plane, first, tokens["alice"])).status == 200  # creations only
    await plane.reaches("net", first, "applied")
    commit(repo, {"main.tf": KEPT % "2"})  # a is replaced, b deleted

    run_id = await _awaiting(plane)
    both = ["null_resource.a", "null_resource.b"]
    refused = (await _approve(plane, run_id, tokens["alice"])).problem("conflict", 409)
    assert sorted(refused["missing"]) == both
    partly = await _approve(plane, run_id, tokens["alice"], ["null_resource.b"])
    assert partly.problem("conflict", 409)["missing"] == ["null_resource.a"]
    a = await _approve(plane, run_id, tokens["alice"], both)
    assert a.status == 200, a.body
    assert (a.body["approved_by"], a.body["acknowledged"]) == ("alice", both)
    done = await plane.reaches("net", run_id, "applied")
    assert (done.approved_by, done.acknowledged) == ("alice", both)

    shown = await _read(plane, f"{V1}/runs/{run_id}")
    assert (shown["approved_by"], shown["acknowledged"]) == ("alice", both)
    history = (await _read(plane, f"{V1}/runs/{run_id}/events"))["items"]
    approved = [e for e in history if e["type"] == "run.approved"]
    assert len(approved) == 1 and approved[0]["actor"] == "alice" and approved[0]["at"]
    assert approved[0]["data"]["acknowledged"] == both


async def test_without_require_approval_the_apply_goes_straight_through(
    plane: Plane, repo: Path
) -> None:
    """require_approval false: the run never awaits approval, and its plan_finished event
    records that the rule it used was false."""
    await _setup(plane, repo, {"require_approval": False})
    run_id = await plane.start("net")
    done = await plane.reaches("net", run_id, "applied", "failed")
    assert done.status == "applied", done.error_message
    assert done.approved_by == ""
    history = (await _read(plane, f"{V1}/runs/{run_id}/events"))["items"]
    types = [e["type"] for e in history]
    assert "run.approved" not in types
    (plan,) = [e for e in history if e["type"] == "run.plan_finished"]
    assert plan["data"]["require_approval"] is False
    pinned = next(e for e in history if e["type"] == "run.pinned")
    recorded = pinned["data"]["snapshot"]["settings"]["require_approval"]
    assert recorded == {"value": False, "origin": "workspace"}
