"""The device flow across api replicas: two api applications on one NATS, each with its
own read model and its own `DeviceGrants`, as two `runplane api` processes are. The
grant made on one is polled on the other, approved through a sign-in on the other, and
of every poll racing on both after the approval exactly one gets a token. On a
three-node cluster (slow), an approved grant outlives the kill of its bucket's leader
and still gives one token, at whichever replica asks first."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from nats.aio.client import Client as NATS

from infra import streams
from infra.kv import DEVICE_GRANTS_BUCKET
from services.app.device import Approver, DeviceGrants
from services.root.bootstrap import Plane
from tests.device_support import GRANT_TYPE, V1, Device, device_fixture, nora  # noqa: F401
from tests.helpers import eventually
from tests.replicas_support import answered, leaders_again, two_replicas
from tests.sso_support import LOOPBACK, Browser, Idp, idp_fixture  # noqa: F401
from tests.tfe_support import Tfe, replica


async def _poll(where: TestClient[Any, Any], device_code: str) -> tuple[int, Any]:
    form = {"grant_type": GRANT_TYPE, "device_code": device_code, "client_id": "runplane-cli"}
    r = await where.post("/oauth/device/token", data=form)
    return r.status, await r.json(content_type=None)


async def _answer(where: Tfe, device_code: str) -> tuple[int, Any]:
    """A poll's answer once the replica can give one (not 503 while a leader is elected)."""
    return await answered(lambda: _poll(where.client, device_code), "an answer to the poll")


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


def _approver(address: str) -> Approver:
    """An approval as the browser's page makes it (the page itself is tested above)."""
    return Approver(
        org="acme", user="operator-user", role="operator", token_expires="", kind="",
        owner="", level="", address=address,
    )  # fmt: skip


@pytest.mark.slow
async def test_on_a_cluster_a_grant_outlives_its_leader_and_gives_one_token(
    tmp_path: Path,
) -> None:
    async with two_replicas(tmp_path) as replicas:
        one, two, a, b = replicas.one, replicas.two, replicas.a, replicas.b
        await a.org("acme")
        asked = await a.client.post("/oauth/device/code", data={"organization": "acme"})
        grant = await asked.json()
        await DeviceGrants(one).decide(grant["user_code"], _approver("10.0.0.7"), approve=True)
        leader = await replicas.cluster.stream_leader(f"KV_{DEVICE_GRANTS_BUCKET}")
        await leader.kill()  # the approval was acknowledged by a quorum: it stays
        await leaders_again(two, streams.EVENTS, f"KV_{DEVICE_GRANTS_BUCKET}")
        answers = await asyncio.gather(
            *(_answer(where, grant["device_code"]) for where in (a, b, a, b))
        )
        assert sorted(s for s, _ in answers) == [200, 400, 400, 400], answers
        await leader.start()
        await replicas.cluster.wait_ready()
        for where in (a, b):  # and still, with every node back
            status, again = await _answer(where, grant["device_code"])
            assert (status, again["error"]) == (400, "invalid_grant"), again
