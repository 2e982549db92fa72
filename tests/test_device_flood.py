"""The device flow's unauthenticated endpoint against a client with many addresses: an
IPv6 host holds a /64 (2**64 addresses) and draws a new one per request for nothing,
so a limit per address limited nothing: each request is two replicated writes in the
grants' bucket, kept a quarter of an hour."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.app.device import DeviceGrants
from services.root.bootstrap import Plane
from services.surfaces.api.device import PER_ADDRESS
from tests.sso_support import Sso, sso_api


@pytest.fixture(name="proxied")
async def proxied_fixture(system: Plane, tmp_path: Path) -> AsyncIterator[Sso]:
    """The API behind the deployment's TLS proxy (the client's address: X-Forwarded-For)."""
    grants = DeviceGrants(system.nc, interval=1.0)
    async with sso_api(
        system, tmp_path / "rm.sqlite", device_grants=grants, behind_tls_proxy=True
    ) as sso:
        yield sso


async def _ask(sso: Sso, address: str) -> int:
    r = await sso.client.post(
        "/oauth/device/code", data={"organization": "acme"},
        headers={"X-Forwarded-For": address, "X-Forwarded-Proto": "https"},
    )  # fmt: skip
    return r.status


async def test_grants_are_limited_per_ipv6_64_not_per_address(proxied: Sso) -> None:
    """On main every new address of one /64 got a grant: 3 * PER_ADDRESS all 200."""
    statuses = [await _ask(proxied, f"2001:db8:1:2::{i:x}") for i in range(PER_ADDRESS + 3)]
    assert statuses == [200] * PER_ADDRESS + [429] * 3, statuses
    assert await _ask(proxied, "2001:db8:1:3::1") == 200  # the next /64 is another client
    mapped = [await _ask(proxied, a) for a in ("192.0.2.7", "::ffff:192.0.2.7")]
    assert mapped == [200, 200]  # an IPv4 address is itself, mapped or not (2 of its 10)
