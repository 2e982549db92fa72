"""Fixtures and a small client for the API tests: the real graph, no mocks.

A real nats-server (the `nc` fixture), the real `App`, the real `Projector` on a temporary
SQLite file, `build_app`, and aiohttp's test server. Holds no tests itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer
from nats.aio.client import Client as NATS

from projections.projector import Projector
from services.app.commands import App
from services.surfaces.api.app import build_app
from services.surfaces.api.context import API, Api

ADMIN_TOKEN = "test-admin-token"
PROBLEM = "application/problem+json"
_UNSET: Any = object()


class Answer(msgspec.Struct, frozen=True, kw_only=True):
    status: int
    body: Any
    headers: dict[str, str]
    content_type: str

    @property
    def seq(self) -> int:
        return int(self.headers["RP-Seq"])

    def problem(self, slug: str, status: int) -> dict[str, Any]:
        """Assert this is the problem `slug` with `status`; return its body."""
        assert (self.status, self.content_type) == (status, PROBLEM), (self.status, self.body)
        assert self.body["type"] == f"https://runplane.dev/problems/{slug}", self.body
        assert self.body["status"] == status
        assert self.body["title"] and self.body["detail"]
        return self.body  # type: ignore[no-any-return]  # JSON object


class Http:
    """Calls the API with a bearer token (the admin token unless told otherwise)."""

    def __init__(self, client: TestClient[Any, Any], api: Api, app: App) -> None:
        self.client = client
        self.api = api
        self.app = app

    async def call(
        self,
        method: str,
        path: str,
        *,
        token: str | None = ADMIN_TOKEN,
        json: Any = _UNSET,
        data: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> Answer:
        hdrs = dict(headers or {})
        if token is not None:
            hdrs["Authorization"] = f"Bearer {token}"
        kwargs: dict[str, Any] = {"headers": hdrs}
        if json is not _UNSET:
            kwargs["json"] = json
        elif data is not None:
            kwargs["data"] = data
        async with self.client.request(method, path, **kwargs) as resp:
            raw = await resp.read()
            body = msgspec.json.decode(raw) if raw else None
            return Answer(
                status=resp.status,
                body=body,
                headers=dict(resp.headers),
                content_type=resp.content_type,
            )

    async def get(self, path: str, **kw: Any) -> Answer:
        return await self.call("GET", path, **kw)

    async def post(self, path: str, **kw: Any) -> Answer:
        return await self.call("POST", path, **kw)

    # ------------------------------------------------------------ setup shortcuts

    async def org(self, name: str) -> dict[str, str]:
        """Create an organization; return a token per role."""
        assert (await self.post("/api/v1/orgs", json={"name": name})).status == 201
        tokens = {}
        for role in ("viewer", "operator", "approver", "admin"):
            a = await self.post(
                f"/api/v1/orgs/{name}/tokens", json={"user": f"{role}-user", "role": role}
            )
            assert a.status == 201, a.body
            tokens[role] = a.body["token"]
        return tokens

    async def workspace(self, org: str, name: str, **fields: Any) -> dict[str, Any]:
        body = {"name": name, "repository": "https://example.com/infra.git", **fields}
        a = await self.post(f"/api/v1/orgs/{org}/workspaces", json=body)
        assert a.status == 201, a.body
        return a.body  # type: ignore[no-any-return]  # JSON object

    async def run(self, org: str, ws: str, run_type: str = "apply", **kw: Any) -> dict[str, Any]:
        a = await self.post(
            f"/api/v1/orgs/{org}/workspaces/{ws}/runs", json={"type": run_type}, **kw
        )
        assert a.status == 201, a.body
        return a.body  # type: ignore[no-any-return]  # JSON object


@pytest.fixture(name="http")
async def http_fixture(nc: NATS, app: App, tmp_path: Path) -> AsyncIterator[Http]:
    """The API over the real command side and a real projector."""
    async with Projector(nc, tmp_path / "rm.sqlite") as projector:
        # Let the projector finish starting before a test can end. On Python 3.11 a cancel
        # that lands while its startup awaits `asyncio.wait_for` can be swallowed, and its
        # exit then waits forever; once it has projected an event it is past that point.
        started = await app.create_org("api-test-fixture", "test")
        assert await projector.wait_for(started.seq)
        web_app = build_app(app=app, projector=projector, admin_token=ADMIN_TOKEN)
        async with TestClient(TestServer(web_app)) as client:
            yield Http(client, web_app[API], app)
