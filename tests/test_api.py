"""The HTTP API end to end: real nats-server, real App, real projector, real aiohttp server.

Happy paths, read-your-writes, listing and the run lifecycle through the API. Errors,
authentication, isolation and the OpenAPI document are in test_api_errors.py.
"""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
import pytest
import structlog
import structlog.testing
from aiohttp.test_utils import TestClient, TestServer

from events.run import (
    ApproveRun,
    ClaimPhase,
    FinishPlan,
    FinishStep,
    PlanSummary,
    StartStep,
)
from services.app.commands import App
from services.app.execute import Result
from services.surfaces.api import render
from services.surfaces.api.app import build_app
from tests.api_support import ADMIN_TOKEN, Http, http_fixture  # noqa: F401  # registers the `http` fixture

V1 = "/api/v1"
STEPS = ("checkout", "init", "plan")


async def _awaiting_approval(app: App, org: str, ws: str, run_id: str) -> None:
    """Drive a run to awaiting_approval the way the scheduler and an executor would."""
    assert await app.admit_next(org, ws) == run_id
    lease = "lease-1"
    await app.run_command(
        org,
        ws,
        run_id,
        ClaimPhase(actor="executor", phase="plan", lease_id=lease, executor_id="exec-1"),
    )
    for step in STEPS:
        start = StartStep(actor="executor", lease_id=lease, step=step)
        await app.run_command(org, ws, run_id, start)
        finish = FinishStep(
            actor="executor", lease_id=lease, step=step, ok=True, started_at=datetime.now(UTC)
        )
        await app.run_command(org, ws, run_id, finish)
    await app.run_command(
        org,
        ws,
        run_id,
        FinishPlan(
            actor="executor",
            lease_id=lease,
            commit="abc123",
            has_changes=True,
            summary=PlanSummary(add=2, change=1, destroy=0),
            plan_digest="d1",
        ),
    )


async def test_healthz_is_liveness_and_readyz_follows_ready(http: Http) -> None:
    """/healthz and /readyz answer without a token; /healthz 200 whatever `ready` says,
    /readyz a 503 not-ready problem while `ready` (the components of `up`) is false."""
    a = await http.get("/healthz", token=None)
    assert (a.status, a.body) == (200, {"status": "ok"})
    a = await http.get("/readyz", token=None)
    assert (a.status, a.body) == (200, {"status": "ready"})
    ready = {"v": False}
    not_ready = build_app(
        app=http.app, projector=http.api.projector, admin_token="x", ready=lambda: ready["v"]
    )
    async with TestClient(TestServer(not_ready)) as client:
        async with client.get("/readyz") as resp:
            assert resp.status == 503
            assert resp.content_type == "application/problem+json"
            assert (await resp.json())["type"].endswith("/not-ready")
        async with client.get("/healthz") as resp:
            assert resp.status == 200
        ready["v"] = True
        async with client.get("/readyz") as resp:
            assert resp.status == 200


async def test_org_token_workspace_and_run_are_created(http: Http) -> None:
    """The admin token makes an org and a token; the org token makes a workspace and a run."""
    a = await http.post(f"{V1}/orgs", json={"name": "acme"})
    assert a.status == 201 and a.body["name"] == "acme"
    assert a.headers["Location"] == f"{V1}/orgs/acme" and a.seq > 0

    a = await http.post(f"{V1}/orgs/acme/tokens", json={})
    assert a.status == 201
    token = a.body
    assert token["token"].startswith("rp_") and token["token_id"]
    assert (token["user"], token["role"], token["org"]) == ("admin", "admin", "acme")

    ws_body = {
        "name": "net",
        "repository": "/src/net",
        "branch": "dev",
        "directory": "envs/p",
        "variables": {"n": "1"},
    }
    a = await http.post(f"{V1}/orgs/acme/workspaces", json=ws_body, token=token["token"])
    assert a.status == 201, a.body
    for key, value in ws_body.items():
        assert a.body[key] == value
    assert a.body["org"] == "acme" and a.body["created_by"] == "admin"

    a = await http.post(
        f"{V1}/orgs/acme/workspaces/net/runs",
        json={"type": "apply", "message": "first"},
        token=token["token"],
    )
    assert a.status == 201, a.body
    run = a.body
    assert (run["status"], run["type"], run["message"]) == ("pending", "apply", "first")
    assert (run["org"], run["workspace"], run["created_by"]) == ("acme", "net", "admin")
    assert a.headers["Location"] == f"{V1}/orgs/acme/runs/{run['id']}"


async def test_every_write_is_readable_at_once(http: Http) -> None:
    """A write answers with RP-Seq only once the projection holds it: reading back right
    after sees the write, with no polling."""
    tokens = await http.org("acme")
    assert (await http.get(f"{V1}/orgs/acme")).status == 200
    await http.workspace("acme", "net")
    assert (await http.get(f"{V1}/orgs/acme/workspaces/net")).status == 200
    for _ in range(5):
        run = await http.run("acme", "net", token=tokens["operator"])
        a = await http.get(f"{V1}/orgs/acme/runs/{run['id']}", token=tokens["viewer"])
        assert a.status == 200 and a.body["id"] == run["id"]
        canceled = await http.post(
            f"{V1}/orgs/acme/runs/{run['id']}/cancel", token=tokens["operator"]
        )
        assert canceled.status == 200 and canceled.body["status"] == "canceled"
        a = await http.get(f"{V1}/orgs/acme/runs/{run['id']}")
        assert a.body["status"] == "canceled"
        assert http.api.projector.seq >= canceled.seq


async def test_min_seq_waits_for_the_projection_or_answers_stale_read(http: Http) -> None:
    """RP-Min-Seq within the projection answers; past the stream's end it is a bounded
    503 stale-read; a malformed one is a 400."""
    await http.org("acme")
    created = await http.post(f"{V1}/orgs", json={"name": "beta"})
    a = await http.get(f"{V1}/orgs/beta", headers={"RP-Min-Seq": str(created.seq)})
    assert a.status == 200
    http.api.read_wait = 0.2
    a = await http.get(f"{V1}/orgs/beta", headers={"RP-Min-Seq": str(created.seq + 1000)})
    assert a.problem("stale-read", 503)["projected_seq"] >= created.seq
    assert a.headers["Retry-After"] == "1"
    a = await http.get(f"{V1}/orgs/beta", headers={"RP-Min-Seq": "soon"})
    a.problem("invalid-header", 400)


async def test_a_token_issued_without_the_api_is_accepted_at_once(http: Http) -> None:
    """A token fresh from another replica is found by catching up with the stream."""
    await http.org("acme")
    token, _ = await http.app.issue_token("acme", "bob", "viewer", "admin")
    a = await http.get(f"{V1}/orgs/acme", token=token)
    assert a.status == 200 and a.body["name"] == "acme"


async def test_runs_are_listed_and_filtered(http: Http) -> None:
    """Org and workspace run lists filter by status and workspace, page with limit and
    before, and refuse unknown statuses, limits out of range and unknown parameters."""
    await http.org("acme")
    await http.workspace("acme", "net")
    await http.workspace("acme", "dns")
    net = [await http.run("acme", "net") for _ in range(3)]
    dns = await http.run("acme", "dns", "plan")
    await http.post(f"{V1}/orgs/acme/runs/{net[2]['id']}/cancel")

    async def ids(query: str, path: str = f"{V1}/orgs/acme/runs") -> set[str]:
        a = await http.get(path + query)
        assert a.status == 200, a.body
        return {r["id"] for r in a.body["items"]}

    assert await ids("") == {r["id"] for r in [*net, dns]}
    assert await ids("?status=canceled") == {net[2]["id"]}
    assert await ids("?status=pending,canceled&workspace=net") == {r["id"] for r in net}
    assert await ids("?workspace=dns") == {dns["id"]}
    assert await ids("", f"{V1}/orgs/acme/workspaces/net/runs") == {r["id"] for r in net}
    assert await ids("?status=pending", f"{V1}/orgs/acme/workspaces/net/runs") == {
        net[0]["id"],
        net[1]["id"],
    }
    first = await http.get(f"{V1}/orgs/acme/runs?limit=3")
    assert len(first.body["items"]) == 3 and first.body["next"] == first.body["items"][-1]["id"]
    rest = await http.get(f"{V1}/orgs/acme/runs?limit=3&before={first.body['next']}")
    assert len(rest.body["items"]) == 1 and rest.body["next"] is None
    assert [r["id"] for r in first.body["items"] + rest.body["items"]] == [
        r["id"] for r in (await http.get(f"{V1}/orgs/acme/runs")).body["items"]
    ]
    for bad in ("?status=done", "?limit=0", "?limit=x", "?limit=²", "?limit=100000", "?colour=red"):
        (await http.get(f"{V1}/orgs/acme/runs{bad}")).problem("invalid-query", 400)
    (await http.get(f"{V1}/orgs/acme/runs?workspace=No")).problem("invalid-id", 422)

    a = await http.get(f"{V1}/orgs/acme/workspaces")
    assert {w["name"] for w in a.body["items"]} == {"net", "dns"}


async def test_a_listed_run_is_its_get_and_a_summary_leaves_out_what_it_says(
    http: Http,
) -> None:
    """The list shows each run as its GET does (`fields=full`, the default): the same
    keys and values, empty lists as `[]`, never missing (`policies`, `steps`, `owner`);
    `fields=summary` leaves out exactly what RunSummary does not name."""
    await http.org("acme")
    await http.workspace("acme", "net")
    waiting = await http.run("acme", "net")
    await _awaiting_approval(http.app, "acme", "net", waiting["id"])
    pending = await http.run("acme", "net")
    canceled = await http.run("acme", "net", "plan")
    await http.post(f"{V1}/orgs/acme/runs/{canceled['id']}/cancel")
    listed = (await http.get(f"{V1}/orgs/acme/runs")).body["items"]
    assert [r["id"] for r in listed] == [canceled["id"], pending["id"], waiting["id"]]
    for row in listed:
        got = (await http.get(f"{V1}/orgs/acme/runs/{row['id']}")).body
        assert row == got
        assert row["policies"] == [] and row["overridden"] == []
    assert [s["status"] for s in listed[2]["steps"]][:2] == ["done", "done"]

    summary = (await http.get(f"{V1}/orgs/acme/runs?fields=summary")).body["items"]
    spec = (await http.get(f"{V1}/openapi.json")).body["components"]["schemas"]
    assert set(summary[0]) == set(spec["RunSummary"]["properties"])
    assert set(listed[0]) == set(spec["Run"]["properties"])
    assert {k: listed[0][k] for k in summary[0]} == summary[0]
    (await http.get(f"{V1}/orgs/acme/runs?fields=some")).problem("invalid-query", 400)


async def test_approving_a_pending_run_conflicts_with_its_status(http: Http) -> None:
    """Approve needs awaiting_approval: on a pending run it is a 409 with current_status."""
    await http.org("acme")
    await http.workspace("acme", "net")
    run = await http.run("acme", "net")
    a = await http.post(f"{V1}/orgs/acme/runs/{run['id']}/approve", json={"acknowledged": []})
    assert a.problem("conflict", 409)["current_status"] == "pending"


async def test_a_pending_run_is_canceled(http: Http) -> None:
    """Cancel moves a pending run to canceled, with the caller's reason."""
    tokens = await http.org("acme")
    await http.workspace("acme", "net")
    run = await http.run("acme", "net")
    a = await http.post(
        f"{V1}/orgs/acme/runs/{run['id']}/cancel",
        json={"reason": "wrong branch"},
        token=tokens["operator"],
    )
    assert a.status == 200, a.body
    assert (a.body["status"], a.body["reason"]) == ("canceled", "wrong branch")
    again = await http.post(f"{V1}/orgs/acme/runs/{run['id']}/cancel")
    assert again.problem("conflict", 409)["current_status"] == "canceled"


async def test_a_run_awaiting_approval_is_discarded_and_its_history_kept(http: Http) -> None:
    """Discard ends a run awaiting approval; /events lists its history in order, /steps
    its steps."""
    tokens = await http.org("acme")
    await http.workspace("acme", "net")
    run = await http.run("acme", "net", token=tokens["operator"])
    await _awaiting_approval(http.app, "acme", "net", run["id"])
    path = f"{V1}/orgs/acme/runs/{run['id']}"
    seq = await http.app.store.last_seq()
    a = await http.get(path, headers={"RP-Min-Seq": str(seq)})
    assert a.body["status"] == "awaiting_approval" and a.body["commit"] == "abc123"

    a = await http.post(f"{path}/discard", json={"reason": "not today"}, token=tokens["approver"])
    assert a.status == 200, a.body
    assert (a.body["status"], a.body["reason"]) == ("discarded", "not today")

    a = await http.get(f"{path}/events", token=tokens["viewer"])
    assert a.status == 200
    events = a.body["items"]
    steps = [t for _ in STEPS for t in ("run.step_started", "run.step_finished")]
    assert [e["type"] for e in events] == [
        "run.created",
        "run.queued",
        "run.phase_started",
        *steps,
        "run.plan_finished",
        "run.discarded",
    ]
    assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
    assert all(set(e) >= {"seq", "type", "at", "actor", "data"} for e in events)
    actors = ["operator-user", "scheduler", *["executor"] * (len(steps) + 2), "approver-user"]
    assert [e["actor"] for e in events] == actors
    assert events[-1]["data"]["reason"] == "not today"
    assert [e["data"]["step"] for e in events if e["type"] == "run.step_started"] == list(STEPS)
    for e in events:
        assert datetime.fromisoformat(e["at"]).tzinfo is not None

    a = await http.get(f"{path}/steps", token=tokens["viewer"])
    assert a.status == 200
    assert [(s["phase"], s["step"], s["status"]) for s in a.body["items"]] == [
        ("plan", step, "ok") for step in STEPS
    ]
    assert all(s["duration_ms"] >= 0 for s in a.body["items"])


async def test_a_run_awaiting_approval_is_approved(http: Http) -> None:
    """Approve records who approved and what they acknowledged; the run waits for apply."""
    tokens = await http.org("acme")
    await http.workspace("acme", "net")
    run = await http.run("acme", "net")
    await _awaiting_approval(http.app, "acme", "net", run["id"])
    a = await http.post(
        f"{V1}/orgs/acme/runs/{run['id']}/approve",
        json={"acknowledged": ["aws_instance.web"]},
        token=tokens["approver"],
    )
    assert a.status == 200, a.body
    assert a.body["status"] == "apply_queued"
    assert a.body["approved_by"] == "approver-user"
    assert a.body["acknowledged"] == ["aws_instance.web"]


async def test_duplicates_and_unknown_targets_are_refused(http: Http) -> None:
    """A second org or workspace of a name is 409 already-exists; a run on a missing
    workspace is 404; an unknown run type is 422 invalid-command."""
    await http.org("acme")
    (await http.post(f"{V1}/orgs", json={"name": "acme"})).problem("already-exists", 409)
    await http.workspace("acme", "net")
    a = await http.post(f"{V1}/orgs/acme/workspaces", json={"name": "net", "repository": "r"})
    a.problem("already-exists", 409)
    a = await http.post(f"{V1}/orgs/acme/workspaces/nope/runs", json={"type": "plan"})
    a.problem("not-found", 404)
    a = await http.post(f"{V1}/orgs/acme/workspaces/net/runs", json={"type": "yolo"})
    a.problem("invalid-command", 422)
    a = await http.post(f"{V1}/orgs/acme/tokens", json={"role": "owner"})
    a.problem("invalid-command", 422)


async def test_the_fallback_rendering_equals_the_projection(http: Http) -> None:
    """When the projection lags, a command answers from its own result: that rendering
    equals what the projection gives, but for `seq` (the batch's last, an upper bound)."""
    await http.org("acme")
    await http.workspace("acme", "net")

    async def same(result: Result) -> None:
        path = f"{V1}/orgs/acme/runs/{result.state.run_id}"
        projected = (await http.get(path, headers={"RP-Min-Seq": str(result.seq)})).body
        rendered = msgspec.json.decode(msgspec.json.encode(render.run(result.state, result.seq)))
        assert rendered.pop("seq") >= projected.pop("seq")
        assert rendered == projected

    created = await http.app.create_run("acme", "net", "apply", "alice", "m")
    await same(created)
    run_id = created.state.run_id
    await _awaiting_approval(http.app, "acme", "net", run_id)
    await same(await http.app.run_command("acme", None, run_id, ApproveRun(actor="bob")))
    org = await http.app.load_org("acme")
    assert render.org(org.state, "admin") == (await http.get(f"{V1}/orgs/acme")).body
    ws = await http.app.load_ws("acme", "net")
    projected = (await http.get(f"{V1}/orgs/acme/workspaces/net")).body
    assert render.workspace(ws.state, "admin") == projected


async def test_org_admin_token_is_not_the_superuser(http: Http) -> None:
    """Only the admin token creates organizations: an org's admin token gets 403."""
    tokens = await http.org("acme")
    a = await http.post(f"{V1}/orgs", json={"name": "other"}, token=tokens["admin"])
    a.problem("forbidden", 403)
    assert ADMIN_TOKEN not in str(a.body)


async def test_a_write_answers_from_its_own_result_when_the_projection_lags(
    http: Http, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A projection that misses the bound does not fail the write: the answer renders the
    command's result, still with RP-Seq, so the client can read it back later."""
    await http.org("acme")
    await http.workspace("acme", "net")

    async def lagging(seq: int) -> bool:
        return False

    monkeypatch.setattr(http.api, "after_write", lagging)
    a = await http.post(f"{V1}/orgs/acme/workspaces/net/runs", json={"type": "plan"})
    assert a.status == 201 and a.seq > 0
    assert (a.body["status"], a.body["type"], a.body["workspace"]) == ("pending", "plan", "net")
    a = await http.post(f"{V1}/orgs/acme/runs/{a.body['id']}/cancel")
    assert a.status == 200 and a.body["status"] == "canceled"
    a = await http.post(f"{V1}/orgs/acme/workspaces", json={"name": "dns", "repository": "r"})
    assert a.status == 201 and a.body["name"] == "dns" and a.body["repository"] == "r"


async def test_each_request_logs_one_line_with_its_ids(http: Http) -> None:
    """One summary line per request: method, path, status, duration, the caller, and the
    org and run bound."""
    await http.org("acme")
    old = structlog.get_config()
    capture = structlog.testing.LogCapture()
    structlog.configure(processors=[structlog.contextvars.merge_contextvars, capture])
    try:
        await http.get(f"{V1}/orgs/acme/runs/nothing-here")
    finally:
        structlog.configure(**old)
    lines = [e for e in capture.entries if e["event"] == "request"]
    assert len(lines) == 1
    line = lines[0]
    assert (line["method"], line["status"], line["org"], line["run_id"]) == (
        "GET",
        404,
        "acme",
        "nothing-here",
    )
    assert line["path"] == f"{V1}/orgs/acme/runs/nothing-here" and line["duration_ms"] >= 0
    assert line["user"] == "admin"
