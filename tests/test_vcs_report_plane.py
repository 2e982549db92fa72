"""The reporter with the whole plane: a PR's speculative plan, admitted by the scheduler
and planned by an executor with real Terraform at the PR's commit, shows on the local
GitHub as pending, then success with the plan's real counts, and as the PR's comment."""

from __future__ import annotations

from pathlib import Path

import pytest

from events.values import Cause
from infra.consumer import Consumer
from services.processes.vcs.client import Policy
from services.processes.vcs.report import Reporter, lookup_for, subscription
from tests.helpers import eventually
from tests.plane_support import (  # noqa: F401  # registers the fixtures
    Plane,
    commit,
    plane_fixture,
)
from tests.vcs_report_support import FakeVcs
from tests.vcs_support import saved_connection

pytestmark = pytest.mark.terraform

TWO = """
resource "null_resource" "a" {}
resource "null_resource" "b" {}
"""
BASE = "https://rp.example"


async def test_a_real_pr_plan_reports_its_counts_and_its_comment(plane: Plane, repo: Path) -> None:
    sha = commit(repo, {"main.tf": TWO})
    a = await plane.http.post(
        "/api/v1/orgs/acme/workspaces", json={"name": "net", "repository": str(repo)}
    )
    assert a.status == 201, a.body
    await plane.executor("e1")
    policy = Policy(allow=frozenset({"loopback"}), timeout=2.0, schedule=(0.1, 0.2))
    reporter = Reporter(
        plane.app.store, lookup_for(plane.app, plane.secrets), policy, base_url=BASE
    )
    async with (
        FakeVcs() as github,
        Consumer(plane.nc, subscription(reporter), states=plane.app.states),
    ):
        await saved_connection(
            plane.app, plane.secrets, "acme", "gh1", "github", github.url, "ghp-plane"
        )
        cause = Cause(
            kind="vcs",
            provider="github",
            connection="gh1",
            delivery="d1",
            event="pull_request",
            ref="refs/pull/9/head",
            commit=sha,
            repository="acme/net",
            pull_request=9,
        )
        created = await plane.app.create_run(
            "acme", "net", "plan", "vcs", cause=cause, commit=sha, speculative=True
        )
        run_id = created.state.run_id
        planned = await plane.reaches("net", run_id, "planned", "failed")
        assert str(planned.status) == "planned", planned.error_message

        async def reported() -> bool:
            states = [c.body["state"] for c in github.statuses()]
            assert states and states[0] == "pending" and states[-1] == "success", states
            [c] = github.comments.values()
            assert "| `net` | planned | +2 ~0 -0 |" in c.body, c.body
            return True

        await eventually(reported, what="the PR's status and comment", timeout=30)
        last = github.statuses()[-1]
        assert last.path == f"/repos/acme/net/statuses/{sha}"
        assert last.body["description"] == "+2 ~0 -0"
        assert last.body["target_url"] == f"{BASE}/orgs/acme/workspaces/net/runs/{run_id}"
