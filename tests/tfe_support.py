"""Fixtures for the TFE API tests: runplane's real API (real NATS, real projector, a
key ring) called as go-tfe calls it. Holds no tests itself."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pty
import select
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from nats.aio.client import Client as NATS

from projections.projector import Projector
from services.api.app import build_app
from services.api.context import API
from services.commands import App
from services.infra.crypto import KeyRing
from services.secrets import SecretStore
from tests.test_api_support import ADMIN_TOKEN, Answer, Http

JSONAPI = "application/vnd.api+json"


class Tfe(Http):
    """`Http` with go-tfe's headers and a few TFE shortcuts."""

    keyring: KeyRing

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


@pytest.fixture(name="tfe")
async def tfe_fixture(nc: NATS, app: App, tmp_path: Path) -> AsyncIterator[Tfe]:
    async with Projector(nc, tmp_path / "rm.sqlite") as projector:
        started = await app.create_org("tfe-test-fixture", "test")
        assert await projector.wait_for(started.seq)
        keyring = KeyRing.generate()
        web_app = build_app(
            app=app,
            projector=projector,
            admin_token=ADMIN_TOKEN,
            secret_store=SecretStore(nc, keyring),
        )
        async with TestClient(TestServer(web_app)) as client:
            t = Tfe(client, web_app[API], app)
            t.keyring = keyring
            yield t


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def login_over_pty(
    binary: str, host: str, token: str, env: dict[str, str], timeout: float = 60
) -> str:
    """`terraform login HOST` as a person runs it, on a pseudo-terminal: answer "yes" to
    its question, paste the token at its (secret) prompt; its whole output."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [binary, "login", "-no-color", host],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        close_fds=True,
        start_new_session=True,
    )
    os.close(slave)
    # each answer once its prompt shows after the last one answered; the token at the
    # secret prompt that follows "Token for" (Terraform turns echo off there)
    answers = [
        (b"Enter a value:", b"yes\n"),
        (b"Token for", b""),
        (b"Enter a value:", token.encode() + b"\n"),
    ]
    seen, mark = b"", 0
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # the child closed the terminal: it has ended
                    break
                if not chunk:
                    break
                seen += chunk
            while answers and (at := seen.find(answers[0][0], mark)) >= 0:
                prompt, answer = answers.pop(0)
                mark = at + len(prompt)
                if answer:
                    os.write(master, answer)
            if proc.poll() is not None and not ready:
                break
        assert proc.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, seen.decode(
            errors="replace"
        )
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    return seen.decode(errors="replace")
