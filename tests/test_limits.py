"""Run limits through the HTTP API: approval_timeout discards, run_timeout fails, an
apply in progress is marked and completes. Real nats-server, real Terraform, a reaper."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from events import run as R
from infra.heartbeats import DEADLINE, Beat, Board
from services.processes.scheduler.limits import refresh
from tests.builders import api_workspace
from tests.executor_support import MAIN_TF
from tests.helpers import eventually
from tests.plane_support import (  # noqa: F401  # registers the fixtures
    Plane,
    commit,
    plane_fixture,
)

pytestmark = pytest.mark.terraform

# The apply waits until the test creates the gate file.
GATED_APPLY_TF = """
variable "gate" {}
resource "null_resource" "gated" {
  provisioner "local-exec" {
    command = "while [ ! -f ${var.gate} ]; do sleep 0.1; done"
  }
}
"""


async def workspace(
    plane: Plane, repo: Path, settings: dict[str, Any], *, reapers: int = 1, **body: Any
) -> None:
    """The workspace `net` with its own settings, and `reapers` reapers (replicas)."""
    await api_workspace(plane.http, repo, settings=settings, **body)
    for _ in range(reapers):
        replica = plane.replica(store=plane.app.store)
        await plane.stack.enter_async_context(replica.reaper(interval=0.1))


async def history(plane: Plane, run_id: str) -> list[tuple[str, str, str]]:
    """The run's events as the API shows them, all stored so far: (type, actor, at)."""
    last = (await plane.app.store.read(f"rp.run.acme.net.{run_id}"))[-1].seq
    a = await plane.http.get(
        f"/api/v1/orgs/acme/runs/{run_id}/events", headers={"RP-Min-Seq": str(last)}
    )
    assert a.status == 200, a.body
    return [(e["type"], e["actor"], e["at"]) for e in a.body["items"]]


async def test_a_run_awaiting_approval_past_its_approval_timeout_is_discarded(
    plane: Plane, repo: Path
) -> None:
    commit(repo, {"main.tf": MAIN_TF})
    await workspace(plane, repo, {"approval_timeout": 1})
    await plane.executor("e1")
    run_id = await plane.start("net")
    await plane.reaches("net", run_id, "awaiting_approval")
    run = await plane.reaches("net", run_id, "discarded")
    assert run.reason == "approval_timeout"
    [discarded] = [e for e in await plane.events("net", run_id) if isinstance(e, R.RunDiscarded)]
    [planned] = [e for e in await plane.events("net", run_id) if isinstance(e, R.PlanFinished)]
    assert discarded.actor == "reaper"
    assert (discarded.at - planned.at).total_seconds() >= 0.9
    assert ("run.discarded", "reaper") in [(t, a) for t, a, _ in await history(plane, run_id)]


async def test_queued_and_pending_runs_past_their_run_timeout_fail_with_that_reason(
    plane: Plane, repo: Path
) -> None:
    """No executor: the admitted run waits in `queued`, the next in `pending`; both fail,
    each once, though three reapers judge them at the same time."""
    commit(repo, {"main.tf": MAIN_TF})
    await workspace(plane, repo, {"run_timeout": 1}, reapers=3)
    first = await plane.start("net")
    second = await plane.start("net")
    for run_id in (first, second):
        run = await plane.reaches("net", run_id, "failed")
        assert run.reason == "run_timeout"
        assert "run_timeout of 1s" in run.error_message
        [failed] = [e for e in await plane.events("net", run_id) if isinstance(e, R.RunFailed)]
        assert failed.actor == "reaper"
        assert ("run.failed", "reaper") in [(t, a) for t, a, _ in await history(plane, run_id)]

    async def released() -> bool:
        # The workspace's release is its own append after run.failed: the read model
        # shows it once it has projected that one too.
        ws = await plane.http.get("/api/v1/orgs/acme/workspaces/net")
        assert ws.body["active_run"] is None, ws.body["active_run"]
        return True

    await eventually(released, timeout=30, what="the workspace released")


async def test_a_run_awaiting_approval_past_its_run_timeout_fails(plane: Plane, repo: Path) -> None:
    commit(repo, {"main.tf": MAIN_TF})
    await workspace(plane, repo, {"run_timeout": 4})
    await plane.executor("e1")
    run_id = await plane.start("net")
    await plane.reaches("net", run_id, "awaiting_approval")
    shown = (await plane.http.get(f"/api/v1/orgs/acme/runs/{run_id}")).body
    assert shown["owner"] is None
    assert shown["deadline"]["kind"] == "run_timeout"
    assert shown["deadline"]["at"] > shown["created_at"]
    run = await plane.reaches("net", run_id, "failed")
    assert run.reason == "run_timeout"


async def test_an_apply_past_the_run_timeout_is_marked_not_interrupted_and_completes(
    plane: Plane, repo: Path, tmp_path: Path
) -> None:
    gate = tmp_path / "applied-gate"
    commit(repo, {"main.tf": GATED_APPLY_TF})
    await workspace(plane, repo, {"run_timeout": 5}, variables={"gate": str(gate)})
    await plane.executor("e1")
    run_id = await plane.start("net")
    await plane.reaches("net", run_id, "awaiting_approval")
    await plane.approve(run_id)
    await plane.reaches("net", run_id, "applying")

    async def marked() -> R.RunLimitExceeded:
        found = [e for e in await plane.events("net", run_id) if isinstance(e, R.RunLimitExceeded)]
        assert found, "not marked yet"
        return found[0]

    mark = await eventually(marked, timeout=30, what="the limit marked")
    assert (mark.actor, mark.limit) == ("reaper", "run_timeout")
    shown = (await plane.http.get(f"/api/v1/orgs/acme/runs/{run_id}")).body
    assert shown["status"] == "applying"
    assert (shown["owner"]["executor_id"], shown["deadline"]) == ("e1", None)
    gate.write_text("go")
    run = await plane.reaches("net", run_id, "applied")
    assert run.limit_exceeded == "run_timeout"
    kinds = [t for t, _, _ in await history(plane, run_id)]
    assert kinds.count("run.limit_exceeded") == 1
    assert kinds.index("run.limit_exceeded") < kinds.index("run.apply_finished")


async def test_a_deadline_lives_on_the_board_so_a_reaper_started_later_enforces_it(
    plane: Plane, repo: Path
) -> None:
    """The deadline is derived from the run's events and kept in NATS, not in a reaper's
    memory: a reaper (with its own App) that starts after the run was queued fails it."""
    commit(repo, {"main.tf": MAIN_TF})
    await workspace(plane, repo, {"run_timeout": 1}, reapers=0)
    run_id = await plane.start("net")
    board = Board(plane.nc)

    async def marked() -> Beat:
        beat = await board.last(run_id, DEADLINE)
        assert beat is not None and beat.body.run_deadline is not None
        return beat

    beat = await eventually(marked, what="the deadline marker")
    [created] = [e for e in await plane.events("net", run_id) if isinstance(e, R.RunCreated)]
    assert beat.body.run_deadline is not None
    assert abs((beat.body.run_deadline - created.at).total_seconds() - 1) < 1
    assert (await plane.run("net", run_id)).status in ("pending", "queued")
    fresh = plane.replica(store=plane.app.store)
    await plane.stack.enter_async_context(fresh.reaper(interval=0.1))
    run = await plane.reaches("net", run_id, "failed")
    assert run.reason == "run_timeout"
    await eventually(lambda: _gone(board, run_id), what="the marker purged")


async def _gone(board: Board, run_id: str) -> bool:
    assert await board.last(run_id, DEADLINE) is None
    return True


async def test_a_refreshed_marker_is_the_same_marker_written_again(plane: Plane) -> None:
    board = Board(plane.nc)
    subj = f"rp.hb.run-x.{DEADLINE}"
    data = b'{"kind": "deadline", "org": "acme", "run_deadline": "2030-01-01T00:00:00Z"}'
    assert await board.put(subj, data)
    first = await board.last("run-x", DEADLINE)
    assert first is not None
    await refresh(board, first)
    again = await board.last("run-x", DEADLINE)
    assert again is not None and again.seq > first.seq
    assert again.body == first.body
    await refresh(board, first)  # stale news: the subject moved on, nothing is written
    last = await board.last("run-x", DEADLINE)
    assert last is not None and last.seq == again.seq
