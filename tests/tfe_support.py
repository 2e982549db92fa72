"""Fixtures for the TFE API tests: runplane's real API (real NATS, real projector, a
key ring) called as go-tfe calls it; configuration versions uploaded and runs made as
go-tfe makes them; a state pushed and the pushes recorded. Holds no tests itself."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import os
import pty
import re
import select
import signal
import subprocess
import tarfile
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from nats.aio.client import Client as NATS
from yarl import URL

from events.codec import ws_subject
from events.workspace import StatePushed
from executor.statestore import StateStore
from infra.crypto import KeyRing
from infra.eventstore import LATEST
from projections.projector import Projector
from services.root.bootstrap import Plane
from services.surfaces.api.context import API
from services.surfaces.tfe.context import TFE
from tests.api_support import ADMIN_TOKEN, Answer, Http, served
from tests.bootstrap_support import built, options_for

JSONAPI = "application/vnd.api+json"


class Tfe(Http):
    """`Http` with go-tfe's headers and a few TFE shortcuts."""

    keyring: KeyRing
    system: Plane  # the api process's graph (its App, key ring, secret store)

    async def tfe(self, method: str, path: str, **kw: Any) -> Answer:
        headers = {"Accept": JSONAPI, **kw.pop("headers", {})}
        if "json" in kw:
            kw["data"] = json.dumps(kw.pop("json")).encode()
            headers["Content-Type"] = JSONAPI
        return await self.call(method, path, headers=headers, **kw)

    async def raw(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        async with self.client.get(path, headers=headers or {}) as resp:
            return resp.status, await resp.read()

    async def cli_workspace(self, org: str, name: str, token: str = ADMIN_TOKEN) -> str:
        a = await self.tfe(
            "POST",
            f"/api/v2/organizations/{org}/workspaces",
            token=token,
            json={"data": {"type": "workspaces", "attributes": {"name": name}}},
        )
        assert a.status == 201, a.body
        return str(a.body["data"]["id"])

    async def push(
        self, ws_id: str, state: dict[str, Any], token: str = ADMIN_TOKEN, **attrs: Any
    ) -> Answer:
        raw = json.dumps(state).encode()
        body = {
            "serial": state["serial"],
            "lineage": state["lineage"],
            "md5": hashlib.md5(raw).hexdigest(),
            "state": base64.b64encode(raw).decode(),
            **attrs,
        }
        return await self.tfe(
            "POST",
            f"/api/v2/workspaces/{ws_id}/state-versions",
            token=token,
            json={"data": {"type": "state-versions", "attributes": body}},
        )

    async def lock(self, ws_id: str, token: str = ADMIN_TOKEN) -> Answer:
        return await self.tfe(
            "POST",
            f"/api/v2/workspaces/{ws_id}/actions/lock",
            token=token,
            json={"reason": "Locked by Terraform"},
        )


def a_state(
    serial: int, lineage: str = "", outputs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "version": 4,
        "terraform_version": "1.0.3",
        "serial": serial,
        "lineage": lineage or str(uuid.uuid4()),
        "outputs": {k: {"value": v, "type": "string"} for k, v in (outputs or {}).items()},
        "resources": [],
    }


@contextlib.asynccontextmanager
async def web_replica(system: Plane, projector: Projector) -> AsyncIterator[Tfe]:
    """An api replica's web app over `system` (its `App`, key ring and secret store) and
    `projector`."""
    web_app = system.web_app(projector, admin_token=ADMIN_TOKEN, repositories=None)
    async with TestClient(TestServer(web_app)) as client:
        t = Tfe(client, web_app[API], system.app)
        t.keyring, t.system = system.keyring, system
        yield t


@contextlib.asynccontextmanager
async def replica(nc: NATS, keyring: KeyRing, path: Path, **changes: Any) -> AsyncIterator[Tfe]:
    """An api replica: its own graph (App, projector and read model at `path`) on `nc`,
    the deployment's one key ring; `changes` to its options (tests/bootstrap_support.py
    `options_for`)."""
    async with AsyncExitStack() as stack:
        opts = options_for(path.parent, **changes)
        system = built(nc, stack, path.parent, keyring=keyring, opts=opts)
        async with system.projector(path) as projector, web_replica(system, projector) as t:
            yield t


@pytest.fixture(name="tfe")
async def tfe_fixture(system: Plane, tmp_path: Path) -> AsyncIterator[Tfe]:
    async with served(system, tmp_path / "rm.sqlite", "tfe-test-fixture") as (web_app, client):
        t = Tfe(client, web_app[API], system.app)
        t.keyring, t.system = system.keyring, system
        yield t


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class Terminal:
    """A program on a pseudo-terminal, as a person runs it: wait for what it prints,
    type answers. Blocking; a test calls it through `asyncio.to_thread`."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(
            argv,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            close_fds=True,
            start_new_session=True,
        )
        os.close(slave)
        self.seen = b""
        self.mark = 0

    def expect(self, pattern: bytes, timeout: float = 60) -> re.Match[bytes]:
        """The first match of `pattern` after the last one expected."""
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        while True:
            found = rx.search(self.seen, self.mark)
            if found:
                self.mark = found.end()
                return found
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} in: {self.text()}"
            ready, _, _ = select.select([self.master], [], [], min(left, 0.5))
            if ready:
                try:
                    chunk = os.read(self.master, 4096)
                except OSError:  # the terminal closed: the program ended
                    chunk = b""
                assert chunk, f"ended without {pattern!r}: {self.text()}"
                self.seen += chunk

    def _read(self, wait: float) -> bool | None:
        """Take what the program printed within `wait` seconds: True if something came,
        False if nothing did, None if the terminal has closed (the program ended)."""
        if not select.select([self.master], [], [], wait)[0]:
            return False
        try:
            chunk = os.read(self.master, 4096)
        except OSError:
            return None
        self.seen += chunk
        return True if chunk else None

    def drain(self) -> str:
        """Read what the program has printed so far without waiting; all it printed, and
        whether it is still running."""
        while self._read(0):
            pass
        state = "running" if self.proc.poll() is None else f"exited {self.proc.returncode}"
        return f"{self.text()}\n[{state}]"

    def send(self, text: str) -> None:
        os.write(self.master, text.encode())

    def finish(self, timeout: float = 60) -> int:
        """Read to the end; the exit status."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self._read(0.5)
            if got is None or (got is False and self.proc.poll() is not None):
                break
        return self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Kill what is left of it: the program and anything it started (its session)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        os.close(self.master)

    def text(self) -> str:
        return self.seen.decode(errors="replace")


# ---------------------------------------------------------------- configuration versions, runs


def archive(files: dict[str, bytes] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in (files or {"main.tf": b'resource "null_resource" "a" {}\n'}).items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


async def new_config(tfe: Tfe, ws_id: str, *, speculative: bool) -> dict[str, Any]:
    a = await tfe.tfe(
        "POST",
        f"/api/v2/workspaces/{ws_id}/configuration-versions",
        json={
            "data": {
                "type": "configuration-versions",
                "attributes": {"auto-queue-runs": False, "speculative": speculative},
            }
        },
    )
    assert a.status == 201, a.body
    return a.body["data"]  # type: ignore[no-any-return]


async def put(tfe: Tfe, url: str, body: bytes) -> tuple[int, Any]:
    """go-tfe's Upload: a PUT of the archive, with no Authorization header."""
    async with tfe.client.put(URL(url).path, data=body) as resp:
        raw = await resp.read()
        return resp.status, (await resp.json(content_type=None) if raw else None)


async def uploaded(tfe: Tfe, ws_id: str, *, speculative: bool = True) -> tuple[str, bytes]:
    cv = await new_config(tfe, ws_id, speculative=speculative)
    body = archive()
    assert (await put(tfe, cv["attributes"]["upload-url"], body))[0] == 200
    return cv["id"], body


def _run_body(ws_id: str, cv: str, attrs: dict[str, Any]) -> dict[str, Any]:
    return {
        "data": {
            "type": "runs",
            "attributes": attrs,
            "relationships": {
                "workspace": {"data": {"type": "workspaces", "id": ws_id}},
                "configuration-version": {"data": {"type": "configuration-versions", "id": cv}},
            },
        }
    }


async def new_run(tfe: Tfe, ws_id: str, cv: str, **attrs: Any) -> Any:
    """POST /runs of configuration `cv` on workspace `ws_id` with `attrs`."""
    return await tfe.tfe("POST", "/api/v2/runs", json=_run_body(ws_id, cv, attrs))


async def new_run_as(tfe: Tfe, ws_id: str, cv: str, token: str) -> Any:
    """The same, as `token`."""
    return await tfe.tfe("POST", "/api/v2/runs", token=token, json=_run_body(ws_id, cv, {}))


# ---------------------------------------------------------------- state


async def _with_state(tfe: Tfe, outputs: dict[str, Any]) -> tuple[dict[str, str], str, Any]:
    tokens = await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net", token=tokens["admin"])
    assert (await tfe.lock(ws_id, token=tokens["operator"])).status == 200
    st = a_state(1)
    st["outputs"] = outputs
    pushed = await tfe.push(ws_id, st, token=tokens["operator"])
    assert pushed.status == 201, pushed.body
    return tokens, ws_id, pushed.body["data"]


async def _pushes(tfe: Tfe, org: str = "acme", ws: str = "net") -> list[StatePushed]:
    envelopes = await tfe.app.store.read(ws_subject(org, ws), min_seq=LATEST)
    return [e.event for e in envelopes if isinstance(e.event, StatePushed)]


def _states(tfe: Tfe) -> StateStore:
    states = tfe.client.app[TFE].states
    assert states is not None
    return states
