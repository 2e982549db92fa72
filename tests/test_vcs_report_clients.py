"""The VCS clients against a local GitHub / GitLab: each call's method, path, auth header
and body; which answers are retried; and the SSRF guard judging the address actually
connected to, under githubkit's httpx transport and python-gitlab's requests session."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest

from services.processes.vcs.client import Gone, Policy, VcsError
from services.processes.vcs.github import GitHubClient
from services.processes.vcs.gitlab import GitLabClient
from tests.vcs_report_support import FakeVcs, OutsideConnects

SHA = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "ghp-test-token-abc"
LOOPBACK = Policy(allow=frozenset({"loopback"}), timeout=2.0)


@pytest.fixture
async def vcs() -> AsyncIterator[FakeVcs]:
    async with FakeVcs() as server:
        yield server


@pytest.fixture
async def ghe() -> AsyncIterator[FakeVcs]:
    async with FakeVcs(prefix="/api/v3") as server:
        yield server


@pytest.fixture
async def gl() -> AsyncIterator[FakeVcs]:
    async with FakeVcs(prefix="/api/v4") as server:
        yield server


async def test_github_status_is_posted_on_the_commit_with_the_token(vcs: FakeVcs) -> None:
    client = GitHubClient(vcs.url, TOKEN, LOOPBACK)
    await client.set_status(
        "acme/net",
        SHA,
        state="success",
        context="runplane/net",
        description="+2 ~1 -0",
        url="http://rp.example/orgs/a/workspaces/net/runs/r1",
    )
    await client.aclose()
    [call] = vcs.calls
    assert (call.method, call.path, call.auth) == (
        "POST",
        f"/repos/acme/net/statuses/{SHA}",
        f"token {TOKEN}",
    )
    assert call.body == {
        "state": "success",
        "context": "runplane/net",
        "description": "+2 ~1 -0",
        "target_url": "http://rp.example/orgs/a/workspaces/net/runs/r1",
    }


async def test_github_enterprise_comment_is_created_found_and_edited(ghe: FakeVcs) -> None:
    """The api_url's path (GitHub Enterprise's /api/v3) is kept before every route."""
    client = GitHubClient(ghe.url, TOKEN, LOOPBACK)
    cid = await client.create_comment("acme/net", 7, "<!-- m1 -->\nhello")
    assert await client.find_comment("acme/net", 7, "<!-- m1 -->") == cid
    assert await client.find_comment("acme/net", 8, "<!-- m1 -->") == 0
    await client.edit_comment("acme/net", 7, cid, "<!-- m1 -->\nbye")
    await client.aclose()
    assert [(c.method, c.path) for c in ghe.calls] == [
        ("POST", "/repos/acme/net/issues/7/comments"),
        ("GET", "/repos/acme/net/issues/7/comments"),
        ("GET", "/repos/acme/net/issues/8/comments"),
        ("PATCH", f"/repos/acme/net/issues/comments/{cid}"),
    ]
    assert all(c.auth == f"token {TOKEN}" for c in ghe.calls)
    assert ghe.calls[0].body == {"body": "<!-- m1 -->\nhello"}
    assert ghe.comments[cid].body == "<!-- m1 -->\nbye"


async def test_gitlab_status_and_note_shapes(gl: FakeVcs) -> None:
    """GitLab: the project's path percent-encoded, `failed` for a failure, `name` as the
    context, PRIVATE-TOKEN; notes created, listed and PUT on the merge request."""
    client = GitLabClient(gl.url, TOKEN, LOOPBACK)
    await client.set_status(
        "acme/infra/net",
        SHA,
        state="failure",
        context="runplane/net",
        description="errored",
        url="",
    )
    nid = await client.create_comment("acme/infra/net", 3, "<!-- m2 -->\nrows")
    assert await client.find_comment("acme/infra/net", 3, "<!-- m2 -->") == nid
    await client.edit_comment("acme/infra/net", 3, nid, "<!-- m2 -->\nmore rows")
    project = "acme%2Finfra%2Fnet"
    assert [(c.method, c.path) for c in gl.calls] == [
        ("POST", f"/projects/{project}/statuses/{SHA}"),
        ("POST", f"/projects/{project}/merge_requests/3/notes"),
        ("GET", f"/projects/{project}/merge_requests/3/notes"),
        ("PUT", f"/projects/{project}/merge_requests/3/notes/{nid}"),
    ]
    assert all(c.auth == TOKEN for c in gl.calls)
    assert gl.calls[0].body == {"state": "failed", "name": "runplane/net", "description": "errored"}
    assert gl.calls[1].body == {"body": "<!-- m2 -->\nrows"}
    assert gl.comments[nid].body == "<!-- m2 -->\nmore rows"


async def test_gitlab_status_already_in_that_state_is_done(gl: FakeVcs) -> None:
    """GitLab answers 400 to a status posted again in the state it is in (a redelivered
    event): that is success, not an error to retry or log."""
    gl.fail, gl.fail_body = [400], '{"message": "Cannot transition status via :run from :running"}'
    client = GitLabClient(gl.url, TOKEN, LOOPBACK)
    await client.set_status("acme/net", SHA, state="pending", context="c", description="d", url="")
    gl.fail, gl.fail_body = [400], '{"message": "state is invalid"}'
    with pytest.raises(VcsError) as e:
        await client.set_status(
            "acme/net", SHA, state="pending", context="c", description="d", url=""
        )
    assert (e.value.status, e.value.retryable) == (400, False)


@pytest.mark.parametrize("provider", ["github", "gitlab"])
@pytest.mark.parametrize(
    ("status", "retryable"), [(500, True), (502, True), (429, True), (422, False), (401, False)]
)
async def test_5xx_and_429_are_retryable_other_4xx_final(
    vcs: FakeVcs, provider: str, status: int, retryable: bool
) -> None:
    vcs.fail = [status]
    client = _client(provider, vcs.url)
    with pytest.raises(VcsError) as e:
        await client.set_status(
            "acme/net", SHA, state="pending", context="c", description="d", url=""
        )
    assert (e.value.status, e.value.retryable) == (status, retryable)
    assert len(vcs.calls) == 1  # no retry of the library's own


@pytest.mark.parametrize("provider", ["github", "gitlab"])
async def test_editing_a_comment_that_is_not_there_is_gone(vcs: FakeVcs, provider: str) -> None:
    client = _client(provider, vcs.url)
    with pytest.raises(Gone):
        await client.edit_comment("acme/net", 1, 424242, "x")


def _client(provider: str, url: str, policy: Policy = LOOPBACK) -> GitHubClient | GitLabClient:
    if provider == "github":
        return GitHubClient(url, TOKEN, policy)
    return GitLabClient(url + "/api/v4" if not url.endswith("/api/v4") else url, TOKEN, policy)


# ---------------------------------------------------------------- the SSRF guard


@pytest.mark.parametrize("provider", ["github", "gitlab"])
@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", "169.254.169.254", "10.0.0.7"])
async def test_an_api_url_on_loopback_private_or_metadata_is_refused_at_send(
    vcs: FakeVcs, provider: str, host: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without RUNPLANE_VCS_ALLOW the guard judges the address connected to: nothing
    reaches the local server, the metadata address or the private one (no connect is
    even tried), and the refusal is final, not retried."""
    outside = OutsideConnects(monkeypatch)
    port = vcs.port if host in ("127.0.0.1", "localhost", "[::1]") else 80
    client = _client(provider, f"http://{host}:{port}", Policy(timeout=2.0))
    with pytest.raises(VcsError) as e:
        await client.set_status(
            "acme/net", SHA, state="pending", context="c", description="d", url=""
        )
    assert "not allowed" in str(e.value)
    assert e.value.retryable is False
    assert vcs.calls == [] and outside.tried == []


@pytest.mark.parametrize("provider", ["github", "gitlab"])
async def test_a_redirect_is_not_followed(
    vcs: FakeVcs, provider: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 3xx (to the metadata service, say) is an answer, never a second request."""
    outside = OutsideConnects(monkeypatch)
    vcs.redirect_to = "http://169.254.169.254/latest/meta-data/"
    client = _client(provider, vcs.url)
    with pytest.raises(VcsError) as e:
        await client.set_status(
            "acme/net", SHA, state="pending", context="c", description="d", url=""
        )
    assert e.value.retryable is False
    assert len(vcs.calls) == 1 and outside.tried == []


@pytest.mark.parametrize("provider", ["github", "gitlab"])
async def test_a_hanging_vcs_is_given_up_at_the_timeout(vcs: FakeVcs, provider: str) -> None:
    vcs.hang = True
    client = _client(provider, vcs.url, Policy(allow=frozenset({"loopback"}), timeout=0.5))
    started = time.monotonic()
    with pytest.raises(VcsError) as e:
        await client.set_status(
            "acme/net", SHA, state="pending", context="c", description="d", url=""
        )
    assert e.value.retryable is True
    # given up at its 0.5 s timeout, not after the hang: bounded loosely, the machine is shared
    assert time.monotonic() - started < 8.0


async def test_a_trickling_gitlab_frees_its_worker_thread_at_the_deadline(vcs: FakeVcs) -> None:
    """A server sending a byte every 0.2 s never trips a per-read timeout; the call's
    deadline shuts its sockets, so the worker thread python-gitlab runs in is free again
    (what a hostile GitLab could otherwise hold for ever, one thread per call)."""
    from services.processes.vcs import gitlab as glmod

    vcs.trickle = True
    client = _client("gitlab", vcs.url, Policy(allow=frozenset({"loopback"}), timeout=0.6))
    started = time.monotonic()
    with pytest.raises(VcsError):
        await client.set_status(
            "acme/net", SHA, state="pending", context="c", description="d", url=""
        )
    # every worker of the pool free again soon after the deadline
    futures = [glmod._POOL.submit(lambda: 1) for _ in range(glmod.THREADS)]
    assert [f.result(timeout=3.0) for f in futures] == [1] * glmod.THREADS
    assert time.monotonic() - started < 4.0
