"""A workspace's heartbeat and dispatch timeouts through the HTTP API."""

from __future__ import annotations

from typing import Any

import pytest

from tests.api_support import Http, http_fixture  # noqa: F401  # registers the `http` fixture

WS = "/api/v1/orgs/acme/workspaces"


async def test_timeouts_default_to_ten_minutes_and_no_dispatch_timeout(http: Http) -> None:
    await http.org("acme")
    a = await http.post(WS, json={"name": "net", "repository": "r"})
    assert a.status == 201, a.body
    assert (a.body["heartbeat_timeout"], a.body["dispatch_timeout"]) == (600, 0)


async def test_timeouts_given_at_creation_are_snapshotted_into_each_run(http: Http) -> None:
    """The body's values reach the workspace's GET, the listing and the run's config."""
    await http.org("acme")
    body = {"name": "net", "repository": "r", "heartbeat_timeout": 3, "dispatch_timeout": 45}
    assert (await http.post(WS, json=body)).status == 201
    got = (await http.get(f"{WS}/net")).body
    assert (got["heartbeat_timeout"], got["dispatch_timeout"]) == (3, 45)
    [listed] = (await http.get(WS)).body["items"]
    assert (listed["heartbeat_timeout"], listed["dispatch_timeout"]) == (3, 45)
    run = await http.run("acme", "net")
    config = (await http.app.load_run("acme", "net", run["id"])).state.config
    assert config is not None
    assert (config.heartbeat_timeout, config.dispatch_timeout) == (3, 45)


@pytest.mark.parametrize(
    "fields",
    [
        {"heartbeat_timeout": 0},
        {"heartbeat_timeout": -5},
        {"dispatch_timeout": -1},
        {"heartbeat_timeout": 12 * 3600 + 1},
        {"dispatch_timeout": 10**9},
    ],
)
async def test_out_of_range_timeouts_are_refused_with_422(
    http: Http, fields: dict[str, Any]
) -> None:
    await http.org("acme")
    a = await http.post(WS, json={"name": "net", "repository": "r", **fields})
    problem = a.problem("invalid-command", 422)
    assert next(iter(fields)) in problem["detail"]
    assert (await http.get(f"{WS}/net")).status == 404, "nothing was created"


@pytest.mark.parametrize("value", ["10", 1.5, None, True])
async def test_timeouts_that_are_not_whole_numbers_are_an_invalid_body(
    http: Http, value: object
) -> None:
    await http.org("acme")
    a = await http.post(WS, json={"name": "net", "repository": "r", "heartbeat_timeout": value})
    a.problem("invalid-body", 400)


async def test_the_openapi_document_states_the_timeouts_ranges(http: Http) -> None:
    doc = (await http.get("/api/v1/openapi.json")).body
    props = doc["components"]["schemas"]["CreateWorkspaceBody"]["properties"]
    assert (props["heartbeat_timeout"]["minimum"], props["dispatch_timeout"]["minimum"]) == (1, 0)
    assert props["heartbeat_timeout"]["default"] == 600
