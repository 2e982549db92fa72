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
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from nats.aio.client import Client as NATS

from executor import jobinit
from executor.statebackend import USER
from services.app.commands import App
from tests.helpers import eventually
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


async def test_the_init_relays_a_bounded_number_of_connections(tmp_path: Path) -> None:
    """40 connections held open to the init's loopback port: at most RELAYED reach the
    state socket at once (2 threads each), the rest wait in the backlog and are carried
    as earlier ones end."""
    folder = Path(tempfile.mkdtemp(prefix="rp-relay-"))
    os.chmod(folder, 0o755)
    path = folder / jobinit.STATE_SOCKET
    reached: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reached.append(writer)
        await reader.read()  # until the relayed client goes
        writer.close()

    server = await asyncio.start_unix_server(hold, path=str(path))
    os.chmod(path, 0o666)
    port = _free_port()
    uid = 1_499_999_123  # no process runs as it: the init's kill(-1) reaches nothing else
    argv = jobinit.under_init(["sleep", "60"], parent=0, carry=f"{port}:{path}")
    init = await asyncio.create_subprocess_exec(*argv, user=uid, group=uid)
    clients: list[asyncio.StreamWriter] = []
    try:

        async def listening() -> bool:
            try:
                _, w = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                return False
            clients.append(w)
            return True

        await eventually(listening, timeout=10, what="the init listening")
        for _ in range(39):
            clients.append((await asyncio.open_connection("127.0.0.1", port))[1])

        async def full() -> bool:
            return len(reached) >= jobinit.RELAYED

        await eventually(full, timeout=10, what="the relay's places taken")
        await asyncio.sleep(0.5)
        assert len(reached) == jobinit.RELAYED
        assert _threads(init.pid) <= 2 + 2 * jobinit.RELAYED

        for w in clients:
            w.close()

        async def all_carried() -> bool:
            return len(reached) == 40

        await eventually(all_carried, timeout=15, what="every connection carried in turn")
    finally:
        children = Path(f"/proc/{init.pid}/task/{init.pid}/children").read_text().split()
        init.send_signal(signal.SIGKILL)  # not SIGTERM: that ends in kill(-1)
        await init.wait()
        for child in children:  # its job, `sleep`
            os.kill(int(child), signal.SIGKILL)
        server.close()
        shutil.rmtree(folder, ignore_errors=True)
