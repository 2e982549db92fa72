"""Two phases' state backends on one workspace, driven over HTTP. Holds no tests."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
from nats.aio.client import Client as NATS

from events.run import ClaimPhase, RunCommand
from executor.statebackend import USER, StateBackend
from executor.statestore import StateStore
from infra.crypto import KeyRing
from services.app.commands import App


@dataclass
class FakeJob:
    """A phase as its state backend sees it: whose lease (`executor.statebackend.Lessee`),
    and how it reports (passed as the backend's `report`)."""

    app: App
    org: str
    ws: str
    run_id: str
    lease_id: str
    executor_id: str

    @property
    def actor(self) -> str:
        return f"executor:{self.executor_id}"

    async def report(self, command: RunCommand) -> None:
        await self.app.run_command(self.org, self.ws, self.run_id, command)


@dataclass
class Answer:
    status: int
    body: str


class Client:
    def __init__(self, backend: StateBackend, job: FakeJob, session: aiohttp.ClientSession):
        self.backend, self.job, self.session = backend, job, session

    async def call(self, method: str, body: Any, *, password: str = "", query: str = "") -> Answer:
        auth = aiohttp.encode_basic_auth(USER, password or self.backend.password)
        data = None if body is None else json.dumps(body)
        url = self.backend.url + query
        headers = {"Authorization": auth}
        async with self.session.request(method, url, data=data, headers=headers) as resp:
            return Answer(resp.status, await resp.text())

    async def post(self, state: dict[str, Any], lock_id: str) -> Answer:
        return await self.call("POST", state, query=f"?ID={lock_id}")


async def _job(app: App, name: str, *, claim: bool) -> FakeJob:
    run_id = (await app.create_run("acme", "net", "apply", "alice")).state.run_id
    job = FakeJob(app, "acme", "net", run_id, f"lease-{name}", f"exec-{name}")
    if claim:
        assert await app.admit_next("acme", "net") == run_id
        cmd = ClaimPhase(actor=job.actor, phase="plan", lease_id=job.lease_id, executor_id=name)
        await app.run_command("acme", "net", run_id, cmd)
    return job


@asynccontextmanager
async def backends(nc: NATS, app: App, keyring: KeyRing) -> AsyncIterator[tuple[Client, Client]]:
    """Run A (planning, holding its lease) and run B (queued behind it), each served."""
    store = StateStore(nc.jetstream(), keyring)
    a = await _job(app, "a", claim=True)
    b = await _job(app, "b", claim=False)
    async with (
        StateBackend(a, store, runs=app, report=a.report) as served_a,
        StateBackend(b, store, runs=app, report=b.report) as served_b,
        aiohttp.ClientSession() as session,
    ):
        yield Client(served_a, a, session), Client(served_b, b, session)
