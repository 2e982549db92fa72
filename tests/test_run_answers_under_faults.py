"""A run's answers while NATS or the projection misbehave (found by the chaos suite,
tests/reliability/test_chaos.py):

- a GET never shows a phase running with neither owner nor deadline because the heartbeat
  board moved on before this api's projection did (after a restart of nats-server the
  projection lags behind the scheduler, which purges an ended phase's entry at once);
- a create whose append landed is answered 201 even if reading the board back fails.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from events import run as R
from infra.heartbeats import Board, BoardError, subject
from projections import projector as projector_module
from projections.batch import apply_batch
from services.app.commands import App
from services.surfaces.api import runs as runs_api
from tests.api_support import Http, http_fixture  # noqa: F401  # registers the `http` fixture
from tests.builders import queued_run
from tests.reaper_support import ORG, beat, claim, workspace


async def test_a_phase_that_just_ended_is_answered_from_the_caught_up_projection(
    http: Http, app: App, nc: NATS, monkeypatch: pytest.MonkeyPatch
) -> None:
    await workspace(app, "net")
    run_id = await queued_run(app, "net")
    lease = await claim(app, "net", run_id)
    board = Board(nc)
    await beat(board, "net", run_id, lease, 600)
    path = f"/api/v1/orgs/{ORG}/runs/{run_id}"
    seen = await http.get(path, headers={"RP-Min-Seq": str(await app.store.last_seq())})
    assert (seen.body["status"], seen.body["owner"]["lease_id"]) == ("planning", lease)

    # The projection stalls (as it does while it reconnects) ...
    apply, gate = apply_batch, asyncio.Event()  # the one the projector imported

    async def stalled(*args: Any, **kw: Any) -> Any:
        await gate.wait()
        return await apply(*args, **kw)

    monkeypatch.setattr(projector_module, "apply_batch", stalled)
    # ... while the phase ends and the scheduler purges its board entry.
    fail = R.FailRun(actor="executor:t", lease_id=lease, reason="plan_failed", message="boom")
    await app.run_command(ORG, "net", run_id, fail)
    await board.purge(subject(run_id, "plan"))

    answer = asyncio.create_task(http.get(path))
    await asyncio.sleep(0.3)
    gate.set()
    shown = (await answer).body
    assert (shown["status"], shown["owner"], shown["deadline"]) == ("failed", None, None), shown


async def test_an_open_run_with_no_limits_and_no_phase_is_answered_without_waiting(
    http: Http, app: App
) -> None:
    """Pending or awaiting approval with no limits: no owner and no deadline is the truth."""
    await workspace(app, "net")
    run_id = str((await app.create_run(ORG, "net", "apply", "alice")).state.run_id)
    seq = await app.store.last_seq()
    shown = await http.get(f"/api/v1/orgs/{ORG}/runs/{run_id}", headers={"RP-Min-Seq": str(seq)})
    assert (shown.body["status"], shown.body["owner"], shown.body["deadline"]) == (
        "pending",
        None,
        None,
    )


async def test_a_create_that_landed_is_answered_201_though_its_liveness_cannot_be_read(
    http: Http, app: App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NATS went away right after the append (the chaos suite killed it): reading the
    heartbeat board for the answer fails, yet the run exists. An error answer would
    invite a retry that creates a second run: it is answered from the command's result."""
    await workspace(app, "net")

    async def board_gone(*_: Any) -> Any:
        raise BoardError("reading a heartbeat timed out")

    monkeypatch.setattr(runs_api, "liveness", board_gone)
    created = await http.post(f"/api/v1/orgs/{ORG}/workspaces/net/runs", json={"type": "apply"})
    assert created.status == 201, created.body
    assert created.body["status"] == "pending"
    stored = await app.load_run(ORG, "net", created.body["id"])
    assert stored.state.status == R.Status.PENDING
    # A read that cannot reach the board says so: 503, retry; not an internal error.
    shown = await http.get(f"/api/v1/orgs/{ORG}/runs/{created.body['id']}")
    shown.problem("unavailable", 503)
