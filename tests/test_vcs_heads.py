"""What runplane asks a repository before a push starts runs (services/processes/vcs/heads.py),
against real git repositories: a branch's head and an annotated tag's commit by `git
ls-remote`, a gone ref as none; `follows` from a mirror it fetches (never keeping the
repository's URL); refs and commit ids that are not plainly one (a hostile payload's) and
repositories the deployment refuses never reach git; a repository that does not answer
is a retryable error."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.app.repositories import Sources
from services.processes.vcs.heads import GitHeads, HeadsError
from tests.vcs_git_support import commit, git, origin


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return origin(tmp_path)


async def test_the_head_of_a_branch_and_the_commit_of_a_tag(repo: Path, tmp_path: Path) -> None:
    heads = GitHeads(tmp_path / "mirrors")
    first = git(repo, "rev-parse", "HEAD")
    git(repo, "tag", "-a", "v1", "-m", "one")  # annotated: its own object, peeled to first
    git(repo, "tag", "light")
    second = commit(repo, {"net/main.tf": "# 2\n"})
    assert await heads.head(str(repo), "refs/heads/master") == second
    assert await heads.head(str(repo), "refs/tags/v1") == first
    assert await heads.head(str(repo), "refs/tags/light") == first
    assert await heads.head(str(repo), "refs/heads/gone") == ""


async def test_follows_says_whether_a_commit_is_on_the_ref_after_each_line(
    repo: Path, tmp_path: Path
) -> None:
    heads = GitHeads(tmp_path / "mirrors")
    a = commit(repo, {"net/main.tf": "# A\n"})
    b = commit(repo, {"net/main.tf": "# B\n"})
    c = commit(repo, {"net/main.tf": "# C\n"})
    git(repo, "checkout", "-q", "-b", "side", a)
    side = commit(repo, {"net/side.tf": "#\n"})
    git(repo, "checkout", "-q", "master")
    lines = [[], [a], [a, b], [c], [side], ["f" * 40]]
    assert await heads.follows(str(repo), "refs/heads/master", b, lines) == [
        True,  # nothing to come after
        True,
        True,  # b descends from itself
        False,  # c is newer
        False,  # not in b's history
        False,  # unknown to the repository
    ]
    assert await heads.follows(str(repo), "refs/heads/master", side, [[]]) == [False]
    mirror = next((tmp_path / "mirrors").glob("*.git"))
    config = git(mirror, "config", "--list")
    assert str(repo) not in config and "remote." not in config  # the URL is never kept


async def test_without_mirrors_nothing_but_the_head_is_current(repo: Path) -> None:
    a = git(repo, "rev-parse", "HEAD")
    commit(repo, {"net/main.tf": "# B\n"})
    assert await GitHeads(None).follows(str(repo), "refs/heads/master", a, [[]]) == [False]


@pytest.mark.parametrize(
    "ref",
    [
        "refs/heads/--upload-pack=touch /tmp/pwned",
        "refs/heads/-x",
        "refs/heads/a..b",
        "refs/heads/a:refs/heads/b",
        "refs/heads/*",
        "refs/heads/ma^{}",
        "refs/heads/a b",
        "refs/heads/ma\x1bster",
        "refs/remotes/origin/master",
        "refs/pull/1/head",
        "HEAD",
        "master",
        "",
    ],
)
async def test_attack_a_ref_that_is_not_plainly_a_branch_or_tag_never_reaches_git(
    repo: Path, tmp_path: Path, ref: str
) -> None:
    heads = GitHeads(tmp_path / "mirrors")
    with pytest.raises(HeadsError) as e:
        await heads.head(str(repo), ref)
    assert not e.value.retryable
    with pytest.raises(HeadsError):
        await heads.follows(str(repo), ref, "a" * 40, [[]])
    assert not (tmp_path / "mirrors").exists()


@pytest.mark.parametrize("sha", ["--all", "HEAD", "A" * 40, "a" * 39, "a" * 40 + "\n", "master"])
async def test_attack_what_is_not_a_full_commit_id_never_reaches_git(
    repo: Path, tmp_path: Path, sha: str
) -> None:
    heads = GitHeads(tmp_path / "mirrors")
    for commit_id, lines in ((sha, [[]]), ("a" * 40, [[sha]])):
        with pytest.raises(HeadsError) as e:
            await heads.follows(str(repo), "refs/heads/master", commit_id, lines)
        assert not e.value.retryable
    assert not (tmp_path / "mirrors").exists()


async def test_a_repository_the_deployment_refuses_is_not_asked(repo: Path, tmp_path: Path) -> None:
    sources = Sources.parse("https://").guarding(repo.parent, "a runplane directory")
    heads = GitHeads(tmp_path / "mirrors", sources=sources)
    with pytest.raises(HeadsError) as e:
        await heads.head(str(repo), "refs/heads/master")
    assert not e.value.retryable


async def test_a_repository_that_does_not_answer_is_a_retryable_error(tmp_path: Path) -> None:
    heads = GitHeads(tmp_path / "mirrors", timeout=10)
    with pytest.raises(HeadsError) as e:
        await heads.head(str(tmp_path / "nowhere"), "refs/heads/master")
    assert e.value.retryable
