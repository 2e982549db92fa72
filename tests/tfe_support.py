"""Fixtures for the TFE API tests: runplane's real API (real NATS, real projector, a
key ring) called as go-tfe calls it. Holds no tests itself."""

from __future__ import annotations

import base64
import hashlib
import json
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
