"""Two api replicas on a three-node NATS cluster, for the tests of what must hold across
replicas while a leader dies (tests/test_device_cluster.py, test_tfe_login_replicas.py):
each replica is its own graph and read model on a client of its own node, the
deployment's one key ring, every stream and bucket at three replicas. Holds no tests
itself."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import nats
import nats.errors
from nats.aio.client import Client as NATS

from infra import streams
from infra.crypto import KeyRing
from tests.cluster_support import NatsCluster
from tests.helpers import eventually
from tests.tfe_support import Tfe, replica


@dataclass(frozen=True)
class TwoReplicas:
    """Replica `a` on a client that prefers node 0 (`one`), `b` on node 1's (`two`)."""

    cluster: NatsCluster
    one: NATS
    two: NATS
    a: Tfe
    b: Tfe


async def connect(cluster: NatsCluster, first: int) -> NATS:
    """A client that prefers node `first` (and reconnects across all)."""
    urls = cluster.urls[first:] + cluster.urls[:first]
    return await nats.connect(
        servers=urls,
        dont_randomize=True,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.2,
        **cluster.auth.connect_options(),
    )


@contextlib.asynccontextmanager
async def two_replicas(root: Path) -> AsyncIterator[TwoReplicas]:
    """A cluster under `root` with runplane's streams declared at three replicas, and two
    api replicas on it."""
    keyring = KeyRing.generate()
    async with NatsCluster(root / "cluster") as cluster, AsyncExitStack() as stack:
        one, two = await connect(cluster, 0), await connect(cluster, 1)
        stack.push_async_callback(one.close)
        stack.push_async_callback(two.close)
        await streams.declare(one, one.jetstream(), replicas=3)
        for name in ("a", "b"):
            (root / name).mkdir(parents=True, exist_ok=True)
        a = await stack.enter_async_context(replica(one, keyring, root / "a" / "rm.sqlite"))
        b = await stack.enter_async_context(replica(two, keyring, root / "b" / "rm.sqlite"))
        yield TwoReplicas(cluster=cluster, one=one, two=two, a=a, b=b)


async def leaders_again(nc: NATS, *names: str) -> None:
    """Wait until the streams `names` (a bucket is `KV_<bucket>`) have leaders again."""
    await eventually(lambda: _led(nc, names), timeout=60, interval=0.3, what="leaders again")


async def _led(nc: NATS, names: tuple[str, ...]) -> bool:
    try:
        for name in names:
            info = json.loads((await nc.request(f"$JS.API.STREAM.INFO.{name}", b"", 2)).data)
            if not info.get("cluster", {}).get("leader"):
                return False
    except (TimeoutError, nats.errors.Error):
        return False
    return True


async def answered(call: Callable[[], Awaitable[tuple[int, Any]]], what: str) -> tuple[int, Any]:
    """`call`'s (status, answer) once a replica can give one: not while it fails to
    connect, times out or answers 503 (a leader being elected)."""
    found: list[tuple[int, Any]] = []

    async def probe() -> bool:
        try:
            status, answer = await call()
        except (aiohttp.ClientError, TimeoutError):  # a 503 as problem details, a timeout
            return False
        found.append((status, answer))
        return status != 503

    await eventually(probe, timeout=60, interval=0.3, what=what)
    return found[-1]
