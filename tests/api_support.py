"""Fixtures and a small client for the API tests: the real graph, no mocks.

A real nats-server (the `nc` fixture), the API as the composition root builds it (the
`system` fixture: its `App`, a `Projector` on a temporary SQLite file, its web app), and
aiohttp's test server. Holds no tests itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from projections.projector import Projector
from services.app.commands import App
from services.root.bootstrap import Plane
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


def web_app_of(system: Plane, projector: Projector, **knobs: Any) -> web.Application:
    """`system`'s API over `projector` with the admin token `ADMIN_TOKEN` and any
    repository allowed; `knobs`: `Plane.web_app`'s (`secret_store=None`: an api without
    the encryption key)."""
    return system.web_app(projector, **{"admin_token": ADMIN_TOKEN, "repositories": None, **knobs})


@contextlib.asynccontextmanager
async def served(
    system: Plane, db_path: Path, org: str, **knobs: Any
) -> AsyncIterator[tuple[web.Application, TestClient[Any, Any]]]:
    """`system`'s API (`web_app_of`) over a projector at `db_path`, on aiohttp's test
    server. `org` is created and projected first."""
    async with system.projector(db_path) as projector:
        # Let the projector finish starting before a test can end. On Python 3.11 a cancel
        # that lands while its startup awaits `asyncio.wait_for` can be swallowed, and its
        # exit then waits forever; once it has projected an event it is past that point.
        started = await system.app.create_org(org, "test")
        assert await projector.wait_for(started.seq)
        web_app = web_app_of(system, projector, **knobs)
        async with TestClient(TestServer(web_app)) as client:
            yield web_app, client


@pytest.fixture(name="http")
async def http_fixture(system: Plane, tmp_path: Path) -> AsyncIterator[Http]:
    """The API over the real command side and a real projector (without the key)."""
    db = tmp_path / "rm.sqlite"
    async with served(system, db, "api-test-fixture", secret_store=None) as (web_app, client):
        yield Http(client, web_app[API], system.app)
