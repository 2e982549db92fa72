"""Workspace locks through the HTTP API, with the real scheduler on a real nats-server:
runs queue but are not admitted while locked, a run already active carries on, unlocking
admits the oldest, and who may lock and unlock."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from events import run as R
from infra import streams
from infra.ids import new_id
from services.app.commands import App
from tests.api_support import Http, http_fixture  # noqa: F401  # registers `http`
from tests.bootstrap_support import Process
from tests.helpers import eventually

WS = "/api/v1/orgs/acme/workspaces/net"


@pytest.fixture
async def tokens(http: Http, app: App, process: Process) -> AsyncIterator[dict[str, str]]:
    """Org acme (a token per role) with workspace net, and a scheduler admitting runs."""
    async with process(store=app.store).scheduler():
        acme = await http.org("acme")
        await http.workspace("acme", "net")
        yield acme


async def scheduler_caught_up(nc: NATS) -> None:
    """Wait until the scheduler has handled (and acked) every event stored so far."""
    js = nc.jetstream()

    async def idle() -> bool:
        info = await js.consumer_info(streams.EVENTS, streams.SCHEDULER_CONSUMER)
        return info.num_pending == 0 and info.num_ack_pending == 0

    await eventually(idle, timeout=15, what="the scheduler to catch up")


async def status(http: Http, run_id: str) -> str:
    a = await http.get(f"/api/v1/orgs/acme/runs/{run_id}")
    assert a.status == 200, a.body
    return str(a.body["status"])


async def reaches(http: Http, run_id: str, wanted: str) -> None:
    async def probe() -> bool:
        return await status(http, run_id) == wanted

    await eventually(probe, timeout=15, what=f"run {run_id} {wanted}")


async def lock(http: Http, token: str, reason: str = "provider upgrade") -> Any:
    return await http.post(f"{WS}/lock", json={"reason": reason}, token=token)


async def test_a_locked_workspace_queues_runs_and_unlocking_admits_the_oldest_first(
    http: Http, nc: NATS, tokens: dict[str, str]
) -> None:
    op = tokens["operator"]
    a = await lock(http, op)
    assert a.status == 200, a.body
    assert a.body["lock"]["holder"] == "operator-user"
    assert a.body["lock"]["reason"] == "provider upgrade"
    assert a.body["lock"]["locked_at"].endswith("Z")
    shown = (await http.get(WS, token=tokens["viewer"])).body
    assert shown["lock"] == a.body["lock"]

    first = (await http.run("acme", "net", "plan", token=op))["id"]
    second = (await http.run("acme", "net", "plan", token=op))["id"]
    await scheduler_caught_up(nc)
    assert [await status(http, r) for r in (first, second)] == ["pending", "pending"]
    assert (await http.get(WS)).body["queue"] == [first, second]

    a = await http.post(f"{WS}/unlock", token=op)
    assert a.status == 200, a.body
    assert a.body["lock"] is None
    await reaches(http, first, "queued")
    await scheduler_caught_up(nc)
    assert await status(http, second) == "pending"
    ws = (await http.get(WS)).body
    assert (ws["active_run"], ws["queue"]) == (first, [second])


async def test_every_lock_and_unlock_is_in_the_event_history_with_who_and_when(
    http: Http, tokens: dict[str, str]
) -> None:
    assert (await lock(http, tokens["operator"], "freeze")).status == 200
    a = await http.post(f"{WS}/unlock", token=tokens["admin"])
    assert a.status == 200, a.body
    await http.api.after_write(a.seq)
    async with http.api.read.db.execute(
        "SELECT type, actor, at, data_json FROM events "
        "WHERE org = 'acme' AND workspace = 'net' AND run_id IS NULL AND type LIKE 'ws.%lock%' "
        "ORDER BY seq"
    ) as cur:
        rows = [dict(r) for r in await cur.fetchall()]
    assert [(r["type"], r["actor"]) for r in rows] == [
        ("ws.locked", "operator-user"),
        ("ws.unlocked", "admin-user"),
    ]
    assert all(r["at"].endswith("Z") for r in rows)
    assert '"reason":"freeze"' in rows[0]["data_json"]
    assert '"holder":"operator-user"' in rows[1]["data_json"]


async def test_a_lock_taken_while_a_run_is_active_does_not_stop_it(
    http: Http, nc: NATS, app: App, tokens: dict[str, str]
) -> None:
    op = tokens["operator"]
    active = (await http.run("acme", "net", "plan", token=op))["id"]
    await reaches(http, active, "queued")
    assert (await lock(http, op)).status == 200
    waiting = (await http.run("acme", "net", "plan", token=op))["id"]

    # the active run carries on to its end through the locked workspace
    lease = new_id()
    claim = R.ClaimPhase(actor="exec", phase="plan", lease_id=lease, executor_id="e")
    await app.run_command("acme", "net", active, claim)
    done = R.FinishPlan(
        actor="exec", lease_id=lease, commit="c", has_changes=False, summary=R.PlanSummary()
    )
    await app.run_command("acme", "net", active, done)
    await reaches(http, active, "no_changes")

    await scheduler_caught_up(nc)
    assert await status(http, waiting) == "pending", "freed, but locked: nothing is admitted"
    assert (await http.post(f"{WS}/unlock", token=op)).status == 200
    await reaches(http, waiting, "queued")


async def test_locking_a_locked_workspace_is_a_conflict_naming_the_holder(
    http: Http, tokens: dict[str, str]
) -> None:
    assert (await lock(http, tokens["operator"])).status == 200
    problem = (await lock(http, tokens["admin"], "mine")).problem("conflict", 409)
    assert "operator-user" in problem["detail"] and "provider upgrade" in problem["detail"]
    assert problem["current_status"] == "locked"
    # the lock is unchanged
    assert (await http.get(WS)).body["lock"]["holder"] == "operator-user"


async def test_unlocking_an_unlocked_workspace_is_a_conflict(
    http: Http, tokens: dict[str, str]
) -> None:
    problem = (await http.post(f"{WS}/unlock", token=tokens["operator"])).problem("conflict", 409)
    assert problem["current_status"] == "unlocked"


async def test_only_the_holder_or_an_org_admin_may_unlock(
    http: Http, tokens: dict[str, str]
) -> None:
    assert (await lock(http, tokens["operator"])).status == 200
    problem = (await http.post(f"{WS}/unlock", token=tokens["approver"])).problem("forbidden", 403)
    assert "operator-user" in problem["detail"] and "admin" in problem["detail"]
    assert (await http.get(WS)).body["lock"] is not None
    assert (await http.post(f"{WS}/unlock", token=tokens["admin"])).status == 200
    assert (await lock(http, tokens["approver"])).status == 200
    assert (await http.post(f"{WS}/unlock", token=tokens["approver"])).status == 200
    assert (await lock(http, tokens["operator"])).status == 200
    assert (await http.post(f"{WS}/unlock")).status == 200, "the admin token may, too"


async def test_a_viewer_may_neither_lock_nor_unlock(http: Http, tokens: dict[str, str]) -> None:
    (await lock(http, tokens["viewer"])).problem("forbidden", 403)
    assert (await lock(http, tokens["operator"])).status == 200
    (await http.post(f"{WS}/unlock", token=tokens["viewer"])).problem("forbidden", 403)


@pytest.mark.parametrize(
    ("body", "slug", "code"),
    [
        ({}, "invalid-body", 400),
        ({"reason": ""}, "invalid-body", 400),
        ({"reason": "x" * 1025}, "invalid-body", 400),
        ({"reason": "x", "until": "tomorrow"}, "invalid-body", 400),
        ({"reason": "   "}, "invalid-command", 422),
    ],
    ids=["missing", "empty", "too-long", "unknown-field", "blank"],
)
async def test_a_lock_needs_a_reason_of_1_to_1024_characters(
    http: Http, tokens: dict[str, str], body: dict[str, Any], slug: str, code: int
) -> None:
    (await http.post(f"{WS}/lock", json=body, token=tokens["operator"])).problem(slug, code)
    assert (await http.get(WS)).body["lock"] is None
    assert (await lock(http, tokens["operator"], "x" * 1024)).status == 200


async def test_another_orgs_token_and_a_missing_workspace_are_not_found(
    http: Http, tokens: dict[str, str]
) -> None:
    beta = await http.org("beta")
    await http.workspace("beta", "net")
    (await lock(http, beta["admin"])).problem("not-found", 404)
    (await http.post(f"{WS}/unlock", token=beta["admin"])).problem("not-found", 404)
    missing = "/api/v1/orgs/acme/workspaces/nope"
    a = await http.post(f"{missing}/lock", json={"reason": "r"}, token=tokens["operator"])
    a.problem("not-found", 404)
    (await http.post(f"{missing}/unlock", token=tokens["operator"])).problem("not-found", 404)
    assert (await http.get(WS)).body["lock"] is None
