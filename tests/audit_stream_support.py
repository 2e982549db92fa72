"""Helpers for the audit stream's tests (tests/test_audit_stream*.py): the API with the
sealed store and http destinations allowed, a destination made through it, what a
receiver got, line by line, and a streamer of its own (stopped and started again by the
test). Holds no tests itself."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from nats.aio.client import Client as NATS

from services.processes.audit_stream import AuditStreamer, StreamSettings
from services.root.bootstrap import Plane
from services.surfaces.api.context import API
from tests.api_support import Http, served
from tests.notify_support import Receiver

V1 = "/api/v1/orgs"
SECRET = "audit-stream-secret-5f1e9a0c"
FAST = StreamSettings(
    retry=(0.05, 0.1, 0.2), timeout=2.0, batch=100, allow=frozenset({"loopback"}),
    allow_http=True, host="runplane.test", poll=0.2,
)  # fmt: skip


@pytest.fixture(name="shttp")
async def shttp_fixture(
    system: Plane, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Http]:
    """The API with the sealed store; loopback http destinations allowed (the receivers)."""
    monkeypatch.setenv("RUNPLANE_NOTIFY_ALLOW", "loopback")
    system.opts.audit_stream_allow_http = True
    async with served(system, tmp_path / "rm.sqlite", "stream-fixture") as (web_app, client):
        yield Http(client, web_app[API], system.app)


async def destination(
    http: Http, org: str, url: str, *, token: str | None = None, **fields: Any
) -> dict[str, Any]:
    """A destination of `org` made through the API (its admin token unless `token`)."""
    body = {"name": "siem", "url": url, "secret": SECRET, **fields}
    kw: dict[str, Any] = {} if token is None else {"token": token}
    a = await http.post(f"{V1}/{org}/audit/destinations", json=body, **kw)
    assert a.status == 201, a.body
    return a.body  # type: ignore[no-any-return]  # JSON object


class Sink(Receiver):
    """A receiver that also notes which requests it answered 2xx (`taken`)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.taken: set[int] = set()

    async def __aenter__(self) -> Sink:
        await super().__aenter__()
        return self

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        i = len(self.got)  # where the request is noted (one at a time per destination)
        answer = await super()._handle(request)
        if 200 <= answer.status < 300:
            self.taken.add(i)
        return answer


def lines(receiver: Sink, *, taken: bool = True) -> list[dict[str, Any]]:
    """Every JSON line of the requests the receiver took (or got, `taken=False`), in order."""
    chosen = [g for i, g in enumerate(receiver.got) if not taken or i in receiver.taken]
    return [json.loads(line) for g in chosen for line in g.body.splitlines() if line]


def places(receiver: Sink, org: str, *, taken: bool = True) -> list[int]:
    """The chain places (`n`) of `org`'s records the receiver took, in order (either format)."""
    out = []
    for line in lines(receiver, taken=taken):
        record = line.get("event", line)
        assert record["org"] == org, record
        out.append(record["n"])
    return out


@contextlib.asynccontextmanager
async def streaming(
    system: Plane, nc: NATS | None = None, **knobs: Any
) -> AsyncIterator[AuditStreamer]:
    """A streamer of this deployment on `nc` (default: the system's connection), FAST's
    settings but `knobs`, stopped on leaving."""
    settings = replace(FAST, **knobs)
    async with AuditStreamer(nc or system.nc, system.keyring, settings) as s:
        yield s
