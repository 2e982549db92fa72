"""The PR's one comment, its id event-sourced: concurrent plans of many workspaces (and
two reporters, as two replicas) end in ONE comment holding every row; a restart edits it,
a new commit's rows replace the old, an old run's late event never puts its row back; a
claimant that died is taken over without a second comment; a deleted comment is posted
anew; and nothing a tenant writes can mention anyone through the comment."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from events import vcs_report as vr
from events.react import POLICY_REASON
from events.run import SUCCEEDED, RunState, Status
from infra.consumer import Retry
from infra.eventstore import Append, EventStore
from services.processes.vcs import comment
from services.processes.vcs.client import Policy
from services.processes.vcs.github import GitHubClient
from services.processes.vcs.prrun import PrRun, Verdict, verdict
from services.processes.vcs.report import Reporter
from tests.vcs_report_support import Comment, FakeVcs

SHA1 = "1111111111111111111111111111111111111111"
SHA2 = "2222222222222222222222222222222222222222"
T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
POLICY = Policy(allow=frozenset({"loopback"}), timeout=5.0)


async def _no_lookup(org: str, conn: str) -> None:
    return None


def _pr(ws: str, *, n: int = 0, commit: str = SHA1, seq: int = 1, run: str = "") -> PrRun:
    return PrRun(
        org="acme",
        workspace=ws,
        run_id=run or f"run-{ws}-{commit[:2]}",
        connection="conn1",
        repository="acme/net",
        pull_request=42,
        commit=commit,
        created_at=T0 + timedelta(seconds=n),
        seq=seq,
        verdict=Verdict("success", "planned", "+1 ~0 -0"),
        plan=(1, 0, 0),
    )


@pytest.fixture
async def vcs() -> AsyncIterator[FakeVcs]:
    async with FakeVcs() as server:
        yield server


def _reporter(store: EventStore, **kw: object) -> Reporter:
    return Reporter(store, _no_lookup, POLICY, base_url="http://rp.example", **kw)  # type: ignore[arg-type]


async def _rows(store: EventStore, pr: PrRun) -> vr.PrReport:
    envs = await store.read(vr.subject("acme", pr.key))
    return vr.fold([e.event for e in envs])  # type: ignore[misc]


def _table(body: str) -> list[str]:
    return [line for line in body.splitlines() if line.startswith("| `")]


async def test_ten_concurrent_plans_on_two_replicas_end_in_one_comment_with_ten_rows(
    store: EventStore, vcs: FakeVcs
) -> None:
    """Every plan is shown at once by one of two reporters (replicas): one comment, with
    all ten rows, though the VCS applies concurrent edits out of the order they were sent."""
    replicas = [_reporter(store), _reporter(EventStore(store.nc))]
    client = GitHubClient(vcs.url, "tok", POLICY)
    prs = [_pr(f"ws-{i}", n=i) for i in range(10)]
    await asyncio.gather(*(_shown(replicas[i % 2], client, pr) for i, pr in enumerate(prs)))
    assert len(vcs.created()) == 1
    await _check_rows(store, vcs, prs)
    # Then ten more plans land while the edits are in flight (each a few ms after the
    # last, every edit held up to 50 ms): an edit rendered before a row was recorded
    # must never be the last to land.
    vcs.edit_jitter = 0.05
    more = [_pr(f"ws-{i}", n=i) for i in range(10, 20)]

    async def staggered(i: int, pr: PrRun) -> None:
        await asyncio.sleep(0.005 * i)  # the load's shape, not a wait for a result
        await _shown(replicas[i % 2], client, pr)

    await asyncio.gather(*(staggered(i, pr) for i, pr in enumerate(more)))
    await client.aclose()
    assert len(vcs.created()) == 1
    await _check_rows(store, vcs, prs + more)


async def _shown(reporter: Reporter, client: GitHubClient, pr: PrRun) -> None:
    """`show` as the consumer runs it: a Retry (another holds the claim) comes back."""
    for _ in range(100):
        try:
            await reporter.show(client, pr)
            return
        except Retry:
            await asyncio.sleep(0.02)  # the consumer's nak delay, shortened
    raise AssertionError(f"{pr.workspace} never shown")


async def _check_rows(store: EventStore, vcs: FakeVcs, prs: list[PrRun]) -> None:
    [posted] = vcs.comments.values()
    assert posted.pr == "acme/net#42"
    shown = sorted(r.split("`")[1] for r in _table(posted.body))
    assert shown == sorted(pr.workspace for pr in prs)
    state = await _rows(store, prs[0])
    assert state.comment_id == posted.id and len(state.rows) == len(prs)


async def test_a_restart_edits_the_same_comment_and_a_new_commit_replaces_rows(
    store: EventStore, vcs: FakeVcs
) -> None:
    client = GitHubClient(vcs.url, "tok", POLICY)
    await _reporter(store).show(client, _pr("net", n=0))
    await _reporter(store).show(client, _pr("dns", n=1))
    # a new commit: net's new run; then the old run's late event (a higher seq, older run)
    await _reporter(EventStore(store.nc)).show(client, _pr("net", n=5, commit=SHA2))
    late = replace(_pr("net", n=0), seq=99, verdict=Verdict("failure", "errored", "errored"))
    await _reporter(store).show(client, late)
    await client.aclose()
    assert len(vcs.created()) == 1
    [posted] = vcs.comments.values()
    rows = {r.split("`")[1]: r for r in _table(posted.body)}
    assert set(rows) == {"net", "dns"}
    assert SHA2[:7] in rows["net"] and "planned" in rows["net"]
    assert SHA1[:7] in rows["dns"]
    assert f"Latest commit: `{SHA2[:12]}`" in posted.body
    assert len(vcs.of("PATCH")) >= 2


async def test_a_claimant_that_died_is_taken_over_adopting_its_comment(
    store: EventStore, vcs: FakeVcs
) -> None:
    """A reporter claimed, posted and died before linking: past CLAIM_TTL the next one
    finds that comment by its marker and edits it: still one comment."""
    pr = _pr("net")
    subject = vr.subject("acme", pr.key)
    dead = vr.CommentClaimed(at=T0, actor="vcs", claim="dead")
    await store.append([Append(subject=subject, event=dead, expected=0)])
    vcs.comments[7] = _comment_of(7, "acme/net#42", comment.marker(pr.key) + "\nold")
    later = _reporter(store, clock=lambda: T0 + vr.CLAIM_TTL + timedelta(seconds=1))
    client = GitHubClient(vcs.url, "tok", POLICY)
    await later.show(client, pr)
    await client.aclose()
    assert vcs.created() == []
    assert "| `net` |" in vcs.comments[7].body
    assert (await _rows(store, pr)).comment_id == 7


async def test_a_live_claim_makes_others_wait_not_post(store: EventStore, vcs: FakeVcs) -> None:
    pr = _pr("net")
    subject = vr.subject("acme", pr.key)
    live = vr.CommentClaimed(at=T0, actor="vcs", claim="live")
    await store.append([Append(subject=subject, event=live, expected=0)])
    client = GitHubClient(vcs.url, "tok", POLICY)
    with pytest.raises(Retry, match="another reporter"):
        await _reporter(store, clock=lambda: T0 + timedelta(seconds=5)).show(client, pr)
    await client.aclose()
    assert vcs.created() == []


async def test_a_deleted_comment_is_posted_anew_and_linked(store: EventStore, vcs: FakeVcs) -> None:
    client = GitHubClient(vcs.url, "tok", POLICY)
    await _reporter(store).show(client, _pr("net"))
    first = (await _rows(store, _pr("net"))).comment_id
    del vcs.comments[first]  # someone deleted it on the PR
    await _reporter(store).show(client, _pr("dns", n=1))
    await client.aclose()
    second = (await _rows(store, _pr("net"))).comment_id
    assert second != first and len(vcs.created()) == 2
    assert len(_table(vcs.comments[second].body)) == 2


def _comment_of(cid: int, pr: str, body: str) -> Comment:
    return Comment(cid, pr, body)


# ---------------------------------------------------------------- what the comment says


@pytest.mark.parametrize(
    "name",
    [
        "@everyone",
        "@acme/admins",
        "x](http://evil.example) @here",
        "<img src=x onerror=1>",
        "a`b|c",
    ],
)
def test_a_workspace_name_cannot_mention_link_or_break_the_table(name: str) -> None:
    """Workspace names are validated at creation; the comment reduces any name to id
    characters again, so neither a mention, a link, HTML nor a table cell escapes."""
    row = vr.PrRow(
        workspace=name,
        run_id="r1",
        commit=SHA1,
        status="planned",
        add=1,
        change=2,
        destroy=3,
        created_at=T0,
        event_seq=1,
    )
    state = vr.PrReport(rows={name: row})
    body = comment.render(state, key="pkey", org="acme", base_url="http://rp.example")
    text = body.replace(comment.marker("pkey"), "")
    assert "@" not in text and "<" not in text and "](http://evil" not in text
    [line] = _table(body)
    assert line.count("|") == 6 and line.count("`") == 4
    assert "+1 ~2 -3" in line


def test_only_runplanes_words_and_numbers_reach_the_comment() -> None:
    """A row's status outside runplane's vocabulary (it could only come from a bug or a
    forged event) is shown as `unknown`; a commit that is not hex is not shown."""
    row = vr.PrRow(
        workspace="net",
        run_id="r1",
        commit="@everyone",
        status="Error: @everyone see https://evil",
        created_at=T0,
        event_seq=1,
    )
    body = comment.render(vr.PrReport(rows={"net": row}), key="k", org="acme", base_url="")
    assert "@" not in body.replace(comment.marker("k"), "") and "evil" not in body
    assert re.search(r"\| `net` \| unknown \| - \| - \|", body)


@pytest.mark.parametrize("status", list(Status))
def test_every_status_maps_to_a_word_the_comment_shows(status: Status) -> None:
    """What `verdict` says of any run status is one of the comment's words (a new status
    without a word would show as `unknown`), and only a good end is a success."""
    v = verdict(RunState(run_id="r", status=status, reason=POLICY_REASON))
    assert v.word in comment.WORDS
    assert (v.state == "success") == (status in SUCCEEDED)
