"""A drift schedule end to end, with real Terraform (the fake provider, tests/provider), a
real executor, nats-server, the HTTP API and the notifications subscriber: a thing is
applied, then edited behind Terraform's back; the schedule (made through the API) fires
a drift run with its cause, the run ends `drifted`, and `run:drifted` is delivered to
the workspace's notification configuration."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from events.run import Workspace
from executor import Executor
from services.processes.notifications.delivery import Policy
from services.processes.notifications.subscriber import serving
from services.processes.schedules.loop import ScheduleLoop, run_id_for
from services.surfaces.api import secrets as secrets_api
from tests.api_support import Http
from tests.changes_support import DRIFT_TF, applied_run, commit_files
from tests.changes_support import executor as executor  # with the fake provider
from tests.executor_support import Harness
from tests.helpers import eventually
from tests.notify_support import Receiver, nhttp_fixture  # noqa: F401  # the `nhttp` fixture

pytestmark = pytest.mark.terraform

DRIFTED = "run:drifted"

V1 = "/api/v1/orgs/acme"


async def test_a_drift_schedule_that_finds_drift_ends_drifted_and_raises_run_drifted(
    nhttp: Http, repo: Path, executor: Executor, tmp_path: Path
) -> None:
    app = nhttp.app
    h = Harness(app.store.nc, app)
    things = tmp_path / "things"
    provider = f'provider "fake" {{\n  store = "{things}"\n}}\n'
    commit_files(repo, {"main.tf": provider + DRIFT_TF})
    await h.workspace("net", Workspace(repository=str(repo)))
    await applied_run(h, "net")
    (things / "a.json").write_text(json.dumps({"id": "a", "name": "a", "value": "edited"}))

    a = await nhttp.post(
        f"{V1}/workspaces/net/schedules", json={"cron": "*/5 * * * *", "run_type": "drift"}
    )
    assert a.status == 201, a.body
    sid, first = a.body["id"], datetime.fromisoformat(a.body["next_fires"][0]["at"])
    keyring = nhttp.client.app[secrets_api.SECRETS].keyring
    policy = Policy(allow=frozenset({"loopback"}), schedule=(0.1,))
    async with Receiver() as r:
        config = {"name": "ops", "url": r.url, "triggers": [DRIFTED]}
        assert (await nhttp.post(f"{V1}/workspaces/net/notifications", json=config)).status == 201
        async with serving(app.store.nc, app, keyring, policy=policy):
            # the scheduler's loop, its clock at the first fire time (nothing waits for it)
            (fired,) = await ScheduleLoop(app).tick(first + timedelta(seconds=1))
            run_id = run_id_for(sid, first)
            assert fired.run_id == run_id  # type: ignore[union-attr]  # a ScheduleFired
            assert await app.admit_next("acme", "net") == run_id
            await h.dispatch("net", run_id, "plan")
            done = await h.reaches("net", run_id, "drifted")

            async def drifted() -> list[Any]:
                return [g.json for g in r.got if g.json["notifications"][0]["trigger"] == DRIFTED]

            (delivered,) = await eventually(drifted, what="run:drifted delivered")
    assert done.run_type == "drift" and done.cause is not None
    assert (done.cause.kind, done.cause.schedule, done.cause.fire_time) == ("schedule", sid, first)
    assert (
        delivered["run_id"] == run_id and delivered["notifications"][0]["run_status"] == "drifted"
    )
    assert delivered["runplane"]["cause"] == {
        "kind": "schedule",
        "schedule": sid,
        "fire_time": a.body["next_fires"][0]["at"],
    }
    shown = (await nhttp.get(f"{V1}/runs/{run_id}")).body
    assert shown["cause"]["kind"] == "schedule" and shown["cause"]["schedule"] == sid
    one = (await nhttp.get(f"{V1}/workspaces/net/schedules/{sid}")).body
    assert one["last_run"] == run_id
