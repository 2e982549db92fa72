"""Replayed pushes on a 3-node NATS JetStream cluster (streams at R3): two API replicas,
each connected to a node of its own (its reads may be answered by a follower that is
behind), each with its own read model and its own git mirrors, are handed one GitHub push
under many delivery ids at once: exactly one run starts, one delivery is recorded as
having started it and every other as its duplicate; then, the branch moved on and the
newer push applied, the old push once more through each replica is stale on both."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import nats
import pytest
from aiohttp.test_utils import TestClient, TestServer

from events import vcs
from events.run import RunCreated
from infra import streams
from services.processes.vcs.heads import GitHeads
from services.surfaces.api.context import API
from tests.api_support import Http, web_app_of
from tests.bootstrap_support import built
from tests.cluster_support import NatsCluster
from tests.vcs_git_support import applied_at, commit, host_git, origin, push_of, redirect
from tests.vcs_support import GITHUB_REPO, connection, deliver

ORG = "acme"


@pytest.fixture
async def replicas(tmp_path: Path) -> AsyncIterator[list[Http]]:
    """Two API replicas on nodes 0 and 1 of a fresh cluster."""
    async with NatsCluster(tmp_path / "cluster", size=3) as cluster, AsyncExitStack() as stack:
        conns = []
        for node in cluster.nodes[:2]:
            nc = await nats.connect(node.url, **cluster.auth.connect_options())
            stack.push_async_callback(nc.close)
            conns.append(nc)
        await streams.declare(conns[0], conns[0].jetstream(), replicas=3)
        out = []
        for i, nc in enumerate(conns):
            plane = built(nc, stack, tmp_path)
            projector = await stack.enter_async_context(plane.projector(tmp_path / f"rm{i}.db"))
            heads = GitHeads(tmp_path / f"mirrors{i}", timeout=30, access=host_git(plane))
            web_app = web_app_of(plane, projector, vcs_heads=heads)
            client = await stack.enter_async_context(TestClient(TestServer(web_app)))
            out.append(Http(client, web_app[API], plane.app))
        yield out


async def _created(http: Http) -> list[RunCreated]:
    envs = await http.app.store.read(f"rp.run.{ORG}.>")
    return [e.event for e in envs if isinstance(e.event, RunCreated)]


async def test_replayed_pushes_race_through_two_replicas_on_a_cluster(
    replicas: list[Http], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = origin(tmp_path)
    redirect(monkeypatch, repo)
    one, two = replicas
    await one.org(ORG)
    conn = await connection(one)
    fields = {"repository": GITHUB_REPO, "branch": "master", "vcs_connection": conn["id"]}
    await one.workspace(ORG, "net", directory="net", **fields)
    a = commit(repo, {"net/main.tf": "# A\n"})

    async def send(http: Http, sha: str, delivery: str) -> dict[str, Any]:
        body = push_of(sha, ["net/main.tf"])
        answer = await deliver(http, conn["id"], "push", body, delivery=delivery)
        assert answer.status == 200, answer.body
        return answer.body  # type: ignore[no-any-return]  # JSON object

    sends = [send(replicas[i % 2], a, f"a-{i}") for i in range(8)]
    answers = await asyncio.gather(*sends)
    started = [x for x in answers if x["runs"]]
    assert len(started) == 1, answers
    owner = started[0]["delivery"]
    assert sorted(x.get("duplicate_of", "") for x in answers if not x["runs"]) == [owner] * 7
    (run_a,) = await _created(one)
    assert run_a.cause is not None and run_a.cause.delivery == owner
    for d in (f"a-{i}" for i in range(8)):
        envs = await one.app.store.read(vcs.delivery_subject(ORG, conn["id"], d))
        assert len(envs) == 1, (d, envs)

    await applied_at(one.app, ORG, "net", run_a.run_id, a)
    b = commit(repo, {"net/extra.tf": "# B\n"})
    (run_b,) = (await send(two, b, "b-1"))["runs"]
    await applied_at(two.app, ORG, "net", run_b["run_id"], b)
    replays = await asyncio.gather(send(one, a, "a-replayed-1"), send(two, a, "a-replayed-2"))
    assert [(x["runs"], x["ignored"], x["stale"]) for x in replays] == [([], "stale", ["net"])] * 2
    assert len(await _created(two)) == 2
