"""The whole control plane in one test: api (with the sealed secret store), scheduler
(pinning snapshots), secrets responder and executors, over a real nats-server and real
Terraform, built by the composition root (tests/bootstrap_support.py) over one `App`,
one key ring and one secret store. Holds no tests itself."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from nats.aio.client import Client as NATS

from events.run import RunState
from executor import Executor
from infra.crypto import KeyRing
from services.app.commands import App
from services.app.secrets import SecretStore
from services.root import bootstrap
from services.surfaces.api.context import API
from tests import bootstrap_support
from tests.api_support import ADMIN_TOKEN, Http
from tests.bootstrap_support import built, git_snapshots
from tests.executor_support import git
from tests.helpers import eventually


@dataclass
class Plane:
    """Handles on every part; `executor()` starts one more executor."""

    http: Http
    app: App
    nc: NATS
    keyring: KeyRing
    secrets: SecretStore
    root: Path
    stack: AsyncExitStack
    system: bootstrap.Plane
    executors: dict[str, Executor] = field(default_factory=dict)

    async def executor(self, name: str, pool: str = "default") -> Executor:
        ex = bootstrap_support.executor(
            self.system, pool=pool, work_dir=self.root / name, executor_id=name
        )
        self.executors[name] = await self.stack.enter_async_context(ex)
        return ex

    def replica(self, **knobs: Any) -> bootstrap.Plane:
        """Another process of this deployment on the same connection (its own `App`;
        `knobs`: tests/bootstrap_support.py `built`'s)."""
        return built(self.nc, self.stack, self.root, **knobs)

    async def run(self, ws: str, run_id: str, org: str = "acme") -> RunState:
        return (await self.app.load_run(org, ws, run_id)).state  # type: ignore[no-any-return]

    async def reaches(self, ws: str, run_id: str, *status: str, org: str = "acme") -> RunState:
        async def probe() -> RunState:
            state = await self.run(ws, run_id, org)
            assert str(state.status) in status, (
                f"{state.status} {state.reason} {state.error_message}"
            )
            return state

        return await eventually(probe, timeout=60, what=f"run {run_id} {status}")

    async def pinned(self, ws: str, run_id: str, org: str = "acme") -> RunState:
        """Wait until the run is admitted and pinned to its snapshot (`run.pinned`)."""

        async def probe() -> RunState:
            state = await self.run(ws, run_id, org)
            assert state.snapshot is not None and not state.pinning, f"{state.status}"
            return state

        return await eventually(probe, timeout=60, what=f"run {run_id} pinned")

    async def events(self, ws: str, run_id: str, org: str = "acme") -> list[Any]:
        envs = await self.app.store.read(f"rp.run.{org}.{ws}.{run_id}")
        return [e.event for e in envs]

    async def start(self, ws: str, run_type: str = "apply", org: str = "acme") -> str:
        a = await self.http.post(
            f"/api/v1/orgs/{org}/workspaces/{ws}/runs", json={"type": run_type}
        )
        assert a.status == 201, a.body
        return str(a.body["id"])

    async def approve(self, run_id: str, org: str = "acme") -> None:
        a = await self.http.post(f"/api/v1/orgs/{org}/runs/{run_id}/approve", json={})
        assert a.status == 200, a.body


@pytest.fixture(name="plane")
async def plane_fixture(nc: NATS, tmp_path: Path) -> AsyncIterator[Plane]:
    async with AsyncExitStack() as stack:
        system = built(nc, stack, tmp_path, pinning=git_snapshots)
        app = system.app
        projector = await stack.enter_async_context(system.projector(tmp_path / "rm.sqlite"))
        started = await app.create_org("plane-fixture", "test")
        assert await projector.wait_for(started.seq)  # see tests/api_support.py
        web_app = system.web_app(projector, admin_token=ADMIN_TOKEN, repositories=None)
        client = await stack.enter_async_context(TestClient(TestServer(web_app)))
        await stack.enter_async_context(system.scheduler())
        await stack.enter_async_context(system.secrets_responder())
        http = Http(client, web_app[API], app)
        assert (await http.post("/api/v1/orgs", json={"name": "acme"})).status == 201
        yield Plane(http, app, nc, system.keyring, system.secrets, tmp_path, stack, system)


def commit(repo: Path, files: dict[str, str], message: str = "change") -> str:
    """Write files, commit them on the current branch, return the commit sha."""
    for name, text in files.items():
        (repo / name).write_text(text)
        git(repo, "add", name)
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")
