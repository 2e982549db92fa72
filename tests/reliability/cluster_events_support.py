"""Helpers of the cluster tests of issue 14's event paths (tests/reliability/
test_cluster_events.py): api processes pinned to distinct nodes, which node a process
talks to, signed webhook deliveries to one api replica, and a faults' clock. Holds no
tests itself."""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from services.processes.vcs import signing
from tests.cluster_support import NatsCluster
from tests.procs import free_port
from tests.reliability.chaos_support import ClusterNats, Component
from tests.vcs_support import SECRET, fixture, github_repo, pushed


def nodes_of(c: Component, cluster: NatsCluster) -> set[str]:
    """The cluster nodes `c`'s process has an established TCP connection to (its NATS
    clients): its socket inodes matched against the kernel's TCP table."""
    assert c.proc and c.proc.proc
    pid = c.proc.proc.pid
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    ports = {n.port: n.name for n in cluster.nodes}
    found = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        cols = line.split()
        remote = int(cols[2].split(":")[1], 16)
        if cols[3] == "01" and cols[9] in inodes and remote in ports:  # 01: ESTABLISHED
            found.add(ports[remote])
    return found


def api_component(root: Path, nats_side: ClusterNats, name: str) -> tuple[Component, str]:
    port = free_port()
    args = ["api", "--nats-url", nats_side.url, "--log-format", "json"]
    args += ["--data-dir", str(root / name), "--listen", f"127.0.0.1:{port}"]
    c = Component(name, args, root / f"{name}.log", "runplane api listening", nats_side.env())
    return c, f"http://127.0.0.1:{port}"


async def apis_on_distinct_nodes(
    root: Path, nats_side: ClusterNats, count: int = 2
) -> tuple[list[Component], list[str], list[set[str]]]:
    """`count` api processes, each given every node's URL (as deploy/README.md does),
    restarted until each talks to nodes no other one does (the client picks a node at
    random): the same delivery then reaches the stream through different servers."""
    root.mkdir(parents=True, exist_ok=True)
    made = [api_component(root, nats_side, f"api{i + 1}") for i in range(count)]
    apis, bases = [c for c, _ in made], [b for _, b in made]
    for c in apis:
        await c.start()
    for c in apis:
        await c.ready()
    for _ in range(12):
        nodes = [nodes_of(c, nats_side.cluster) for c in apis]
        clash = next((i for i in range(1, count) if nodes[i] & set().union(*nodes[:i])), None)
        if clash is None and all(nodes):
            return apis, bases, nodes
        victim = apis[clash if clash is not None else 0]
        await victim.stop()
        await victim.start()
        await victim.ready()
    raise AssertionError(f"the apis share a node after 12 restarts: {nodes}")


def push_body(files: list[str], commit: str) -> bytes:
    """GitHub's push example on acme/net, complete, its one commit changing `files`."""
    data = pushed(github_repo(fixture("github/push.branch.json"), "acme/net"), files, commit)
    return json.dumps(data).encode()


@dataclass
class Sent:
    at: float  # time.monotonic() as the answer came
    sent_at: float  # and as the request left
    replica: int
    delivery: str
    status: int  # 0: no answer
    body: Any


@dataclass
class Hooks:
    """Signed GitHub deliveries to the api replicas, every answer kept (`sent`)."""

    bases: list[str]
    connection: str
    sent: list[Sent] = field(default_factory=list)
    session: aiohttp.ClientSession = field(
        default_factory=lambda: aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15))
    )

    async def close(self) -> None:
        await self.session.close()

    async def post(self, replica: int, delivery: str, body: bytes) -> Sent:
        headers = {
            "X-GitHub-Event": "push",
            "X-GitHub-Delivery": delivery,
            "X-Hub-Signature-256": signing.github_signature(SECRET, body),
            "Content-Type": "application/json",
        }
        url = f"{self.bases[replica]}/api/v1/vcs/{self.connection}/webhook"
        status, payload, sent_at = 0, None, time.monotonic()
        try:
            async with self.session.post(url, data=body, headers=headers) as resp:
                status = resp.status
                text = await resp.text()
                try:
                    payload = json.loads(text) if text else None
                except ValueError:
                    payload = text
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as e:
            payload = repr(e)
        sent = Sent(time.monotonic(), sent_at, replica, delivery, status, payload)
        self.sent.append(sent)
        return sent

    async def until_accepted(
        self, replica: int, delivery: str, body: bytes, timeout: float = 90
    ) -> Sent:
        """The VCS's redelivery: the same delivery again until a 200 (a 503 or no answer
        during a fault is fine when a redelivery then works)."""
        deadline = time.monotonic() + timeout
        while True:
            got = await self.post(replica, delivery, body)
            if got.status == 200 or time.monotonic() > deadline:
                return got
            await asyncio.sleep(0.3)

    async def to_all(self, delivery: str, body: bytes) -> list[Sent]:
        """The delivery sent to every replica at once, each redelivered until a 200."""
        return list(
            await asyncio.gather(
                *(self.until_accepted(i, delivery, body) for i in range(len(self.bases)))
            )
        )


def write_summary(tmp_path: Path, name: str, summary: dict[str, Any]) -> None:
    out = tmp_path / f"last_cluster_{name}.json"
    out.write_text(json.dumps(summary, indent=2))
    print(f"cluster {name}:", json.dumps(summary), flush=True)


async def kill_leader(nats_side: ClusterNats, down_s: float) -> dict[str, Any]:
    """kill -9 the node leading RP_EVENTS; restart it after `down_s` on its store."""
    t_kill = time.monotonic()
    await nats_side.kill()
    await asyncio.sleep(down_s)
    await nats_side.start()
    return {
        "killed": nats_side.killed[-1],
        "t_kill": t_kill,
        "t_back": time.monotonic(),
        "back_s": round(time.monotonic() - t_kill, 2),
    }


async def kill_components(components: list[Component]) -> None:
    for c in components:
        if c.proc and c.proc.proc and c.returncode() is None:
            await c.kill()
