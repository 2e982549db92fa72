"""Webhook payloads of GitHub (@octokit/webhooks-examples) and GitLab (its documented
samples) read into one shape; hostile ones refused; which workspaces a change starts;
the trigger globs; the signature checks; the connection aggregate. No I/O."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from events import vcs
from events.errors import Invalid
from services.processes.vcs import BadPayload, matching, payloads, signing

FIXTURES = Path(__file__).parent / "fixtures" / "vcs"
NOW = datetime(2026, 12, 1, tzinfo=UTC)


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())  # type: ignore[no-any-return]


def raw(data: dict[str, Any]) -> bytes:
    return json.dumps(data).encode()


def binding(ws: str, **kw: Any) -> dict[str, Any]:
    return {
        "workspace": ws,
        "branch": "master",
        "directory": ".",
        "trigger_paths": [],
        "trigger_any_change": False,
        "trigger_tags": [],
        "run_type": "apply",
        **kw,
    }


def test_github_examples_read_as_push_tag_pull_request_and_ping() -> None:
    push = payloads.parse("github", "push", raw(fixture("github/push.branch.json")))
    assert (push.kind, push.branch, push.files) == ("push", "master", ["README.md"])
    assert push.repository == "Codertocat/Hello-World"
    assert push.commit == "6113728f27ae82c7b1a177c8d03f9e96e0adf246"
    assert "codertocat/hello-world" in push.repo_keys
    tag = payloads.parse("github", "push", raw(fixture("github/push.tag.json")))
    assert (tag.kind, tag.tag, tag.deleted) == ("tag", "simple-tag", False)
    gone = payloads.parse("github", "push", raw(fixture("github/push.deleted.json")))
    assert gone.deleted and gone.commit == ""
    for action in ("opened", "synchronize", "reopened"):
        pr = payloads.parse(
            "github", "pull_request", raw(fixture(f"github/pull_request.{action}.json"))
        )
        assert (pr.kind, pr.branch, pr.pull_request) == ("pull_request", "master", 2)
        assert pr.commit == "ec26c3e57ca3a959ca5aad62de7213c562f8c821"
    assert payloads.parse("github", "ping", raw(fixture("github/ping.json"))).kind == "ping"
    assert payloads.parse("github", "issues", b"{}").kind == "ignored"


def test_gitlab_documented_payloads_read_alike() -> None:
    push = payloads.parse("gitlab", "Push Hook", raw(fixture("gitlab/push.json")))
    assert (push.kind, push.branch, push.repository) == ("push", "master", "mike/diaspora")
    assert push.files == ["CHANGELOG", "app/controller/application.rb"]
    assert push.everything  # total_commits_count 4, 2 listed: the list is incomplete
    tag = payloads.parse("gitlab", "Tag Push Hook", raw(fixture("gitlab/tag_push.json")))
    assert (tag.kind, tag.tag) == ("tag", "v1.0.0")
    mr = payloads.parse(
        "gitlab", "Merge Request Hook", raw(fixture("gitlab/merge_request.open.json"))
    )
    assert (mr.kind, mr.branch, mr.pull_request) == ("pull_request", "master", 1)
    assert mr.commit == "da1560886d4f094c3e6c9ef40349f7d38b5d27d7"
    edited = fixture("gitlab/merge_request.open.json")
    edited["object_attributes"]["action"] = "update"  # a title edit: no oldrev
    assert payloads.parse("gitlab", "Merge Request Hook", raw(edited)).kind == "ignored"


def test_a_push_listing_20_commits_counts_as_changing_everything() -> None:
    data = fixture("github/push.branch.json")
    data["created"] = False
    assert not payloads.parse("github", "push", raw(data)).everything
    data["commits"] = data["commits"] * 20
    assert payloads.parse("github", "push", raw(data)).everything


def test_a_pull_request_from_a_fork_starts_nothing() -> None:
    data = fixture("github/pull_request.opened.json")
    data["pull_request"]["head"]["repo"]["full_name"] = "mallory/Hello-World"
    assert payloads.parse("github", "pull_request", raw(data)).kind == "ignored"


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(ref="refs/heads/ma\x1bster"),
        lambda d: d.update(ref="refs/heads/a..b"),
        lambda d: d["commits"][0].update(added=["../../etc/passwd"]),
        lambda d: d["commits"][0].update(added=["infra/../../x"]),
        lambda d: d["commits"][0].update(modified=["/abs/path"]),
        lambda d: d["commits"][0].update(modified=["a\nb"]),
        lambda d: d.update(after="not-a-sha", head_commit=None),
        lambda d: d.update(commits="many"),
        lambda d: d["repository"].update(full_name=["x"]),
        lambda d: d["repository"].update(full_name="../x"),
    ],
)
def test_a_hostile_push_is_refused(mutate: Any) -> None:
    data = fixture("github/push.branch.json")
    mutate(data)
    with pytest.raises(BadPayload):
        payloads.parse("github", "push", raw(data))


def test_malformed_json_is_refused() -> None:
    with pytest.raises(BadPayload, match="not JSON"):
        payloads.parse("github", "push", b'{"ref": ')


@pytest.mark.parametrize(
    ("pattern", "path", "hit"),
    [
        ("infra/**", "infra/main.tf", True),
        ("infra/**", "infra/mod/x/main.tf", True),
        ("infra/**", "infrastructure/main.tf", False),
        ("**/*.tf", "main.tf", True),
        ("**/*.tf", "a/b/main.tf", True),
        ("infra/*.tf", "infra/mod/main.tf", False),
        ("infra/**/*.tf", "infra/main.tf", True),
        ("mod[ab]/*", "moda/x", True),
        ("mod[!ab]/*", "moda/x", False),
        ("docs/?.md", "docs/a.md", True),
    ],
)
def test_trigger_globs(pattern: str, path: str, hit: bool) -> None:
    assert matching.glob_match(pattern, path) is hit


def test_a_push_starts_the_workspaces_of_its_branch_whose_paths_changed() -> None:
    change = payloads.Change(kind="push", branch="master", files=["net/main.tf", "README.md"])
    rows = [
        binding("net", directory="net"),
        binding("db", directory="db"),
        binding("docs", trigger_paths=["*.md"], run_type="plan"),
        binding("any", directory="db", trigger_any_change=True),
        binding("other-branch", branch="dev"),
        binding("root"),  # directory "."
    ]
    got = [(t.workspace, t.run_type) for t in matching.targets(change, rows)]
    assert got == [("net", "apply"), ("docs", "plan"), ("any", "apply"), ("root", "apply")]
    everything = payloads.Change(kind="push", branch="master", files=[], everything=True)
    assert len(matching.targets(everything, rows)) == 5
    deleted = payloads.Change(kind="push", branch="master", deleted=True, everything=True)
    assert matching.targets(deleted, rows) == []


def test_tags_start_only_workspaces_whose_patterns_match() -> None:
    rows = [binding("a", trigger_tags=["v*"]), binding("b"), binding("c", trigger_tags=["rel-*"])]
    change = payloads.Change(kind="tag", tag="v1.2")
    assert [t.workspace for t in matching.targets(change, rows)] == ["a"]


def test_a_pull_request_plans_speculatively_in_the_workspaces_of_its_base() -> None:
    rows = [binding("a"), binding("b", branch="dev")]
    change = payloads.Change(kind="pull_request", branch="master", pull_request=3)
    assert matching.targets(change, rows) == [matching.Target("a", "plan", speculative=True)]


def _github_verified(secret: str, chunks: list[bytes], headers: dict[str, str]) -> bool:
    sent = signing.github_sent(headers)
    if sent is None:
        return False
    mac = signing.github_hmac(secret)
    for chunk in chunks:
        mac.update(chunk)
    return signing.github_matches(mac, sent)


def test_github_signature_over_the_raw_bytes_fed_in_chunks() -> None:
    """The HMAC fed chunk by chunk as the body arrives is the one over the whole body."""
    body = b'{"zen": "x"}'
    good = {"X-Hub-Signature-256": signing.github_signature("s3cret", body)}
    assert _github_verified("s3cret", [body], good)
    assert _github_verified("s3cret", [body[:3], b"", body[3:]], good)
    shouted = {"X-Hub-Signature-256": " " + good["X-Hub-Signature-256"].upper() + " "}
    assert _github_verified("s3cret", [body], shouted)
    assert not _github_verified("s3cret", [body, b" "], good)
    assert not _github_verified("other", [body], good)
    assert not _github_verified("s3cret", [body], {})
    with pytest.raises(ValueError, match="proves nothing"):
        signing.github_hmac("")


@pytest.mark.parametrize(
    "header", ["", "sha256=", "sha1=" + "0" * 40, "sha256=" + "0" * 63, "sha256=" + "g" * 64]
)
def test_a_header_that_is_no_github_signature_is_refused_before_the_body(header: str) -> None:
    assert signing.github_sent({"X-Hub-Signature-256": header}) is None


def test_gitlab_token_compared() -> None:
    assert signing.gitlab_verified("tok", {"X-Gitlab-Token": "tok"})
    assert not signing.gitlab_verified("tok", {"X-Gitlab-Token": "tok2"})
    assert not signing.gitlab_verified("", {"X-Gitlab-Token": ""})


@pytest.mark.parametrize(
    "url",
    [
        "ftp://ghe.example.com/api/v3",
        "https://user:pw@ghe.example.com/api/v3",
        "https://token@ghe.example.com/api/v3",
        "https:///api",
        "https://ghe.example.com/api?x=1",
        "https://ghe.example.com/a pi",
        "https://ghe.example.com:99999/",
        "javascript:alert(1)",
        "",
    ],
)
def test_an_api_url_must_be_plain_http_s(url: str) -> None:
    with pytest.raises(Invalid):
        vcs.check_api_url(url)


def test_a_connection_is_created_with_the_providers_api_and_changed() -> None:
    cmd = vcs.SaveConnection(
        actor="u",
        connection_id="c1",
        org="acme",
        create=True,
        name="gh",
        provider="github",
        has_secret=True,
    )
    (saved,) = vcs.decide(vcs.ConnectionState(), cmd, now=NOW)
    assert isinstance(saved, vcs.ConnectionSaved)
    assert saved.connection.api_url == "https://api.github.com" and saved.connection.has_secret
    state = vcs.fold([saved])
    change = vcs.SaveConnection(
        actor="u", connection_id="c1", org="acme", api_url="https://ghe.acme.test/api/v3"
    )
    (changed,) = vcs.decide(state, change, now=NOW)
    assert isinstance(changed, vcs.ConnectionSaved)
    assert changed.connection.api_url == "https://ghe.acme.test/api/v3"
    assert vcs.decide(vcs.fold([changed], state), change, now=NOW) == []


def test_repo_keys_of_the_spellings_of_one_repository_are_one() -> None:
    spellings = [
        "https://github.com/Acme/net.git",
        "git@github.com:acme/net.git",
        "ssh://git@github.com:22/acme/net",
        "https://github.com/acme/net/",
    ]
    assert {vcs.repo_key(s) for s in spellings} == {"acme/net"}
