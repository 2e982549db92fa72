"""Retention with a real executor and Terraform (issue 25, item 4, as the issue's check
does it): the organization keeps logs 0 days; the scheduler's retention loop (the one
`runplane scheduler` runs, from the composition root) removes an applied run's stored
logs while its row, steps and events stay, and a run awaiting approval keeps its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from events import folder as fo
from events.run import Workspace
from executor import Executor
from services.processes.retention import stored_logs
from services.root.bootstrap import Plane
from tests.api_support import Http, http_fixture  # noqa: F401  # `http`
from tests.executor_support import Harness
from tests.helpers import eventually
from tests.logs_support import harness_fixture, talking_run  # noqa: F401  # `h`

pytestmark = pytest.mark.terraform

V1 = "/api/v1/orgs/acme"


async def logs(http: Http, run_id: str) -> list[Any]:
    a = await http.get(f"{V1}/runs/{run_id}/logs")
    assert a.status == 200, a.body
    return list(a.body["items"])


async def test_an_applied_runs_log_goes_after_0_days_and_an_awaiting_runs_stays(
    http: Http, h: Harness, repo: Path, executor: Executor, system: Plane, nc: NATS, tmp_path: Path
) -> None:
    """After the scheduler's pass: the applied run's logs are 410 `log-removed`, its
    answer says when, its five steps (the apply warm: warm, apply) and every event
    answer as before plus `run.log_pruned`; the run awaiting approval still reads every
    plan line."""
    gate = tmp_path / "gate"
    gate.touch()
    done = await talking_run(h, repo, gate, ws="net")
    await h.approve("net", done)
    await h.reaches("net", done, "applied")
    await h.workspace("other", Workspace(repository=str(repo), variables={"gate": str(gate)}))
    waiting = await h.start_run("other")
    await h.reaches("other", waiting, "awaiting_approval")

    async def stored() -> bool:
        by_run = await stored_logs(nc)
        return len(by_run.get(done, [])) == 5 and len(by_run.get(waiting, [])) == 3

    await eventually(stored, what="both runs' logs stored")
    assert any("end-42" in i["text"] for i in await logs(http, done))
    before = (await http.get(f"{V1}/runs/{done}/events")).body["items"]
    kept = await logs(http, waiting)
    changes = {"log_retention_days": 0}
    await system.app.org_command("acme", fo.SetOrgSettings(actor="admin", changes=changes))

    # (GETs race the passes, as they did when a read that found an object gone halfway
    # answered a 500 into its 200 and hung: the objects go once the grace is over)
    async with system.retention(interval=0.2, grace=1.0):

        async def removed() -> dict[str, Any]:
            a = await http.get(f"{V1}/runs/{done}/logs")
            assert a.status == 410, a.body
            return a.problem("log-removed", 410)

        problem = await eventually(removed, what="the applied run's log removed")

        async def emptied() -> bool:
            return sorted(await stored_logs(nc)) == [waiting]

        await eventually(emptied, what="the applied run's objects deleted after the grace")
    run = (await http.get(f"{V1}/runs/{done}")).body
    assert run["status"] == "applied" and run["log_removed_at"]
    assert problem["detail"] == f"log removed by retention on {run['log_removed_at'][:10]}"
    steps = (await http.get(f"{V1}/runs/{done}/steps")).body["items"]
    assert len(steps) == 5 and all(s["status"] == "ok" for s in steps)
    after = (await http.get(f"{V1}/runs/{done}/events")).body["items"]
    assert after[: len(before)] == before
    assert [e["type"] for e in after[len(before) :]] == ["run.log_pruned"]
    assert await logs(http, waiting) == kept and kept
