"""login.v1's codes are exchanged once across every api replica (services/surfaces/tfe/login.py
`TakenCodes`: the `rp-login-codes` bucket, written with `create`), not once per replica:
two api applications on the same NATS, each with its own read model, as two `runplane
api` processes are; and on a three-node cluster with the bucket's leader killed."""

from __future__ import annotations

import asyncio
import json
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import nats
import nats.errors
import pytest
from nats.aio.client import Client as NATS

from infra import streams
from infra.crypto import KeyRing
from infra.kv import LOGIN_CODES_BUCKET, UI_SESSIONS_BUCKET
from tests.cluster_support import NatsCluster
from tests.helpers import eventually
from tests.tfe_login_support import _code, _exchange, _pkce, _signin
from tests.tfe_support import Tfe, replica, tfe_fixture

__all__ = ["tfe_fixture"]


async def test_a_code_exchanged_at_one_replica_is_refused_at_the_other(
    tfe: Tfe, nc: NATS, tmp_path: Path
) -> None:
    tokens = await tfe.org("acme")
    await _signin(tfe, tokens["operator"])
    async with replica(nc, tfe.keyring, tmp_path / "rm-2.sqlite") as other:
        verifier, challenge = _pkce()
        code = await _code(tfe, challenge)  # the browser's consent on replica 1
        status, answer = await _exchange(other, code, verifier)  # the CLI reaches replica 2
        assert status == 200, answer
        who = await other.tfe("GET", "/api/v2/account/details", token=answer["access_token"])
        assert who.body["data"]["attributes"]["username"] == "operator-user"
        for where in (tfe, other):
            status, again = await _exchange(where, code, verifier)
            assert status == 400, f"redeemed twice: {again}"
            assert again["error"] == "invalid_grant" and "used" in again["error_description"]

        # the same code at both at once: one token
        verifier, challenge = _pkce()
        code = await _code(tfe, challenge)
        answers = await asyncio.gather(
            *(_exchange(where, code, verifier) for where in (tfe, other, tfe, other))
        )
        assert sorted(status for status, _ in answers) == [200, 400, 400, 400], answers
    issued = (await tfe.get("/api/v1/orgs/acme/tokens")).body["items"]
    assert [t["user"] for t in issued].count("operator-user") == 3  # its own and two


async def _connect(cluster: NatsCluster, first: int) -> NATS:
    """A client that prefers node `first` (and reconnects across all)."""
    urls = cluster.urls[first:] + cluster.urls[:first]
    return await nats.connect(
        servers=urls,
        dont_randomize=True,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.2,
        **cluster.auth.connect_options(),
    )


async def _answered(where: Tfe, code: str, verifier: str) -> tuple[int, Any]:
    """The exchange once the replica can answer (not 503 while a leader is elected)."""
    found: list[tuple[int, Any]] = []

    async def probe() -> bool:
        try:
            status, answer = await _exchange(where, code, verifier)
        except (aiohttp.ClientError, TimeoutError):  # a 503 as problem details, a timeout
            return False
        if status == 503:
            return False
        found.append((status, answer))
        return True

    await eventually(probe, timeout=60, interval=0.3, what="an answer to the exchange")
    return found[-1]


async def _led(nc: NATS) -> bool:
    """Whether the events stream and the buckets a login writes have leaders again."""
    names = (streams.EVENTS, f"KV_{LOGIN_CODES_BUCKET}", f"KV_{UI_SESSIONS_BUCKET}")
    try:
        for name in names:
            info = json.loads((await nc.request(f"$JS.API.STREAM.INFO.{name}", b"", 2)).data)
            if not info.get("cluster", {}).get("leader"):
                return False
    except (TimeoutError, nats.errors.Error):
        return False
    return True


@pytest.mark.slow
async def test_on_a_cluster_a_code_is_taken_once_while_its_leader_is_killed(
    tmp_path: Path,
) -> None:
    keyring = KeyRing.generate()
    async with NatsCluster(tmp_path / "cluster") as cluster, AsyncExitStack() as stack:
        one, two = await _connect(cluster, 0), await _connect(cluster, 1)
        stack.push_async_callback(one.close)
        stack.push_async_callback(two.close)
        await streams.declare(one, one.jetstream(), replicas=3)
        a = await stack.enter_async_context(replica(one, keyring, tmp_path / "rm-a.sqlite"))
        b = await stack.enter_async_context(replica(two, keyring, tmp_path / "rm-b.sqlite"))
        tokens = await a.org("acme")
        await _signin(a, tokens["operator"])

        verifier, challenge = _pkce()
        code = await _code(a, challenge)
        status, answer = await _exchange(a, code, verifier)
        assert status == 200, answer
        leader = await cluster.stream_leader(f"KV_{LOGIN_CODES_BUCKET}")
        await leader.kill()
        status, again = await _answered(b, code, verifier)  # after the new leader's election
        assert status == 400 and "used" in again["error_description"], again

        # while the node is down: a new code, taken at b, refused at a
        await eventually(lambda: _led(two), timeout=60, interval=0.3, what="leaders again")
        verifier2, challenge2 = _pkce()
        code2 = await _answered_code(a, challenge2)
        status, answer = await _answered(b, code2, verifier2)
        assert status == 200, answer
        status, again = await _answered(a, code2, verifier2)
        assert status == 400 and "used" in again["error_description"], again

        await leader.start()
        await cluster.wait_ready()
        for where in (a, b):  # and still, with every node back
            status, again = await _answered(where, code, verifier)
            assert status == 400, again


async def _answered_code(where: Tfe, challenge: str) -> str:
    found: list[str] = []

    async def probe() -> bool:
        try:
            found.append(await _code(where, challenge))
        except (AssertionError, aiohttp.ClientError, TimeoutError):  # 503 while NATS recovers
            return False
        return True

    await eventually(probe, timeout=60, interval=0.3, what="a login code")
    return found[-1]
