"""Inherited settings through the HTTP API: organization -> nested folders -> workspace,
each effective value with its origin; null unsets; bad patches are 422 with every reason;
other organizations see nothing; viewers may read but not write; an admitted run records
the effective settings it runs under. Real nats-server, real projector, real git."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from events.settings import SPECS
from tests.api_support import Answer, Http, http_fixture  # noqa: F401  # the fixture
from tests.helpers import eventually
from tests.plane_support import (  # noqa: F401  # registers the fixtures
    Plane,
    commit,
    plane_fixture,
)

ORG = "/api/v1/orgs/acme"
WS = ORG + "/workspaces/net"


async def _patch(http: Http, path: str, body: Any, **kw: Any) -> Answer:
    return await http.call("PATCH", path, json=body, **kw)


async def _three_levels(http: Http) -> dict[str, str]:
    """acme: org sets confirm_destructive; folder platform sets run_timeout; its child
    folder network overrides it; workspace net (in network) sets require_approval."""
    tokens = await http.org("acme")
    a = await http.post(ORG + "/folders", json={"name": "platform", "parent": None})
    assert a.status == 201, a.body
    assert a.headers["Location"] == ORG + "/folders/platform"
    a = await http.post(ORG + "/folders", json={"name": "network", "parent": "platform"})
    assert a.status == 201, a.body
    assert a.body["path"] == ["platform", "network"] and a.body["parent"] == "platform"
    await http.workspace("acme", "net", folder="network")
    for path, body in (
        (ORG + "/settings", {"confirm_destructive": True}),
        (ORG + "/folders/platform/settings", {"run_timeout": 3600}),
        (ORG + "/folders/network/settings", {"run_timeout": 900}),
        (WS + "/settings", {"require_approval": False}),
    ):
        a = await _patch(http, path, body)
        assert a.status == 200, a.body
        assert a.seq > 0
    return tokens


async def test_each_effective_setting_shows_the_level_it_comes_from(http: Http) -> None:
    """The workspace GET answers, as every level does, its own `settings` and every
    `effective` setting, each with its origin: org, the innermost folder that sets it,
    the workspace itself, or the default."""
    tokens = await _three_levels(http)
    a = await http.get(WS + "/settings", token=tokens["viewer"])
    assert a.status == 200, a.body
    assert (a.body["name"], a.body["folder"]) == ("net", "network")
    assert a.body["settings"]["require_approval"] is False
    effective = a.body["effective"]
    assert effective["confirm_destructive"] == {"value": True, "origin": "org"}
    assert effective["run_timeout"] == {"value": 900, "origin": "folder:network"}
    assert effective["require_approval"] == {"value": False, "origin": "workspace"}
    assert effective["four_eyes"] == {"value": False, "origin": "default"}
    assert effective["approvers"] == {"value": [], "origin": "default"}
    assert len(effective) == len(SPECS)  # every setting, set or not

    org = (await http.get(ORG + "/settings")).body
    assert org["settings"] == {"confirm_destructive": True}
    assert org["effective"]["run_timeout"] == {"value": 0, "origin": "default"}
    platform = (await http.get(ORG + "/folders/platform/settings")).body
    assert platform["settings"] == {"run_timeout": 3600}
    assert platform["effective"]["run_timeout"] == {"value": 3600, "origin": "folder:platform"}
    assert platform["effective"]["confirm_destructive"]["origin"] == "org"
    folders = (await http.get(ORG + "/folders", token=tokens["viewer"])).body["items"]
    assert [(f["name"], f["parent"]) for f in folders] == [
        ("platform", None),
        ("network", "platform"),
    ]


async def test_null_unsets_a_value_at_its_level_and_the_outer_one_shows_through(
    http: Http,
) -> None:
    await _three_levels(http)
    a = await _patch(http, ORG + "/folders/network/settings", {"run_timeout": None})
    assert a.status == 200, a.body
    assert a.body["settings"] == {}
    a = await _patch(http, WS + "/settings", {"require_approval": None, "four_eyes": True})
    assert "require_approval" not in a.body["settings"]
    assert a.body["settings"]["four_eyes"] is True
    assert a.body["effective"]["run_timeout"] == {"value": 3600, "origin": "folder:platform"}
    assert a.body["effective"]["require_approval"] == {"value": True, "origin": "default"}
    assert a.body["effective"]["four_eyes"] == {"value": True, "origin": "workspace"}
    got = (await http.get(WS + "/settings")).body
    assert got == a.body


async def test_unknown_settings_and_bad_values_are_refused_with_every_reason(
    http: Http,
) -> None:
    await _three_levels(http)
    bad = {"nope": 1, "run_timeout": -1, "approvers": ["Not A Name"], "four_eyes": "yes"}
    for path in (ORG + "/settings", ORG + "/folders/platform/settings", WS + "/settings"):
        body = (await _patch(http, path, bad)).problem("invalid-command", 422)
        assert len(body["reasons"]) == 4, body
        for word in ("'nope'", "run_timeout", "approvers", "four_eyes"):
            assert word in body["detail"]
        (await _patch(http, path, {})).problem("invalid-command", 422)
        (await _patch(http, path, [1])).problem("invalid-body", 400)
    after = (await http.get(WS + "/settings")).body
    assert after["effective"]["run_timeout"] == {"value": 900, "origin": "folder:network"}


async def test_missing_folders_and_workspaces_and_duplicates_are_refused(http: Http) -> None:
    await _three_levels(http)
    (await http.get(ORG + "/folders/nope/settings")).problem("not-found", 404)
    (await _patch(http, ORG + "/folders/nope/settings", {"four_eyes": True})).problem(
        "not-found", 404
    )
    (await http.get(ORG + "/workspaces/nope/settings")).problem("not-found", 404)
    (await http.post(ORG + "/folders", json={"name": "x", "parent": "nope"})).problem(
        "not-found", 404
    )
    (await http.post(ORG + "/folders", json={"name": "network"})).problem("already-exists", 409)
    (await http.post(ORG + "/folders", json={"name": "Bad Name"})).problem("invalid-id", 422)
    body = {"name": "lost", "repository": "r", "folder": "nope"}
    (await http.post(ORG + "/workspaces", json=body)).problem("not-found", 404)
    (await http.get("/api/v1/orgs/ghost/settings")).problem("not-found", 404)


async def test_another_organization_sees_none_of_it(http: Http) -> None:
    await _three_levels(http)
    beta = await http.org("beta")
    for method, path in (
        ("GET", ORG + "/settings"),
        ("PATCH", ORG + "/settings"),
        ("GET", ORG + "/folders"),
        ("POST", ORG + "/folders"),
        ("GET", ORG + "/folders/platform/settings"),
        ("PATCH", ORG + "/folders/platform/settings"),
        ("GET", WS + "/settings"),
        ("PATCH", WS + "/settings"),
    ):
        body = {"name": "x"} if method == "POST" else {"four_eyes": True}
        a = await http.call(method, path, token=beta["admin"], json=body)
        a.problem("not-found", 404)
    assert (await http.get(ORG + "/settings")).body["settings"] == {"confirm_destructive": True}


async def test_a_viewer_may_read_settings_but_not_change_them(http: Http) -> None:
    tokens = await _three_levels(http)
    for path in (ORG + "/settings", ORG + "/folders/platform/settings", WS + "/settings"):
        a = await _patch(http, path, {"four_eyes": True}, token=tokens["viewer"])
        a.problem("forbidden", 403)
        a = await _patch(http, path, {"four_eyes": True}, token=tokens["operator"])
        a.problem("forbidden", 403)
        assert (await http.get(path, token=tokens["viewer"])).status == 200
    a = await http.post(ORG + "/folders", json={"name": "x"}, token=tokens["approver"])
    a.problem("forbidden", 403)
    assert (await http.get(WS + "/settings")).body["effective"]["four_eyes"]["origin"] == "default"


async def test_an_admitted_run_records_the_effective_settings_it_runs_under(
    plane: Plane, repo: Path
) -> None:
    """The scheduler resolves org -> folder -> workspace at admission: run.queued's
    snapshot (shown by GET /runs/{id}) holds every setting's value and origin, and the
    effective heartbeat timeout is the one the run's executor and reaper will use."""
    commit(repo, {"main.tf": 'resource "null_resource" "x" {}\n'})
    http = plane.http
    assert (await http.post(ORG + "/folders", json={"name": "platform"})).status == 201
    body = {"name": "net", "repository": str(repo), "folder": "platform"}
    assert (await http.post(ORG + "/workspaces", json=body)).status == 201
    for path, patch in (
        (ORG + "/settings", {"confirm_destructive": True, "heartbeat_timeout": 120}),
        (ORG + "/folders/platform/settings", {"run_timeout": 1800}),
        (WS + "/settings", {"require_approval": False}),
    ):
        assert (await _patch(http, path, patch)).status == 200
    run_id = await plane.start("net", "plan")
    queued = await plane.pinned("net", run_id)  # queued; no executor runs
    assert queued.config is not None and queued.config.heartbeat_timeout == 120

    async def snapshot() -> dict[str, Any]:
        a = await http.get(f"{ORG}/runs/{run_id}")
        assert a.status == 200 and a.body["snapshot"], a.body
        return a.body["snapshot"]["settings"]  # type: ignore[no-any-return]  # JSON

    settings = await eventually(snapshot, timeout=10, what="the run's snapshot")
    assert settings["confirm_destructive"] == {"value": True, "origin": "org"}
    assert settings["heartbeat_timeout"] == {"value": 120, "origin": "org"}
    assert settings["run_timeout"] == {"value": 1800, "origin": "folder:platform"}
    assert settings["require_approval"] == {"value": False, "origin": "workspace"}
    assert settings["executor_pool"] == {"value": "default", "origin": "default"}
    assert settings["managed_state"] == {"value": True, "origin": "workspace"}

    # a later change does not touch the admitted run's record
    assert (await _patch(http, ORG + "/settings", {"confirm_destructive": False})).status == 200
    assert (await snapshot())["confirm_destructive"] == {"value": True, "origin": "org"}


async def test_a_dispatch_timeout_inherited_from_the_org_fails_a_run_nobody_picks_up(
    plane: Plane, repo: Path
) -> None:
    """The effective dispatch timeout (set on the organization, not in the workspace's
    configuration) is the one the scheduler and the reaper enforce."""
    commit(repo, {"main.tf": 'resource "null_resource" "x" {}\n'})
    await plane.stack.enter_async_context(plane.system.reaper(interval=0.1))
    http = plane.http
    body = {"name": "net", "repository": str(repo)}
    assert (await http.post(ORG + "/workspaces", json=body)).status == 201
    assert (await _patch(http, ORG + "/settings", {"dispatch_timeout": 1})).status == 200
    run_id = await plane.start("net", "plan")  # no executor runs
    failed = await plane.reaches("net", run_id, "failed")
    assert failed.reason == "executor_unavailable"
    assert "dispatch timeout of 1s" in failed.error_message
