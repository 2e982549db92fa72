"""The end of a phase's log (ETX) reaches a held read when the phase ends, not at the
read's next look at the run (services/surfaces/tfe/logs.py): the CLI's `terraform plan` ends that
much sooner (it was up to 0.5 s, 0.25 s on average, of every remote plan)."""

from __future__ import annotations

import asyncio

import pytest
from yarl import URL

from infra.steplogs import log_subject
from services.surfaces.tfe import logs
from tests.helpers import eventually
from tests.tfe_support import Tfe, new_run, tfe_fixture, uploaded

__all__ = ["tfe_fixture"]


async def test_a_held_log_read_answers_etx_as_the_phase_ends(
    tfe: Tfe, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read held at the log's end, with its looks at the run 30 s apart, answers ETX
    within seconds of the run's cancel: the run's own event wakes it."""
    monkeypatch.setattr(logs, "STATUS_EVERY_S", 30.0)
    monkeypatch.setattr(logs, "HOLD_S", 30.0)
    await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    cv, _ = await uploaded(tfe, ws_id)
    run = (await new_run(tfe, ws_id, cv)).body["data"]
    _, _, run_id = run["id"].removeprefix("run-").split(".")
    plan_id = run["relationships"]["plan"]["data"]["id"]
    plan = await tfe.tfe("GET", f"/api/v2/plans/{plan_id}")
    url = URL(plan.body["data"]["attributes"]["log-read-url"])
    reading = asyncio.create_task(tfe.raw(f"{url.path}?offset=1&limit=1024"))
    nc = tfe.app.store.nc
    subject = log_subject(run_id, "plan", "*")

    async def held() -> bool:
        return any(sub.subject == subject for sub in nc._subs.values())

    await eventually(held, what="the log read to wait")
    assert not reading.done()
    canceled = await tfe.tfe("POST", f"/api/v2/runs/{run['id']}/actions/cancel", json={})
    assert canceled.status in (200, 202), canceled
    status, raw = await asyncio.wait_for(reading, timeout=10)
    assert (status, raw) == (200, b"\x03")
