"""Workload identity's signing keys on a 3-node NATS JetStream cluster (infra/signing.py):
the bucket `rp-signing-keys` at 3 replicas, processes of one deployment each connected to
a different node.

- Processes racing a rotation end with one key set: each writes expecting the revision it
  read, one write wins, the others take the winner's set.
- What one node's process signs, the api on another node publishes at once: every
  process reads the set from the stream's leader, so an api whose node is a follower
  never serves a set without the key just made, and its cache of the set is dropped as
  soon as a rotation is due by the set it holds.

The clock is the processes' own (`App`'s, as in a deployment's tests): the rotation period
passes at a step, the network and NATS are real.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jwt
import pytest
from aiohttp.test_utils import TestClient, TestServer
from nats.aio.client import Client as NATS

from infra import options
from infra.kv import SIGNING_KEYS_BUCKET
from infra.signing import AHEAD, SigningKeys
from services.root.runtime import nats_connection
from services.surfaces.api.context import API
from tests.api_support import ADMIN_TOKEN, Http
from tests.bootstrap_support import built, options_for
from tests.cluster_support import NatsCluster, Node
from tests.workload_support import ISSUER, verify

STREAM = f"KV_{SIGNING_KEYS_BUCKET}"
ROTATE = 3600.0  # the shortest --workload-key-rotation
ROUNDS = 5
_JTI = itertools.count(1)


class Clock:
    """Unix seconds that a test moves; the processes' `App` clock reads it."""

    def __init__(self) -> None:
        self.t = time.time()

    def seconds(self) -> float:
        return self.t

    def now(self) -> datetime:
        return datetime.fromtimestamp(self.t, UTC)


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[NatsCluster]:
    async with NatsCluster(tmp_path / "cluster") as c:
        yield c


async def _on(stack: AsyncExitStack, cluster: NatsCluster, node: Node) -> NATS:
    """A process's connection to `node` alone, every stream and bucket declared."""
    return await stack.enter_async_context(nats_connection([node.url], cluster.auth))


async def _followers(cluster: NatsCluster) -> tuple[Node, Node, Node]:
    """The signing keys' stream leader and its two followers."""
    leader = await cluster.stream_leader(STREAM)
    a, b = (n for n in cluster.nodes if n is not leader)
    return leader, a, b


def _kid(token: str) -> str:
    return str(jwt.get_unverified_header(token)["kid"])


def _claims() -> dict[str, Any]:
    now = int(time.time())  # the verifier's (PyJWT's) clock is the real one
    claims = {"iss": ISSUER, "aud": "a", "sub": "s", "jti": str(next(_JTI))}
    return {**claims, "iat": now, "nbf": now, "exp": now + 600}


async def test_the_keys_bucket_has_three_replicas_and_a_race_leaves_one_set(
    cluster: NatsCluster, tmp_path: Path
) -> None:
    """Two processes on two followers of the bucket's stream, their rotations due at the
    same moment, ROUNDS times: each round adds exactly one key, both end with the set the
    leader stores, and both sign with the same key."""
    clock = Clock()
    ring = options.keyring(options_for(tmp_path), create=True)
    async with AsyncExitStack() as stack:
        first = await _on(stack, cluster, cluster.nodes[0])
        info = await first.jetstream().stream_info(STREAM)
        assert info.config.num_replicas == 3, info.config
        _, node_a, node_b = await _followers(cluster)
        racers = [
            SigningKeys(
                await _on(stack, cluster, node), ring, rotate_after=ROTATE, clock=clock.seconds
            )
            for node in (node_a, node_b)
        ]
        await racers[0].current()  # the deployment's first key
        times = []
        for n in range(ROUNDS):
            clock.t += ROTATE - AHEAD + 1  # the newest key is due for its successor
            started = time.perf_counter()
            sets = await asyncio.gather(*(k.current() for k in racers))
            times.append((time.perf_counter() - started) * 1000)
            stored, _ = await racers[0].read()
            kids = [k.kid for k in stored.keys]
            assert [[k.kid for k in s.keys] for s in sets] == [kids, kids], f"round {n}"
            assert len(set(kids)) == len(kids), kids
            clock.t += AHEAD  # the new key signs
            tokens = await asyncio.gather(*(k.sign(_claims()) for k in racers))
            assert {_kid(t) for t in tokens} == {kids[-1]}, f"round {n}: one signing key"
        stored, _ = await racers[0].read()
        assert len(stored.keys) == 1 + ROUNDS, "one key per round, none lost, none twice"
    print(f"rotation raced by 2 processes on a 3-node cluster: {_figure(times)}")


def _figure(ms: list[float]) -> str:
    ordered = sorted(ms)
    return f"median {ordered[len(ordered) // 2]:.0f} ms, max {ordered[-1]:.0f} ms (RSA 2048 made)"


async def test_a_key_made_on_one_node_is_in_the_jwks_another_nodes_api_serves_at_once(
    cluster: NatsCluster, tmp_path: Path
) -> None:
    """A signer (the secrets responder's keys) on one follower, an api on the other, one
    clock. After each rotation the signer does, and once the new key signs, a token it
    signed verifies against the JWKS the api serves right then: the api has dropped the
    set it cached and read the leader's, not a replica's that may lag. The first key
    signs at once, so the first token checks that too."""
    clock = Clock()
    async with AsyncExitStack() as stack:
        await _on(stack, cluster, cluster.nodes[0])  # the streams and buckets declared
        _, node_a, node_b = await _followers(cluster)
        opts = options_for(tmp_path, workload_key_rotation=int(ROTATE))
        signer = built(
            await _on(stack, cluster, node_a), stack, tmp_path, opts=opts, clock=clock.now
        )
        api = built(await _on(stack, cluster, node_b), stack, tmp_path, opts=opts, clock=clock.now)
        projector = await stack.enter_async_context(api.projector(tmp_path / "rm.sqlite"))
        web = api.web_app(projector, admin_token=ADMIN_TOKEN, repositories=None)
        client = await stack.enter_async_context(TestClient(TestServer(web)))
        http = Http(client, web[API], api.app)

        async def served() -> dict[str, Any]:
            a = await http.get("/.well-known/jwks.json", token=None)
            assert a.status == 200, a.body
            return dict(a.body)

        keys = signer.signing
        token = await keys.sign(_claims())
        assert verify(token, await served(), "a")["sub"] == "s", "the first key, at once"
        kids = {_kid(token)}
        for n in range(ROUNDS):
            clock.t += ROTATE - AHEAD + 1
            before = await keys.sign(_claims())  # rotates, signs with the old key
            made, _ = await keys.read()
            newest = made.keys[-1].kid
            assert newest not in kids and _kid(before) in kids, f"round {n}"
            published = await served()
            assert newest in {k["kid"] for k in published["keys"]}, f"round {n}: not served"
            verify(before, published, "a")
            clock.t += AHEAD
            after = await keys.sign(_claims())
            assert _kid(after) == newest, f"round {n}: the new key signs"
            verify(after, await served(), "a")
            kids.add(newest)
        jwks = await served()
        assert all("d" not in k for k in jwks["keys"]), json.dumps(jwks)[:200]
