"""login.v1's codes are exchanged once across every api replica (services/surfaces/tfe/login.py
`TakenCodes`: the `rp-login-codes` bucket, written with `create`), not once per replica:
two api applications on the same NATS, each with its own read model, as two `runplane
api` processes are; and on a three-node cluster with the bucket's leader killed."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from nats.aio.client import Client as NATS

from infra import streams
from infra.kv import LOGIN_CODES_BUCKET, UI_SESSIONS_BUCKET
from tests.helpers import eventually
from tests.replicas_support import answered, leaders_again, two_replicas
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


async def _answered(where: Tfe, code: str, verifier: str) -> tuple[int, Any]:
    """The exchange once the replica can answer (not 503 while a leader is elected)."""
    return await answered(lambda: _exchange(where, code, verifier), "an answer to the exchange")


@pytest.mark.slow
async def test_on_a_cluster_a_code_is_taken_once_while_its_leader_is_killed(
    tmp_path: Path,
) -> None:
    async with two_replicas(tmp_path) as replicas:
        two, a, b = replicas.two, replicas.a, replicas.b
        tokens = await a.org("acme")
        await _signin(a, tokens["operator"])

        verifier, challenge = _pkce()
        code = await _code(a, challenge)
        status, answer = await _exchange(a, code, verifier)
        assert status == 200, answer
        leader = await replicas.cluster.stream_leader(f"KV_{LOGIN_CODES_BUCKET}")
        await leader.kill()
        status, again = await _answered(b, code, verifier)  # after the new leader's election
        assert status == 400 and "used" in again["error_description"], again

        # while the node is down: a new code, taken at b, refused at a
        await leaders_again(
            two, streams.EVENTS, f"KV_{LOGIN_CODES_BUCKET}", f"KV_{UI_SESSIONS_BUCKET}"
        )
        verifier2, challenge2 = _pkce()
        code2 = await _answered_code(a, challenge2)
        status, answer = await _answered(b, code2, verifier2)
        assert status == 200, answer
        status, again = await _answered(a, code2, verifier2)
        assert status == 400 and "used" in again["error_description"], again

        await leader.start()
        await replicas.cluster.wait_ready()
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
