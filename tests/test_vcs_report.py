"""The VCS reporter as a subscriber, on a real NATS, against a local GitHub and GitLab.

A speculative plan caused by a pull request gets a commit status per workspace on the
PR's head commit (`pending` when created and planning, then `success` with its counts or
`failure` with a word, linking the run) and a row in the PR's one comment; 5xx / 429 are
retried with backoff, other 4xx are final; a hanging VCS delays no other tenant's; and
nothing of a tenant's (its error text, another organization's connection) gets through.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from events import run as R
from events.codec import run_subject
from events.values import Cause, PlanSummary
from infra.consumer import Consumer, Received, Retry
from infra.crypto import KeyRing
from infra.eventstore import Append, EventStore
from services.app.commands import App
from services.app.secrets import SecretStore
from services.processes.vcs.client import Policy
from services.processes.vcs.report import Reporter, lookup_for, subscription
from tests.helpers import eventually
from tests.vcs_report_support import Call, FakeVcs, OutsideConnects
from tests.vcs_support import saved_connection

SHA = "abcdef0123456789abcdef0123456789abcdef01"
FAST = Policy(allow=frozenset({"loopback"}), timeout=1.0, schedule=(0.05, 0.1, 0.2))
BASE = "https://rp.example"


@dataclass
class Rig:
    app: App
    store: EventStore
    secrets: SecretStore
    reporter: Reporter
    consumer: Consumer | None = None

    async def drained(self) -> bool:
        """Every event handled and settled (none put back to try again)."""
        assert self.consumer is not None
        return await _drained(self.consumer, self.store)

    async def connect(self, org: str, cid: str, provider: str, url: str, token: str) -> None:
        await saved_connection(self.app, self.secrets, org, cid, provider, url, token)

    async def pr_run(
        self, org: str, ws: str, conn: str, provider: str = "github", pr: int = 42
    ) -> str:
        cause = Cause(
            kind="vcs",
            provider=provider,
            connection=conn,
            delivery=f"d-{ws}",
            event="pull_request",
            ref=f"refs/pull/{pr}/head",
            commit=SHA,
            repository="acme/net",
            pull_request=pr,
        )
        result = await self.app.create_run(
            org, ws, "plan", "vcs", cause=cause, commit=SHA, speculative=True
        )
        return str(result.state.run_id)

    async def move(self, org: str, ws: str, run_id: str, *events: Any) -> None:
        """Append run events as a scheduler and an executor would have."""
        subject = run_subject(org, ws, run_id)
        for event in events:
            envs = await self.store.read(subject)
            await self.store.append([Append(subject=subject, event=event, expected=envs[-1].seq)])


@pytest.fixture
async def bare(nc: NATS, app: App, store: EventStore) -> Rig:
    """Two organizations of two workspaces each; no reporter consuming."""
    for org in ("acme", "evil"):
        await app.create_org(org, "alice")
        for ws in ("net", "dns"):
            await app.create_workspace(org, ws, R.Workspace(repository="https://x/r.git"), "alice")
    secrets = SecretStore(nc, KeyRing.generate())
    return Rig(app, store, secrets, Reporter(store, lookup_for(app, secrets), FAST, base_url=BASE))


@pytest.fixture
async def rig(nc: NATS, bare: Rig) -> AsyncIterator[Rig]:
    """`bare`, its reporter consuming run events."""
    async with Consumer(nc, subscription(bare.reporter), states=bare.app.states) as consumer:
        bare.consumer = consumer
        yield bare


@pytest.fixture
async def github() -> AsyncIterator[FakeVcs]:
    async with FakeVcs(prefix="/api/v3") as server:
        yield server


@pytest.fixture
async def gitlab() -> AsyncIterator[FakeVcs]:
    async with FakeVcs(prefix="/api/v4") as server:
        yield server


def _at(app: App) -> dict[str, Any]:
    return {"at": app.clock(), "actor": "executor"}


def _planning(app: App) -> R.PhaseStarted:
    return R.PhaseStarted(
        **_at(app), phase="plan", lease_id="l1", executor_id="e1", status=R.Status.PLANNING
    )


def _planned(app: App, add: int, change: int, destroy: int) -> R.PlanFinished:
    return R.PlanFinished(
        **_at(app),
        lease_id="l1",
        commit=SHA,
        has_changes=True,
        summary=PlanSummary(add=add, change=change, destroy=destroy),
        status=R.Status.PLANNED,
        step_at=1,
    )


async def _statuses(vcs: FakeVcs, n: int) -> list[Call]:
    got = vcs.statuses()
    assert len(got) >= n, got
    return got


async def test_a_pr_plan_posts_pending_then_success_with_counts_and_one_comment(
    rig: Rig, github: FakeVcs
) -> None:
    await rig.connect("acme", "gh1", "github", github.url, "ghp-acme")
    run_id = await rig.pr_run("acme", "net", "gh1")
    first = await eventually(lambda: _statuses(github, 1), what="the pending status")
    assert first[0].path == f"/repos/acme/net/statuses/{SHA}"
    assert first[0].auth == "token ghp-acme"
    link = f"{BASE}/orgs/acme/workspaces/net/runs/{run_id}"
    assert first[0].body == {
        "state": "pending",
        "context": "runplane/net",
        "description": "queued",
        "target_url": link,
    }
    await rig.move("acme", "net", run_id, _planning(rig.app), _planned(rig.app, 2, 1, 0))
    got = await eventually(
        lambda: _last_is(github, "success"), what="the success status", timeout=15
    )
    assert got.body == {
        "state": "success",
        "context": "runplane/net",
        "description": "+2 ~1 -0",
        "target_url": link,
    }
    assert {c.body["state"] for c in github.statuses()} <= {"pending", "success"}
    await eventually(lambda: _comment_has(github, "| `net` | planned | +2 ~1 -0 |"))
    assert len(github.created()) == 1


async def _last_is(vcs: FakeVcs, state: str) -> Call:
    got = vcs.statuses()
    assert got and got[-1].body["state"] == state, [c.body for c in got]
    return got[-1]


async def _comment_has(vcs: FakeVcs, text: str) -> bool:
    assert len(vcs.comments) == 1, vcs.comments
    [c] = vcs.comments.values()
    assert text in c.body, c.body
    return True


async def test_gitlab_gets_failed_and_an_mr_note(rig: Rig, gitlab: FakeVcs) -> None:
    await rig.connect("acme", "gl1", "gitlab", gitlab.url, "glpat-acme")
    run_id = await rig.pr_run("acme", "dns", "gl1", provider="gitlab", pr=5)
    failed = R.RunFailed(**_at(rig.app), reason="step_failed", message="boom")
    await rig.move("acme", "dns", run_id, _planning(rig.app), failed)
    got = await eventually(lambda: _last_is(gitlab, "failed"), what="failed", timeout=15)
    assert got.path == f"/projects/acme%2Fnet/statuses/{SHA}"
    assert got.auth == "glpat-acme"
    assert got.body["name"] == "runplane/dns" and got.body["description"] == "errored"
    await eventually(lambda: _comment_has(gitlab, "| `dns` | errored | - |"))
    [note] = gitlab.comments.values()
    assert note.pr == "acme%2Fnet#5"


async def test_no_error_text_of_the_tenants_reaches_the_vcs(rig: Rig, github: FakeVcs) -> None:
    """A run's error is its Terraform's output: a hostile tenant's could mention, link or
    inject markdown; only the word `errored` (or `policy failed`) is ever sent."""
    await rig.connect("acme", "gh1", "github", github.url, "ghp-acme")
    run_id = await rig.pr_run("acme", "net", "gh1")
    hostile = "@everyone see [here](https://evil.example) <img src=x> `x` | y"
    failed = R.RunFailed(**_at(rig.app), reason="policy_failed", message=hostile)
    await rig.move("acme", "net", run_id, _planning(rig.app), failed)
    got = await eventually(lambda: _last_is(github, "failure"), what="failure", timeout=15)
    assert got.body["description"] == "policy failed"
    await eventually(lambda: _comment_has(github, "| `net` | policy failed |"))
    sent = repr([c.body for c in github.calls])
    assert "evil" not in sent and "@everyone" not in sent and "<img" not in sent


async def test_5xx_and_429_are_retried_with_backoff_until_posted(rig: Rig, github: FakeVcs) -> None:
    await rig.connect("acme", "gh1", "github", github.url, "ghp-acme")
    github.fail = [502, 429]
    await rig.pr_run("acme", "net", "gh1")
    await eventually(lambda: _comment_has(github, "| `net` | queued |"), what="the comment")
    # the two refused and the one that landed, then the comment (not before)
    assert github.fail == []
    assert [c.method for c in github.calls[:3]] == ["POST"] * 3
    assert len(github.statuses()) == 3


async def test_another_4xx_is_final_and_not_retried(rig: Rig, github: FakeVcs) -> None:
    await rig.connect("acme", "gh1", "github", github.url, "ghp-acme")
    github.fail = [422]
    await rig.pr_run("acme", "net", "gh1")
    await eventually(lambda: _n_calls(github, 1))
    await eventually(rig.drained, what="the event settled")
    assert len(github.calls) == 1 and github.comments == {}


async def _n_calls(vcs: FakeVcs, n: int) -> bool:
    return len(vcs.calls) >= n


async def test_one_tenants_hanging_vcs_delays_no_other(rig: Rig, github: FakeVcs) -> None:
    async with FakeVcs() as hanging:
        hanging.hang = True
        await rig.connect("evil", "slow", "github", hanging.url, "t")
        await rig.connect("acme", "gh1", "github", github.url, "ghp-acme")
        for ws in ("net", "dns"):
            await rig.pr_run("evil", ws, "slow")
        await eventually(lambda: _n_calls(hanging, 2), what="the hanging calls")
        await rig.pr_run("acme", "net", "gh1")
        # the hanging connection holds its own slots: acme's status goes at once
        await eventually(lambda: _last_is(github, "pending"), timeout=0.9, what="acme's status")


# ---------------------------------------------------------------- attacks


async def test_a_run_cannot_post_with_another_organizations_connection(
    rig: Rig, github: FakeVcs
) -> None:
    """evil's run names acme's connection id: looked up within evil it does not exist,
    so acme's token is never sent anywhere."""
    await rig.connect("acme", "gh-acme", "github", github.url, "ghp-acme-secret")
    await rig.pr_run("evil", "net", "gh-acme")
    await eventually(rig.drained, what="the event settled")
    await rig.pr_run("acme", "net", "gh-acme")  # acme's own run on it does post
    await eventually(lambda: _n_calls(github, 1))
    assert all(c.path.startswith("/repos/acme/net/") for c in github.calls)
    assert "evil" not in repr(github.calls)


async def test_an_api_url_at_the_metadata_service_or_loopback_is_refused_at_send(
    nc: NATS, app: App, store: EventStore, github: FakeVcs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the deployment's default (nothing allowed), a connection pointing at
    localhost (where the fake VCS listens) or 169.254.169.254 is refused when sending:
    no request reaches anything, the refusal is final (not retried)."""
    outside = OutsideConnects(monkeypatch)
    await app.create_org("acme", "alice")
    await app.create_workspace("acme", "net", R.Workspace(repository="https://x/r.git"), "alice")
    await app.create_workspace("acme", "dns", R.Workspace(repository="https://x/r.git"), "alice")
    secrets = SecretStore(nc, KeyRing.generate())
    strict = Policy(timeout=1.0, schedule=(0.05,))
    reporter = Reporter(store, lookup_for(app, secrets), strict, base_url=BASE)
    rig = Rig(app, store, secrets, reporter)
    local = github.url.replace("127.0.0.1", "localhost")
    await rig.connect("acme", "loop", "github", local, "t1")
    await rig.connect("acme", "meta", "gitlab", "http://169.254.169.254/api/v4", "t2")
    async with Consumer(nc, subscription(reporter), states=app.states) as consumer:
        await rig.pr_run("acme", "net", "loop")
        await rig.pr_run("acme", "dns", "meta")
        await eventually(lambda: _drained(consumer, store), what="both handled")
    assert github.calls == [] and outside.tried == []
    assert reporter.reported == 0


async def _drained(consumer: Consumer, store: EventStore) -> bool:
    info = await store.nc.jetstream().consumer_info("RP_EVENTS", consumer.durable)
    return info.num_ack_pending == 0 and info.num_pending == 0


async def test_ten_workspaces_planned_at_once_end_in_one_comment_with_ten_rows(
    rig: Rig, github: FakeVcs
) -> None:
    await rig.connect("acme", "gh1", "github", github.url, "ghp-acme")
    names = [f"w{i}" for i in range(10)]
    for ws in names:
        await rig.app.create_workspace("acme", ws, R.Workspace(repository="https://x/r.git"), "a")
    github.edit_jitter = 0.03
    runs = await asyncio.gather(*(rig.pr_run("acme", ws, "gh1") for ws in names))
    await asyncio.gather(
        *(
            rig.move("acme", ws, run, _planning(rig.app), _planned(rig.app, i, 0, 1))
            for i, (ws, run) in enumerate(zip(names, runs, strict=True))
        )
    )

    async def all_rows() -> bool:
        assert len(github.comments) == 1
        [c] = github.comments.values()
        for i, ws in enumerate(names):
            assert f"| `{ws}` | planned | +{i} ~0 -1 |" in c.body, c.body
        return True

    await eventually(all_rows, what="ten rows", timeout=30)
    await eventually(rig.drained, what="every event settled")
    await all_rows()  # still: no late edit took a row away
    assert len(github.created()) == 1
    finals = {c.body["context"]: c.body for c in github.statuses() if c.body["state"] == "success"}
    assert set(finals) == {f"runplane/{ws}" for ws in names}


async def test_a_late_redelivery_posts_the_runs_status_now_not_its_own(
    rig: Rig, github: FakeVcs
) -> None:
    """run.created handled again after the plan finished (a redelivery, another replica
    behind) posts `success`, never `pending` over it; the replica that posted it last
    posts nothing again."""
    await rig.connect("acme", "gh1", "github", github.url, "ghp-acme")
    run_id = await rig.pr_run("acme", "net", "gh1")
    await rig.move("acme", "net", run_id, _planning(rig.app), _planned(rig.app, 1, 0, 0))
    await eventually(lambda: _last_is(github, "success"), timeout=15)
    await eventually(rig.drained)
    subject = run_subject("acme", "net", run_id)
    envs = await rig.store.read(subject)
    created = envs[0]
    late = Received(
        seq=created.seq,
        subject=subject,
        type="run.created",
        event=created.event,
        timestamp=rig.app.clock(),
        num_delivered=2,
        headers={},
        state=R.fold([created.event]),  # type: ignore[list-item]
        last_seq=envs[-1].seq,
    )
    before = len(github.statuses())
    await rig.reporter.handle(late)  # the replica that posted it: nothing again
    assert github.statuses()[before:] == []
    replica = Reporter(rig.store, rig.reporter.lookup, FAST, base_url=BASE)
    await replica.handle(late)  # another replica, behind: the status now
    assert [c.body["state"] for c in github.statuses()[before:]] == ["success"]


async def test_a_connection_with_too_many_reports_waiting_puts_the_next_back(
    bare: Rig, github: FakeVcs
) -> None:
    """One call in flight per connection and one report waiting: a third report of the
    hanging connection is put back at once (Retry: it holds no consumer room while it
    waits), and another organization's connection goes on meanwhile."""
    tight = Reporter(
        bare.store,
        bare.reporter.lookup,
        Policy(allow=frozenset({"loopback"}), timeout=10.0, per_connection=1, waiting=1),
        base_url=BASE,
    )
    async with FakeVcs() as hanging:
        hanging.hang = True
        await bare.connect("evil", "slow", "github", hanging.url, "t")
        await bare.connect("acme", "gh1", "github", github.url, "ghp-acme")
        await bare.app.create_workspace(
            "evil", "w3", R.Workspace(repository="https://x/r.git"), "a"
        )
        subjects = [
            run_subject("evil", ws, await bare.pr_run("evil", ws, "slow"))
            for ws in ("net", "dns", "w3")
        ]
        acme = run_subject("acme", "net", await bare.pr_run("acme", "net", "gh1"))
        first = asyncio.create_task(tight.report(subjects[0], "evil", "slow"))
        await eventually(lambda: _lane(tight, "slow", users=1, waiting=0))
        second = asyncio.create_task(tight.report(subjects[1], "evil", "slow"))
        await eventually(lambda: _lane(tight, "slow", users=2, waiting=1))
        with pytest.raises(Retry):
            await tight.report(subjects[2], "evil", "slow")
        before = len(github.statuses())
        await asyncio.wait_for(tight.report(acme, "acme", "gh1"), 3.0)
        assert len(github.statuses()) > before
        for task in (first, second):
            task.cancel()
        await asyncio.gather(first, second, return_exceptions=True)
    assert tight._lanes == {} and tight._orgs == {}


async def _lane(reporter: Reporter, conn: str, *, users: int, waiting: int) -> bool:
    lane = reporter._lanes.get(conn)
    assert lane is not None and (lane.users, lane.waiting) == (users, waiting)
    return True
