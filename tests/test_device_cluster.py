"""The device flow across api replicas: two api applications on one NATS, each with its
own read model and its own `DeviceGrants`, as two `runplane api` processes are. The
grant made on one is polled on the other, approved through a sign-in on the other, and
of every poll racing on both after the approval exactly one gets a token."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient
from nats.aio.client import Client as NATS

from services.root.bootstrap import Plane
from tests.device_support import GRANT_TYPE, V1, Device, device_fixture, nora  # noqa: F401
from tests.helpers import eventually
from tests.sso_support import LOOPBACK, Browser, Idp, idp_fixture  # noqa: F401
from tests.tfe_support import replica


async def _poll(where: TestClient[Any, Any], device_code: str) -> tuple[int, Any]:
    form = {"grant_type": GRANT_TYPE, "device_code": device_code, "client_id": "runplane-cli"}
    r = await where.post("/oauth/device/token", data=form)
    return r.status, await r.json(content_type=None)


async def test_approved_on_one_replica_and_redeemed_once_across_both(
    device: Device, idp: Idp, nc: NATS, system: Plane, tmp_path: Path
) -> None:
    await nora(device.sso, idp)
    answer = await device.code()  # asked at replica 1
    second = tmp_path / "replica-2" / "rm.sqlite"
    second.parent.mkdir()
    async with replica(nc, system.keyring, second, sso_allow=LOOPBACK) as other:

        async def caught_up() -> bool:  # replica 2's read model knows acme (its sign-in asks)
            return (await other.get("/api/v1/orgs/acme")).status == 200

        await eventually(caught_up, what="replica 2's read model")
        status, pending = await _poll(other.client, answer["device_code"])  # polled at replica 2
        assert (status, pending["error"]) == (400, "authorization_pending"), pending
        browser = Browser(other.client)  # the person reaches replica 2
        try:
            back = f"/device?user_code={answer['user_code']}"
            status, location = await browser.sign_in(idp, "acme", "nora", back)
            assert (status, location) == (303, back)
            assert (await device.decide(browser, answer["user_code"]))[0] == 200
        finally:
            await browser.close()
        polls = await asyncio.gather(
            *(
                _poll(where, answer["device_code"])
                for where in (other.client, device.sso.client) * 4
            )
        )
    assert sorted(s for s, _ in polls) == [200] + [400] * 7, polls
    token = next(a for s, a in polls if s == 200)["access_token"]

    async def known() -> bool:
        me = await device.sso.http.get("/api/v1/whoami", token=token)
        return me.status == 200 and me.body["user"] == "nora@acme.test"

    await eventually(known)
    tokens = (await device.sso.http.get(f"{V1}/acme/tokens")).body["items"]
    assert [t["name"] for t in tokens].count("runplane's CLI device login from 127.0.0.1") == 1
