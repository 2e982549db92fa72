"""A log followed with `?follow=1` (what `runplane logs -f` reads) stands only while its
token may read the workspace: a user suspended while following gets `event: error` and
the stream ends, with nothing of the run after the suspension (before, the stream went on
until the run ended, an apply's whole log included); so does a token revoked or a grant
taken back. A follower who still may gets the run to its `end`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from services.surfaces.api.standing import RECHECK_S
from tests.access_support import person
from tests.api_support import ADMIN_TOKEN, Http, http_fixture  # noqa: F401  # `http`

V1 = "/api/v1/orgs/a"


async def _follow(http: Http, run_id: str, token: str) -> tuple[Any, asyncio.Task[str]]:
    """The stream's response, and a task that reads it to its end."""
    resp = await http.client.get(
        f"{V1}/runs/{run_id}/logs?follow=1", headers={"Authorization": f"Bearer {token}"}
    )
    assert resp.status == 200, await resp.text()

    async def body() -> str:
        return (await resp.read()).decode()

    return resp, asyncio.ensure_future(body())


async def _suspend(http: Http, token: str) -> None:
    user_id = (await http.get("/api/v1/whoami", token=token)).body["user_id"]
    assert (await http.post(f"{V1}/users/{user_id}/suspend")).status == 200


async def _revoke(http: Http, token: str) -> None:
    token_id = (await http.get("/api/v1/whoami", token=token)).body["token_id"]
    assert (await http.call("DELETE", f"{V1}/tokens/{token_id}")).status == 204


async def _ungrant(http: Http, token: str) -> None:
    body = {"team": "net", "level": "none"}
    assert (await http.call("PUT", f"{V1}/workspaces/net/access", json=body)).status == 200


@pytest.mark.parametrize(
    ("lapse", "says"),
    [(_suspend, "suspended"), (_revoke, "revoked"), (_ungrant, "may no longer read")],
)
async def test_a_followed_log_ends_when_its_reader_no_longer_may_read_it(
    http: Http, lapse: Callable[[Http, str], Awaitable[None]], says: str
) -> None:
    await http.org("a")
    await http.workspace("a", "net")
    pam = await person(http, "a", "pam@a.io", "net", **{"workspaces/net": "read"})
    run = await http.run("a", "net", "plan")
    resp, pams = await _follow(http, run["id"], pam)
    admin_resp, admins = await _follow(http, run["id"], ADMIN_TOKEN)
    await lapse(http, pam)
    await asyncio.sleep(RECHECK_S)  # the stream checks its reader at most this often
    a = await http.post(f"{V1}/runs/{run['id']}/cancel", json={"reason": "done"})
    assert a.status == 200, a.body
    seen = await asyncio.wait_for(pams, 30)
    assert "event: error" in seen and says in seen, seen
    assert "event: end" not in seen and "canceled" not in seen, seen
    assert "event: end" in await asyncio.wait_for(admins, 30)
    resp.release()
    admin_resp.release()
