"""What a phase's own processes can make its state backend hold (executor/statebackend.py,
executor/jobinit.py; an attacker's review of the state quotas).

Every process of a phase has `TF_HTTP_PASSWORD`. On the old code a LOCK with any ID got
423 with the holder's lock info, `ID` included, which is all a POST needs; hundreds of
slow POSTs then each spooled up to `--state-max-mb` into `<work>/unsaved-state/`, outside
the job's caps; and with `--job-network none` the init's relay started two threads per
connection without limit. Now: the 423 names no ID, one POST at a time (429 while one is
in flight), and the relay carries at most `RELAYED` connections at once. Each test here
fails on the old code.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
from nats.aio.client import Client as NATS

from executor.statebackend import USER
from services.app.commands import App
from tests.quota_support import served


async def test_a_foreign_lock_request_learns_the_holders_info_but_not_its_id(
    nc: NATS, app: App
) -> None:
    """Terraform holds the lock as "L"; another process of the phase LOCKs with its own
    ID: 423 with the holder's info, no ID, so it can neither write nor unlock."""
    async with served(nc, app) as client:
        held = await client.call("LOCK", {"ID": "mine", "Who": "attacker"})
        assert held.status == 423
        info = json.loads(held.body)
        assert info["Who"] == "tf" and "ID" not in info, info
        assert (await client.call("UNLOCK", {"ID": "mine"})).status == 423


async def test_one_state_write_at_a_time(nc: NATS, app: App) -> None:
    """A POST whose body is still coming holds the backend's one place to spool: a second
    is refused at once (429), before a byte of its body is read; the first then lands."""
    async with served(nc, app) as client:
        release = asyncio.Event()

        sent = asyncio.Event()

        async def slow() -> AsyncIterator[bytes]:
            yield b'{"version": 4, "serial": 1, "lineage": "l", '
            sent.set()  # the first chunk is on its way
            await release.wait()
            yield b'"resources": []}'

        auth = aiohttp.encode_basic_auth(USER, client.backend.password)
        url = client.backend.url + "?ID=L"

        async def post_slow() -> int:
            async with client.session.post(url, data=slow(), headers={"Authorization": auth}) as r:
                return r.status

        first = asyncio.create_task(post_slow())
        try:
            await asyncio.wait_for(sent.wait(), 5)
            await asyncio.sleep(0.3)  # the backend is receiving it
            second = await client.post({"version": 4, "serial": 2, "lineage": "l"}, "L")
            assert second.status == 429, second
        finally:
            release.set()
        assert await first == 200
