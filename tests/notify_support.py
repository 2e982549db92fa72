"""Real local receivers for the notification tests, and an API fixture with the sealed
store (tokens are stored like secret variables). Holds no tests itself."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import web

from services.processes.notifications import signing
from services.root.bootstrap import Plane
from services.surfaces.api.context import API
from tests.api_support import Http, served


@dataclass
class Got:
    delivery: str
    body: bytes
    headers: dict[str, str]
    tfe_ok: bool
    rp_ok: bool
    at: float

    @property
    def json(self) -> Any:
        return msgspec.json.decode(self.body)


@dataclass
class Receiver:
    """An HTTP server on 127.0.0.1 that checks both signatures and counts deliveries.

    `answers`: status codes to answer, in turn, before answering `then` for good; a
    code of 0 hangs (never answers); 429 carries `Retry-After: retry_after`."""

    token: str = ""
    answers: list[int] = field(default_factory=list)
    then: int = 200
    retry_after: str = "1"
    delay: float = 0.0  # seconds before each answer
    got: list[Got] = field(default_factory=list)
    url: str = ""
    _runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        h = dict(request.headers)
        tfe = h.get(signing.TFE_HEADER, "")
        rp = h.get(signing.RP_HEADER, "")
        self.got.append(
            Got(
                delivery=h.get(signing.DELIVERY_HEADER, ""),
                body=body,
                headers=h,
                tfe_ok=bool(self.token) and signing.check_tfe(self.token, body, tfe),
                rp_ok=bool(self.token) and signing.check_rp(self.token, body, rp, time.time()),
                at=time.monotonic(),
            )
        )
        code = self.answers.pop(0) if self.answers else self.then
        if self.delay:
            await asyncio.sleep(self.delay)
        if code == 0:
            await asyncio.Event().wait()  # hang until the client gives up
        headers = {"Retry-After": self.retry_after} if code == 429 else {}
        return web.Response(status=code, text=f"answer {code}", headers=headers)

    async def __aenter__(self) -> Receiver:
        app = web.Application()
        app.router.add_post("/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}/hook"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    def deliveries(self) -> set[str]:
        return {g.delivery for g in self.got}


@pytest.fixture(name="nhttp")
async def nhttp_fixture(
    system: Plane, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Http]:
    """The API with the sealed store, loopback destinations allowed (the receivers)."""
    monkeypatch.setenv("RUNPLANE_NOTIFY_ALLOW", "loopback")
    async with served(system, tmp_path / "rm.sqlite", "notify-fixture") as (web_app, client):
        yield Http(client, web_app[API], system.app)
