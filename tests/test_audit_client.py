"""The client address on audit records: behind the deployment's TLS proxy, the nearest
hop's X-Forwarded-For (on main every record named the proxy's address: 127.0.0.1 here,
so no record told which client acted); without one, the header is the client's word
and ignored (a caller cannot put another's address on the record)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from services.root.bootstrap import Plane
from tests.api_support import Http, http_fixture  # noqa: F401  # `http`
from tests.audit_support import recorded
from tests.sso_support import Sso, sso_api

ACTION = "refused POST /api/v1/orgs/{org}/workspaces/{ws}/runs"
FORWARDED = {"X-Forwarded-For": "198.51.100.7, 203.0.113.9", "X-Forwarded-Proto": "https"}


@pytest.fixture(name="proxied")
async def proxied_fixture(system: Plane, tmp_path: Path) -> AsyncIterator[Sso]:
    async with sso_api(system, tmp_path / "rm.sqlite", behind_tls_proxy=True) as sso:
        yield sso


async def _refused(http: Http, org: str) -> None:
    tokens = await http.org(org)
    await http.workspace(org, "net")
    a = await http.post(
        f"/api/v1/orgs/{org}/workspaces/net/runs", json={"type": "apply"},
        token=tokens["viewer"], headers=FORWARDED,
    )  # fmt: skip
    a.problem("forbidden", 403)


async def test_behind_the_proxy_the_record_names_the_nearest_hop(proxied: Sso, nc: NATS) -> None:
    await _refused(proxied.http, "a")
    (refusal,) = await recorded(nc, "a", ACTION)
    assert refusal["client"] == "203.0.113.9", refusal


async def test_without_a_proxy_the_header_is_ignored(http: Http, nc: NATS) -> None:
    await _refused(http, "a")
    (refusal,) = await recorded(nc, "a", ACTION)
    assert refusal["client"] == "127.0.0.1", refusal
