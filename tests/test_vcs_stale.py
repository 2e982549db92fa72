"""Issue 23 item 9, "a stale push starts nothing" (attack F6: a captured GitHub push
replayed under a new delivery id started an apply of an older commit whose plan destroys
a resource added since). GitHub's own push payload, signed by the test, over a real git
repository the test commits to, asked by the code under test with the git it runs in
production (tests/vcs_git_support.py); real nats-server, API and projector.

A push starts a workspace's run only if its commit is where the branch is when runplane
looks, or is on the branch and after everything the workspace applied or will apply
before it; otherwise the delivery is recorded `stale`. One push (connection, ref, commit)
starts runs once, whatever delivery ids bring it: the others are recorded `duplicate`,
also when they race through the API at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from events import vcs
from events.run import RunCreated
from infra.streams import EVENTS
from services.app.commands import App
from services.processes.vcs.heads import GitHeads
from services.root.bootstrap import Plane
from services.surfaces.api.context import API
from tests.api_support import Http, served
from tests.vcs_git_support import applied_at, commit, git, host_git, origin, push_of, redirect
from tests.vcs_support import GITHUB_REPO, V1, connection, deliver

ORG = "acme"


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """acme/net on GitHub, as git reaches it (a local repository on master)."""
    path = origin(tmp_path)
    redirect(monkeypatch, path)
    return path


@dataclass
class Site:
    """The API asking real git, and acme's GitHub connection (`conn`)."""

    http: Http
    conn: str

    @property
    def app(self) -> App:
        return self.http.app

    async def push(self, sha: str, delivery: str, files: list[str]) -> dict[str, Any]:
        """Deliver GitHub's push of `sha` changing `files`: the 200's body."""
        body = push_of(sha, files)
        a = await deliver(self.http, self.conn, "push", body, delivery=delivery)
        assert a.status == 200, a.body
        return a.body  # type: ignore[no-any-return]  # JSON object

    async def created(self) -> list[RunCreated]:
        envs = await self.app.store.read(f"rp.run.{ORG}.>")
        return [e.event for e in envs if isinstance(e.event, RunCreated)]

    async def recorded(self, delivery: str) -> vcs.DeliveryAccepted:
        envs = await self.app.store.read(vcs.delivery_subject(ORG, self.conn, delivery))
        assert len(envs) == 1, envs
        event = envs[0].event
        assert isinstance(event, vcs.DeliveryAccepted)
        return event

    async def listed(self) -> list[dict[str, Any]]:
        """The deliveries as the API lists them, newest first (read at or past the last
        write: the projection may lag the stream)."""
        at_least = {"RP-Min-Seq": str(await self.last_seq())}
        url = f"{V1}/{ORG}/vcs-connections/{self.conn}/deliveries"
        a = await self.http.get(url, headers=at_least)
        assert a.status == 200, a.body
        return a.body["items"]  # type: ignore[no-any-return]  # JSON list

    async def last_seq(self) -> int:
        info = await self.app.store.nc.jetstream().stream_info(EVENTS)
        return int(info.state.last_seq)


@pytest.fixture
async def site(system: Plane, tmp_path: Path, repo: Path) -> AsyncIterator[Site]:
    """The API asking real git (its mirrors in the test's directory), acme with a GitHub
    connection and workspace `net` (directory net, apply runs) on acme/net's master."""
    heads = GitHeads(tmp_path / "api-mirrors", timeout=30, access=host_git(system))
    async with served(system, tmp_path / "rm.sqlite", ORG, vcs_heads=heads) as (web_app, client):
        http = Http(client, web_app[API], system.app)
        conn = await connection(http)
        fields = {"repository": GITHUB_REPO, "branch": "master", "vcs_connection": conn["id"]}
        await http.workspace(ORG, "net", directory="net", **fields)
        yield Site(http, conn["id"])


async def test_attack_f6_an_old_push_replayed_under_a_new_delivery_id_after_the_branch_moved_on(
    site: Site, repo: Path
) -> None:
    """Push A is applied; the branch moves to B (adding a resource), which is applied;
    A's captured delivery is replayed under a new delivery id: no run starts, and the
    delivery is on the record as ignored, stale for `net` (also where deliveries are
    listed)."""
    a = commit(repo, {"net/main.tf": "# A\n"})
    first = await site.push(a, "d-a", ["net/main.tf"])
    (run_a,) = first["runs"]
    await applied_at(site.app, ORG, "net", run_a["run_id"], a)
    b = commit(repo, {"net/extra.tf": 'resource "null" "added_since" {}\n'})
    second = await site.push(b, "d-b", ["net/extra.tf"])
    (run_b,) = second["runs"]
    await applied_at(site.app, ORG, "net", run_b["run_id"], b)
    before = await site.created()

    replay = await site.push(a, "d-a-replayed", ["net/main.tf"])

    assert replay["runs"] == [] and replay["ignored"] == "stale", replay
    assert replay["stale"] == ["net"]
    assert await site.created() == before
    record = await site.recorded("d-a-replayed")
    assert (record.ignored, record.stale, record.commit, record.runs) == ("stale", ["net"], a, [])
    shown = await site.listed()
    assert [(d["delivery"], d["ignored"]) for d in shown] == [
        ("d-a-replayed", "stale"),
        ("d-b", ""),
        ("d-a", ""),
    ]
    assert shown[0]["stale"] == ["net"] and shown[0]["commit"] == a
    assert shown[1]["runs"] == [{"workspace": "net", "run_id": run_b["run_id"]}]


async def test_a_push_overtaken_by_a_newer_push_still_queued_is_stale(
    site: Site, repo: Path
) -> None:
    """Nothing applied yet: B's delivery came first and its run waits; A's (never seen
    before) would apply after B's and undo it, so it starts nothing."""
    a = commit(repo, {"net/main.tf": "# A\n"})
    b = commit(repo, {"net/extra.tf": "# B\n"})
    assert len((await site.push(b, "d-b", ["net/extra.tf"]))["runs"]) == 1
    late = await site.push(a, "d-a", ["net/main.tf"])
    assert (late["runs"], late["ignored"], late["stale"]) == ([], "stale", ["net"])
    assert [r.commit for r in await site.created()] == [b]


async def test_a_late_push_that_undoes_nothing_still_runs(site: Site, repo: Path) -> None:
    """A is no longer the head, but B changed nothing `net` watches (no run of net
    applied or waits): A is on the branch after all `net` has, so it runs."""
    a = commit(repo, {"net/main.tf": "# A\n"})
    b = commit(repo, {"docs/readme.md": "B\n"})
    assert (await site.push(b, "d-b", ["docs/readme.md"]))["runs"] == []
    late = await site.push(a, "d-a", ["net/main.tf"])
    assert [r["workspace"] for r in late["runs"]] == ["net"] and "ignored" not in late
    assert [r.commit for r in await site.created()] == [a]


async def test_a_commit_a_force_push_left_behind_is_stale(site: Site, repo: Path) -> None:
    base = git(repo, "rev-parse", "HEAD")
    dropped = commit(repo, {"net/main.tf": "# dropped\n"})
    git(repo, "reset", "-q", "--hard", base)
    commit(repo, {"net/main.tf": "# instead\n"})
    late = await site.push(dropped, "d-dropped", ["net/main.tf"])
    assert (late["runs"], late["ignored"]) == ([], "stale")
    assert await site.created() == []


async def test_the_same_push_under_a_new_delivery_id_is_a_duplicate(site: Site, repo: Path) -> None:
    """The branch's head, pushed once (its run starts), then the same (connection, ref,
    commit) under a new delivery id: nothing more starts; the second is recorded as a
    duplicate of the first. The first delivery itself redelivered is a replay."""
    a = commit(repo, {"net/main.tf": "# A\n"})
    first = await site.push(a, "d-1", ["net/main.tf"])
    assert [r["workspace"] for r in first["runs"]] == ["net"]
    again = await site.push(a, "d-2", ["net/main.tf"])
    assert (again["runs"], again["ignored"], again["duplicate_of"]) == ([], "duplicate", "d-1")
    assert len(await site.created()) == 1
    record = await site.recorded("d-2")
    assert (record.ignored, record.duplicate_of, record.runs) == ("duplicate", "d-1", [])
    assert (await site.push(a, "d-1", ["net/main.tf"]))["ignored"] == "replay"
    shown = await site.listed()
    assert [(d["delivery"], d["ignored"], d["duplicate_of"]) for d in shown] == [
        ("d-2", "duplicate", "d-1"),
        ("d-1", "", ""),
    ]


async def test_concurrent_deliveries_of_one_push_start_its_run_once(site: Site, repo: Path) -> None:
    """Eight delivery ids of one push at once: one run; one delivery started it, the
    seven others are recorded duplicates of it."""
    a = commit(repo, {"net/main.tf": "# A\n"})
    answers = await asyncio.gather(*(site.push(a, f"race-{i}", ["net/main.tf"]) for i in range(8)))
    started = [x for x in answers if x["runs"]]
    assert len(started) == 1, answers
    owner = started[0]["delivery"]
    assert sorted(x.get("duplicate_of", "") for x in answers if not x["runs"]) == [owner] * 7
    assert [r.run_id for r in await site.created()] == [started[0]["runs"][0]["run_id"]]


async def test_a_repository_that_cannot_tell_answers_503_and_records_nothing(
    site: Site, repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the branch is cannot be learned (the repository is away): the delivery is a
    503 that writes nothing, and its redelivery, once the repository answers, runs."""
    a = commit(repo, {"net/main.tf": "# A\n"})
    monkeypatch.setenv("GIT_CONFIG_KEY_0", f"url.{(repo.parent / 'gone').as_uri()}.insteadOf")
    last = await site.last_seq()
    body = push_of(a, ["net/main.tf"])
    away = await deliver(site.http, site.conn, "push", body, delivery="d-1")
    away.problem("unavailable", 503)
    assert await site.last_seq() == last
    monkeypatch.setenv("GIT_CONFIG_KEY_0", f"url.{repo.as_uri()}.insteadOf")
    back = await site.push(a, "d-1", ["net/main.tf"])
    assert [r["workspace"] for r in back["runs"]] == ["net"]
