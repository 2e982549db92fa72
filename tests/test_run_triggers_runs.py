"""Run triggers end to end: real Terraform (null provider), the real subscriber on its own
durable consumer. A's apply that changed something starts B's run, linked to A's; A's
apply that changed nothing starts none; B's approval holds unless it sets
`auto_apply_run_triggers`; a delivery handled twice (a replica killed before its ack)
starts B's run once."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from events import run as R
from infra.consumer import Consumer, Received
from infra.ids import derived_id
from services.processes.triggers.subscriber import Triggers, subscription
from tests.executor_support import git
from tests.helpers import eventually
from tests.plane_support import (  # noqa: F401  # registers the fixtures
    Plane,
    commit,
    plane_fixture,
)

pytestmark = pytest.mark.terraform

V1 = "/api/v1/orgs/acme"
TF = 'resource "null_resource" "x" {\n  triggers = { v = "%s" }\n}\n'


class Recording(Triggers):
    """The real handler, noting each event's sequence once handled (or raising the
    first time with `crash_once`: a replica that died after its creates, before its ack)."""

    def __init__(self, app: Any, *, crash_once: bool = False, hang: bool = False) -> None:
        super().__init__(app)
        self.handled: list[int] = []
        self.deliveries: dict[int, int] = {}
        self.crash_once = crash_once
        self.hang = hang  # after its creates, never return: a replica to kill
        self.hanging = asyncio.Event()

    async def handle(self, r: Received) -> None:
        await super().handle(r)
        self.deliveries[r.seq] = r.num_delivered
        ending = r.type == "run.apply_finished"
        if self.crash_once and ending and r.num_delivered == 1:
            raise RuntimeError("killed before the ack")
        if self.hang and ending:
            self.hanging.set()
            await asyncio.Event().wait()
        self.handled.append(r.seq)


def _repo(root: Path, name: str, v: str) -> Path:
    path = root / name
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    commit(path, {"main.tf": TF % v})
    return path


async def _setup(plane: Plane, tmp_path: Path, b_settings: dict[str, Any]) -> tuple[Path, Path]:
    """Workspaces a (no approval) and b (following a, with `b_settings`); an executor."""
    repo_a = _repo(tmp_path, "repo-a", "1")
    repo_b = _repo(tmp_path, "repo-b", "1")
    for name, repo in (("a", repo_a), ("b", repo_b)):
        made = await plane.http.post(
            f"{V1}/workspaces", json={"name": name, "repository": str(repo)}
        )
        assert made.status == 201, made.body
    for ws, settings in (("a", {"require_approval": False}), ("b", b_settings)):
        if settings:
            s = await plane.http.call("PATCH", f"{V1}/workspaces/{ws}/settings", json=settings)
            assert s.status == 200, s.body
    t = await plane.http.post(f"{V1}/workspaces/b/run-triggers", json={"source": "a"})
    assert t.status == 201, t.body
    await plane.executor("e1")
    return repo_a, repo_b


async def _runs_of(plane: Plane, ws: str) -> list[str]:
    envs = await plane.app.store.read(f"rp.run.acme.{ws}.*")
    return sorted({e.subject.split(".")[-1] for e in envs})


async def _handled_through(rec: Recording, plane: Plane, ws: str, run_id: str) -> None:
    """Wait until the subscriber has handled every event of the run so far."""
    last, _ = await plane.app.store.last(f"rp.run.acme.{ws}.{run_id}")

    async def probe() -> bool:
        return last in rec.handled

    await eventually(probe, timeout=30, what=f"the subscriber past {run_id}'s end")


async def test_a_changing_apply_starts_b_linked_to_it_and_a_no_change_apply_starts_nothing(
    plane: Plane, tmp_path: Path
) -> None:
    await _setup(plane, tmp_path, {})
    rec = Recording(plane.app)
    async with Consumer(plane.nc, subscription(rec), states=plane.app.states):
        first = await plane.start("a")
        done = await plane.reaches("a", first, "applied")
        assert done.apply_summary == R.PlanSummary(add=1)
        b_run = derived_id("run-trigger", first, "b")
        b = await plane.reaches("b", b_run, "awaiting_approval")  # b's approval holds
        assert b.run_type == "apply" and b.created_by == "run-trigger"
        assert b.cause is not None and b.cause.kind == "run_trigger"
        assert (b.cause.source_workspace, b.cause.source_run) == ("a", first)
        shown = await plane.http.get(f"{V1}/runs/{b_run}")
        assert shown.body["cause"]["source_run"] == first, shown.body
        await plane.approve(b_run)
        await plane.reaches("b", b_run, "applied")

        second = await plane.start("a")  # the same commit: nothing to change
        await plane.reaches("a", second, "no_changes")
        await _handled_through(rec, plane, "a", second)
        assert await _runs_of(plane, "b") == [b_run]
    assert rec.started == 1


async def test_with_auto_apply_run_triggers_b_applies_without_waiting_and_says_why(
    plane: Plane, tmp_path: Path
) -> None:
    _, repo_b = await _setup(plane, tmp_path, {"auto_apply_run_triggers": True})
    rec = Recording(plane.app)
    async with Consumer(plane.nc, subscription(rec), states=plane.app.states):
        first = await plane.start("a")
        await plane.reaches("a", first, "applied")
        b_run = derived_id("run-trigger", first, "b")
        await plane.reaches("b", b_run, "applied")
    planned = [e for e in await plane.events("b", b_run) if isinstance(e, R.PlanFinished)]
    assert len(planned) == 1
    assert planned[0].require_approval is False
    assert planned[0].approval_skipped == "auto_apply_run_triggers"
    # a run of b a person started still waits for approval
    commit(repo_b, {"main.tf": TF % "2"})
    own = await plane.start("b")
    held = await plane.reaches("b", own, "awaiting_approval")
    assert held.cause is not None and held.cause.kind == "api"


async def test_under_confirm_destructive_a_triggered_plan_that_replaces_waits_for_a_person(
    plane: Plane, tmp_path: Path
) -> None:
    """auto_apply_run_triggers with confirm_destructive: a triggered run whose plan only
    creates applies; one whose plan replaces waits (a run trigger acknowledges no
    destroy), and a person approves it acknowledging the address."""
    settings = {"auto_apply_run_triggers": True, "confirm_destructive": True}
    repo_a, repo_b = await _setup(plane, tmp_path, settings)
    rec = Recording(plane.app)
    async with Consumer(plane.nc, subscription(rec), states=plane.app.states):
        first = await plane.start("a")
        await plane.reaches("a", first, "applied")
        await plane.reaches("b", derived_id("run-trigger", first, "b"), "applied")
        commit(repo_b, {"main.tf": TF % "2"})  # b's next plan replaces null_resource.x
        commit(repo_a, {"main.tf": TF % "2"})
        second = await plane.start("a")
        await plane.reaches("a", second, "applied")
        b_run = derived_id("run-trigger", second, "b")
        held = await plane.reaches("b", b_run, "awaiting_approval")
        assert held.destructive == ["null_resource.x"]
        planned = [e for e in await plane.events("b", b_run) if isinstance(e, R.PlanFinished)]
        assert (planned[0].require_approval, planned[0].approval_skipped) == (True, "")
        ok = await plane.http.post(
            f"{V1}/runs/{b_run}/approve", json={"acknowledged": ["null_resource.x"]}
        )
        assert ok.status == 200, ok.body
        await plane.reaches("b", b_run, "applied")


async def test_a_delivery_handled_again_after_a_crash_starts_b_once(
    plane: Plane, tmp_path: Path
) -> None:
    """The first delivery of A's apply end creates B's run, then dies before its ack; the
    broker redelivers it; the second finds the run (its derived id) and makes none."""
    await _setup(plane, tmp_path, {})
    rec = Recording(plane.app, crash_once=True)
    async with Consumer(plane.nc, subscription(rec), states=plane.app.states):
        first = await plane.start("a")
        await plane.reaches("a", first, "applied")
        await _handled_through(rec, plane, "a", first)
    assert max(rec.deliveries.values()) >= 2  # it was redelivered
    assert await _runs_of(plane, "b") == [derived_id("run-trigger", first, "b")]
    assert rec.started == 1


async def test_a_replica_killed_after_its_creates_leaves_b_one_run_when_another_redoes_it(
    plane: Plane, tmp_path: Path
) -> None:
    """The first replica creates B's run and dies before it settles the event (stopped
    mid-handling: no ack, no nak, no more "in progress"); after the ack wait the broker
    hands the event to the second replica, which finds B's run and makes none."""
    await _setup(plane, tmp_path, {})
    first_replica = Recording(plane.app, hang=True)
    killed = Consumer(plane.nc, subscription(first_replica), states=plane.app.states)
    await killed.start()
    try:
        run_a = await plane.start("a")
        await plane.reaches("a", run_a, "applied")
        await asyncio.wait_for(first_replica.hanging.wait(), 60)
    finally:
        await killed.stop()
    b_run = derived_id("run-trigger", run_a, "b")
    assert await _runs_of(plane, "b") == [b_run] and first_replica.started == 1
    second_replica = Recording(plane.app)
    async with Consumer(plane.nc, subscription(second_replica), states=plane.app.states):
        await _handled_through(second_replica, plane, "a", run_a)
    assert max(second_replica.deliveries.values()) >= 2  # the redelivery
    assert second_replica.started == 0  # it found B's run
    assert await _runs_of(plane, "b") == [b_run]
