"""Snapshot before dispatch: admission pins the run to a resolved commit, its variable
names and origins, and its settings, before any executor sees it; the plan uses exactly
that commit. Real nats-server, real git, real Terraform."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from events.codec import tag_of
from events.run import PlanFinished, RunFailed, RunState, Workspace
from services.app import snapshot
from tests.builders import api_workspace
from tests.helpers import eventually
from tests.plane_support import (  # noqa: F401  # registers the fixtures
    Plane,
    commit,
    plane_fixture,
)

pytestmark = pytest.mark.terraform

MAIN_TF = """
variable "n" { default = "1" }
resource "null_resource" "hello" {
  count    = tonumber(var.n)
  triggers = { n = var.n }
}
"""


async def test_the_snapshot_is_recorded_before_any_executor_sees_the_run(
    plane: Plane, repo: Path
) -> None:
    """run.queued carries the resolved commit, variable names with origins (no secret
    value) and the effective settings; phase_started comes after it; the plan reports the
    commit's author and first message line; the run's GET shows all of it."""
    sha = commit(repo, {"main.tf": MAIN_TF}, "one null resource\n\nwith a body")
    await api_workspace(
        plane.http,
        repo,
        variables={"n": "1"},
        secret_variables={"token": "s3cr3t-value"},
        heartbeat_timeout=300,
    )
    run_id = await plane.start("net", "plan")
    queued = await plane.pinned("net", run_id)  # queued; no executor runs yet
    snap = queued.snapshot
    assert snap is not None and snap.commit == sha == queued.commit
    assert [(v.name, v.origin, v.sensitive) for v in snap.variables] == [
        ("n", "workspace", False),
        ("token", "workspace", True),
    ]
    assert snap.settings["heartbeat_timeout"] == {"value": 300, "origin": "workspace"}
    assert snap.settings["dispatch_timeout"] == {"value": 0, "origin": "default"}
    assert snap.settings["managed_state"] == {"value": True, "origin": "workspace"}
    assert snap.settings["require_approval"] == {"value": True, "origin": "default"}

    await plane.executor("ex1")
    await plane.reaches("net", run_id, "planned")
    events = await plane.events("net", run_id)
    kinds = [tag_of(e) for e in events]
    assert kinds.index("run.queued") < kinds.index("run.phase_started")
    planned = next(e for e in events if isinstance(e, PlanFinished))
    assert (planned.commit, planned.commit_message) == (sha, "one null resource")
    assert planned.commit_author == "t <t@example.com>"

    async def projected() -> dict[str, Any]:  # the read model may lag the event log
        body = (await plane.http.get(f"/api/v1/orgs/acme/runs/{run_id}")).body
        assert body["status"] == "planned", body["status"]
        return body  # type: ignore[no-any-return]  # JSON object

    got = await eventually(projected, timeout=10, what="the planned run in the read model")
    assert got["snapshot"]["commit"] == sha
    assert got["snapshot"]["variables"][1] == {
        "name": "token",
        "origin": "workspace",
        "sensitive": True,
    }
    assert got["commit_author"] == "t <t@example.com>"
    assert got["commit_message"] == "one null resource"
    assert "s3cr3t-value" not in str(got)


async def test_a_branch_moved_after_admission_does_not_change_what_is_planned(
    plane: Plane, repo: Path
) -> None:
    """The plan checks out the snapshot's commit, not the branch head at plan time."""
    pinned = commit(repo, {"main.tf": MAIN_TF})
    await api_workspace(plane.http, repo)
    run_id = await plane.start("net", "plan")
    await plane.pinned("net", run_id)
    moved = commit(repo, {"main.tf": MAIN_TF.replace('"1"', '"5"')}, "five")

    await plane.executor("ex1")
    done = await plane.reaches("net", run_id, "planned")
    assert done.commit == pinned != moved
    assert done.plan_summary is not None and done.plan_summary.add == 1


async def test_a_branch_that_cannot_be_resolved_fails_the_run_before_dispatch(
    plane: Plane, repo: Path
) -> None:
    """`git ls-remote` finds no such branch: the run fails with checkout_failed and git's
    answer, is never claimed, and gives its workspace back."""
    commit(repo, {"main.tf": MAIN_TF})
    await api_workspace(plane.http, repo, branch="nope")
    run_id = await plane.start("net", "plan")
    failed = await plane.reaches("net", run_id, "failed")
    assert failed.reason == "checkout_failed"
    assert "nope" in failed.error_message and str(repo) in failed.error_message
    events = await plane.events("net", run_id)
    assert [tag_of(e) for e in events] == ["run.created", "run.queued", "run.failed"]
    assert isinstance(events[-1], RunFailed)
    ws = (await plane.app.load_ws("acme", "net")).state
    assert (ws.active, ws.queue) == ("", ())


async def test_admissions_of_one_repository_share_a_running_ls_remote(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Ten workspaces of one repository admitted at once spawn one `git ls-remote`, not
    ten; another branch gets its own; a query that ended is not reused."""
    calls: list[tuple[str, str]] = []
    gate = asyncio.Event()

    async def fake(
        repository: str, branch: str, *, timeout: float, credential: object, **_: object
    ) -> str:
        calls.append((repository, branch))
        await gate.wait()
        return ("a" if branch == "main" else "b") * 40

    monkeypatch.setattr(snapshot, "resolve_commit", fake)
    taker = snapshot.Snapshotter()

    def run(branch: str) -> RunState:
        return RunState(run_id="r", config=Workspace(repository="/repo", branch=branch))

    pending = [asyncio.create_task(taker(run("main"))) for _ in range(10)]
    pending.append(asyncio.create_task(taker(run("prod"))))
    await asyncio.sleep(0.05)
    gate.set()
    snaps = await asyncio.gather(*pending)
    assert sorted(calls) == [("/repo", "main"), ("/repo", "prod")]
    assert [s.commit for s in snaps] == ["a" * 40] * 10 + ["b" * 40]
    await taker(run("main"))
    assert len(calls) == 3
