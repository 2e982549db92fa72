"""The webhook endpoint: GitHub's and GitLab's own example payloads, signed by the test,
start the runs they should (push to a branch by trigger paths, tags by pattern, pull
requests as speculative plans, each pinned to the commit and with its cause); a replayed
delivery, a ping, a branch deletion start nothing; forged, absent or another
connection's signatures, hostile payloads and another organization's connection do
nothing and write nothing. Real nats-server, real API and projector."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from events.run import RunCreated
from infra import kv
from infra.ids import derived_id
from infra.kv import KvError
from infra.streams import EVENTS
from services.processes.vcs import connections, signing
from services.surfaces.webhooks import intake
from services.surfaces.webhooks import vcs as webhook
from tests.api_support import Http
from tests.helpers import eventually
from tests.vcs_support import (
    GITLAB_REPO,
    SECRET,
    V1,
    connection,
    deliver,
    fixture,
    github_repo,
    gitlab_repo,
    heads_of,
    pushed,
    vhttp_fixture,
)

_ = vhttp_fixture  # the `vhttp` fixture
REPO = "https://github.com/acme/net.git"
HEAD = "6113728f27ae82c7b1a177c8d03f9e96e0adf246"  # the push example's head commit
PR_HEAD = "ec26c3e57ca3a959ca5aad62de7213c562f8c821"


async def _last_seq(http: Http) -> int:
    info = await http.app.store.nc.jetstream().stream_info(EVENTS)
    return int(info.state.last_seq)


async def _created(http: Http, org: str) -> list[RunCreated]:
    """Every run.created of the organization, in stream order."""
    envs = await http.app.store.read(f"rp.run.{org}.>")
    return [e.event for e in envs if isinstance(e.event, RunCreated)]


@pytest.fixture
async def gh(vhttp: Http) -> dict[str, Any]:
    """acme with a GitHub connection and four workspaces on acme/net: `net` (directory
    net), `db` (directory db), `docs` (trigger paths *.md, plans), `dev` (another branch)."""
    tokens = await vhttp.org("acme")
    conn = await connection(vhttp)
    for name, extra in (
        ("net", {"directory": "net"}),
        ("db", {"directory": "db"}),
        ("docs", {"trigger_paths": ["**/*.md"], "vcs_run_type": "plan"}),
        ("dev", {"branch": "dev"}),
    ):
        fields = {"repository": REPO, "branch": "master", "vcs_connection": conn["id"], **extra}
        await vhttp.workspace("acme", name, **fields)
    return {"conn": conn, "tokens": tokens}


def _push(files: list[str], **kw: Any) -> dict[str, Any]:
    return pushed(github_repo(fixture("github/push.branch.json"), "acme/net"), files, **kw)


async def test_a_push_starts_the_workspaces_whose_paths_changed_pinned_with_its_cause(
    vhttp: Http, gh: dict[str, Any]
) -> None:
    conn_id = gh["conn"]["id"]
    a = await deliver(vhttp, conn_id, "push", _push(["net/main.tf", "README.md"]), delivery="d-1")
    assert a.status == 200, a.body
    started = sorted(r["workspace"] for r in a.body["runs"])
    assert started == ["docs", "net"]  # db's directory and dev's branch were not touched
    for r in a.body["runs"]:
        assert r["run_id"] == derived_id("vcs", "acme", conn_id, "d-1", r["workspace"])
        run = (await vhttp.app.load_run("acme", r["workspace"], r["run_id"])).state
        assert run.run_type == ("plan" if r["workspace"] == "docs" else "apply")
        assert run.requested_commit == HEAD and not run.speculative
        assert run.cause is not None and run.cause.kind == "vcs"
        assert (run.cause.provider, run.cause.connection, run.cause.delivery) == (
            "github",
            conn_id,
            "d-1",
        )
        assert (run.cause.event, run.cause.ref, run.cause.commit) == (
            "push",
            "refs/heads/master",
            HEAD,
        )
        assert run.cause.repository == "acme/net"
    path = f"{V1}/acme/runs/{a.body['runs'][0]['run_id']}"

    async def projected() -> dict[str, Any]:  # this replica's read model may lag the log
        got = await vhttp.get(path)
        assert got.status == 200, got.body
        return got.body  # type: ignore[no-any-return]  # JSON object

    shown = await eventually(projected, timeout=10, what="the webhook's run in the read model")
    assert shown["cause"]["kind"] == "vcs" and shown["cause"]["commit"] == HEAD


async def test_a_replayed_delivery_starts_nothing(vhttp: Http, gh: dict[str, Any]) -> None:
    conn_id = gh["conn"]["id"]
    first = await deliver(vhttp, conn_id, "push", _push(["net/a.tf"]), delivery="same")
    assert len(first.body["runs"]) == 1
    before = await _last_seq(vhttp)
    again = await deliver(vhttp, conn_id, "push", _push(["db/a.tf"]), delivery="same")
    assert again.status == 200 and again.body["ignored"] == "replay" and again.body["runs"] == []
    assert await _last_seq(vhttp) == before
    assert len(await _created(vhttp, "acme")) == 1


async def test_one_delivery_handled_twice_at_once_starts_each_run_once(
    vhttp: Http, gh: dict[str, Any]
) -> None:
    """As two API replicas would (or a redelivery racing the first): derived ids."""
    conn_id = gh["conn"]["id"]
    body = _push(["net/a.tf", "db/b.tf"])
    answers = await asyncio.gather(
        *(deliver(vhttp, conn_id, "push", body, delivery="twin") for _ in range(4))
    )
    assert all(a.status == 200 for a in answers), [a.body for a in answers]
    created = await _created(vhttp, "acme")
    assert sorted(e.workspace for e in created) == ["db", "net"]


async def test_a_secrets_bucket_out_of_reach_answers_503_and_the_redelivery_starts_the_runs(
    vhttp: Http, gh: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The secrets bucket's leader is being elected (the cluster suite killed its node):
    the signature cannot be checked yet, so the delivery is a 503 to deliver again, not
    an internal error; it writes nothing, and the redelivery starts its runs."""
    conn_id = gh["conn"]["id"]
    body = _push(["net/a.tf"])
    real = kv.last_values

    async def electing(*args: Any, **kw: Any) -> Any:
        raise KvError("reading KV_rp-secrets's last sequence: TimeoutError()")

    monkeypatch.setattr(connections, "last_values", electing)
    before = await _last_seq(vhttp)
    refused = await deliver(vhttp, conn_id, "push", body, delivery="election")
    refused.problem("unavailable", 503)
    assert await _last_seq(vhttp) == before
    monkeypatch.setattr(connections, "last_values", real)
    again = await deliver(vhttp, conn_id, "push", body, delivery="election")
    assert again.status == 200 and [r["workspace"] for r in again.body["runs"]] == ["net"]


async def test_a_push_that_may_be_truncated_starts_every_workspace_of_its_branch(
    vhttp: Http, gh: dict[str, Any]
) -> None:
    data = _push(["README.txt"])
    data["commits"] = data["commits"] * 20  # GitHub lists 20 at most: there may be more
    a = await deliver(vhttp, gh["conn"]["id"], "push", data)
    assert sorted(r["workspace"] for r in a.body["runs"]) == ["db", "docs", "net"]


async def test_ping_and_branch_deletion_start_nothing(vhttp: Http, gh: dict[str, Any]) -> None:
    conn_id = gh["conn"]["id"]
    ping = await deliver(vhttp, conn_id, "ping", fixture("github/ping.json"))
    assert ping.status == 200 and ping.body["runs"] == []
    gone = _push(["net/main.tf"])
    gone.update(deleted=True, after="0" * 40, head_commit=None)
    a = await deliver(vhttp, conn_id, "push", gone)
    assert a.status == 200 and a.body["runs"] == []
    assert await _created(vhttp, "acme") == []


async def test_a_tag_starts_the_workspaces_whose_patterns_match(
    vhttp: Http, gh: dict[str, Any]
) -> None:
    conn_id = gh["conn"]["id"]
    fields = {"repository": REPO, "vcs_connection": conn_id, "trigger_tags": ["simple-*"]}
    await vhttp.workspace("acme", "release", **fields)
    tag = github_repo(fixture("github/push.tag.json"), "acme/net")
    a = await deliver(vhttp, conn_id, "push", tag)
    assert [r["workspace"] for r in a.body["runs"]] == ["release"]
    run = (await vhttp.app.load_run("acme", "release", a.body["runs"][0]["run_id"])).state
    assert run.cause is not None and (run.cause.event, run.cause.ref) == (
        "tag",
        "refs/tags/simple-tag",
    )


@pytest.mark.parametrize("action", ["opened", "synchronize", "reopened"])
async def test_a_pull_request_plans_speculatively_in_the_workspaces_of_its_base(
    vhttp: Http, gh: dict[str, Any], action: str
) -> None:
    conn_id = gh["conn"]["id"]
    pr = github_repo(fixture(f"github/pull_request.{action}.json"), "acme/net")
    a = await deliver(vhttp, conn_id, "pull_request", pr)
    assert sorted(r["workspace"] for r in a.body["runs"]) == ["db", "docs", "net"]
    for r in a.body["runs"]:
        run = (await vhttp.app.load_run("acme", r["workspace"], r["run_id"])).state
        assert (run.run_type, run.speculative, run.requested_commit) == ("plan", True, PR_HEAD)
        c = run.cause
        assert c is not None
        assert (c.provider, c.connection, c.repository, c.pull_request, c.commit) == (
            "github",
            conn_id,
            "acme/net",
            2,
            PR_HEAD,
        )
    closed = github_repo(fixture("github/pull_request.opened.json"), "acme/net")
    closed["action"] = "closed"
    assert (await deliver(vhttp, conn_id, "pull_request", closed)).body["runs"] == []


async def test_gitlab_push_and_merge_request(vhttp: Http) -> None:
    await vhttp.org("acme")
    conn = await connection(vhttp, provider="gitlab", api_url="https://gitlab.example.com/api/v4")
    fields = {
        "repository": "https://gitlab.example.com/acme/net.git",
        "branch": "master",
        "vcs_connection": conn["id"],
        "directory": "app",
    }
    await vhttp.workspace("acme", "app", **fields)
    await vhttp.workspace("acme", "lib", **{**fields, "directory": "lib"})
    push = gitlab_repo(fixture("gitlab/push.json"), "acme/net")
    push["total_commits_count"] = len(push["commits"])  # complete: paths decide
    a = await deliver(vhttp, conn["id"], "Push Hook", push, provider="gitlab")
    assert a.status == 200, a.body
    assert [r["workspace"] for r in a.body["runs"]] == ["app"]  # app/controller/application.rb
    run = (await vhttp.app.load_run("acme", "app", a.body["runs"][0]["run_id"])).state
    assert run.requested_commit == "da1560886d4f094c3e6c9ef40349f7d38b5d27d7"
    assert run.cause is not None and run.cause.provider == "gitlab"
    mr = gitlab_repo(fixture("gitlab/merge_request.open.json"), "acme/net")
    a = await deliver(vhttp, conn["id"], "Merge Request Hook", mr, provider="gitlab")
    assert sorted(r["workspace"] for r in a.body["runs"]) == ["app", "lib"]
    lib = next(r["run_id"] for r in a.body["runs"] if r["workspace"] == "lib")
    run = (await vhttp.app.load_run("acme", "lib", lib)).state
    assert run.speculative and run.cause is not None and run.cause.pull_request == 1
    # GitLab's Idempotency-Key names a delivery across its retries (of a push of its own:
    # the first push again under a new delivery id is a duplicate)
    newer = "0f" * 20
    push.update(after=newer, checkout_sha=newer)
    heads_of(vhttp).heads[(GITLAB_REPO, "refs/heads/master")] = newer
    key = {"Idempotency-Key": "k-1"}
    one = await deliver(vhttp, conn["id"], "Push Hook", push, provider="gitlab", headers=key)
    two = await deliver(vhttp, conn["id"], "Push Hook", push, provider="gitlab", headers=key)
    assert len(one.body["runs"]) == 1 and two.body["ignored"] == "replay"
    bad = await deliver(vhttp, conn["id"], "Push Hook", push, provider="gitlab", secret="nope")
    bad.problem("unauthorized", 401)


async def test_a_workspace_created_a_moment_before_the_webhook_is_matched(vhttp: Http) -> None:
    """The read model lags; the webhook waits until it holds what the stream held."""
    await vhttp.org("acme")
    conn = await connection(vhttp)
    from events.values import Workspace

    cfg = Workspace(repository=REPO, branch="master", vcs_connection=conn["id"])
    await vhttp.app.create_workspace("acme", "fresh", cfg, "admin")  # not through the API
    a = await deliver(vhttp, conn["id"], "push", _push(["x.tf"]))
    assert [r["workspace"] for r in a.body["runs"]] == ["fresh"]


# ---------------------------------------------------------------- attacks


async def test_attack_forged_absent_or_other_signatures_do_nothing(
    vhttp: Http, gh: dict[str, Any]
) -> None:
    conn_id = gh["conn"]["id"]
    body = json.dumps(_push(["net/main.tf"])).encode()
    before = await _last_seq(vhttp)
    cases = [
        {"secret": "not-the-secret"},
        {"headers": {"X-Hub-Signature-256": ""}},
        {"headers": {"X-Hub-Signature-256": "sha256=" + "0" * 64}},
        {"headers": {"X-Hub-Signature-256": "sha1=abc"}},
        {"provider": "gitlab"},  # GitLab's token header to a GitHub connection
    ]
    answers = [await deliver(vhttp, conn_id, "push", body, **kw) for kw in cases]  # type: ignore[arg-type]
    # an unknown connection id, and a malformed one, answer exactly the same
    answers.append(await deliver(vhttp, "01jzzzzzzzzzzzzzzzzzzzzzzz", "push", body))
    answers.append(await deliver(vhttp, "NOT_AN_ID", "push", body))
    details = set()
    for a in answers:
        details.add(a.problem("unauthorized", 401)["detail"])
    assert details == {webhook._REFUSED}
    # a body changed after signing (one byte more) with the signature of the original
    sig = {"X-Hub-Signature-256": signing.github_signature(SECRET, body)}
    (await deliver(vhttp, conn_id, "push", body + b" ", headers=sig)).problem("unauthorized", 401)
    assert await _last_seq(vhttp) == before
    assert await _created(vhttp, "acme") == []


async def test_attack_org_a_cannot_bind_or_trigger_org_bs_workspaces(
    vhttp: Http, gh: dict[str, Any]
) -> None:
    """beta's workspace on the same repository, bound to beta's connection: acme binding
    it to acme's connection is refused, and acme's signed delivery starts only acme's."""
    beta = await vhttp.org("beta")
    theirs = await connection(vhttp, org="beta", secret="beta-secret")
    fields = {"repository": REPO, "branch": "master", "vcs_connection": theirs["id"]}
    await vhttp.workspace("beta", "net", **fields)
    # acme's admin cannot bind its workspace to beta's connection
    bind = {"name": "steal", "repository": REPO, "vcs_connection": theirs["id"]}
    a = await vhttp.post(f"{V1}/acme/workspaces", json=bind, token=gh["tokens"]["admin"])
    a.problem("invalid-command", 422)
    # nor can beta's admin bind to acme's
    bind = {"name": "x", "repository": REPO, "vcs_connection": gh["conn"]["id"]}
    a = await vhttp.post(f"{V1}/beta/workspaces", json=bind, token=beta["admin"])
    a.problem("invalid-command", 422)
    # a delivery to acme's connection, signed by acme, naming beta's repository: acme's only
    a = await deliver(vhttp, gh["conn"]["id"], "push", _push(["x.tf", "net/x.tf"]))
    assert {r["workspace"] for r in a.body["runs"]} == {"net"}
    assert await _created(vhttp, "beta") == []
    # beta's connection with acme's secret: refused
    (await deliver(vhttp, theirs["id"], "push", _push(["x.tf"]))).problem("unauthorized", 401)
    assert await _created(vhttp, "beta") == []


def _signed_hostile(mutate: Any) -> bytes:
    data = _push(["net/main.tf"])
    mutate(data)
    return json.dumps(data).encode()


@pytest.mark.parametrize(
    ("body", "slug", "status"),
    [
        (b'{"ref": "refs/heads/master", ', "invalid-body", 400),
        (b"[1, 2, 3]", "invalid-body", 400),
        (_signed_hostile(lambda d: d.update(ref=["refs/heads/master"])), "invalid-body", 400),
        (_signed_hostile(lambda d: d.update(ref="refs/heads/ma\x1b[2Jster")), "invalid-body", 400),
        (_signed_hostile(lambda d: d.update(ref="refs/heads/ma\u0085ster")), "invalid-body", 400),
        (
            _signed_hostile(lambda d: d["commits"][0].update(added=["net/../../etc"])),
            "invalid-body",
            400,
        ),
        (_signed_hostile(lambda d: d.update(commits=[{"added": "net/x"}])), "invalid-body", 400),
        (_signed_hostile(lambda d: d["head_commit"].update(id="zz")), "invalid-body", 400),
        (b"{" + b" " * (intake.MAX_BODY + 1) + b"}", "body-too-large", 413),
    ],
)
async def test_attack_a_hostile_payload_answers_a_problem_and_writes_nothing(
    vhttp: Http, gh: dict[str, Any], body: bytes, slug: str, status: int
) -> None:
    before = await _last_seq(vhttp)
    a = await deliver(vhttp, gh["conn"]["id"], "push", body)
    a.problem(slug, status)
    assert await _last_seq(vhttp) == before


async def test_a_delivery_without_its_id_is_refused(vhttp: Http, gh: dict[str, Any]) -> None:
    a = await deliver(vhttp, gh["conn"]["id"], "push", _push(["net/a.tf"]), delivery=" ")
    a.problem("invalid-header", 400)


async def test_deliveries_are_listed_newest_first_a_page_on_and_to_their_organization_only(
    vhttp: Http, gh: dict[str, Any]
) -> None:
    """A viewer of acme lists what each delivery did; `before` pages on; another
    organization's admin finds neither acme nor its connection; a malformed cursor is a
    400."""
    conn_id = gh["conn"]["id"]
    for d in ("d-1", "d-2", "d-3"):  # a push that concerns no workspace: recorded, no run
        a = await deliver(vhttp, conn_id, "push", _push(["other/x.txt"]), delivery=d)
        assert a.status == 200 and a.body["runs"] == [], a.body
    path = f"{V1}/acme/vcs-connections/{conn_id}/deliveries"
    listed = await vhttp.get(path, token=gh["tokens"]["viewer"])
    assert [d["delivery"] for d in listed.body["items"]] == ["d-3", "d-2", "d-1"]
    first = listed.body["items"][0]
    assert (first["event"], first["ref"], first["commit"], first["runs"]) == (
        "push",
        "refs/heads/master",
        HEAD,
        [],
    )
    older = await vhttp.get(f"{path}?before={listed.body['items'][1]['seq']}")
    assert [d["delivery"] for d in older.body["items"]] == ["d-1"]
    (await vhttp.get(f"{path}?before=x")).problem("invalid-query", 400)
    beta = await vhttp.org("beta")
    theirs = f"{V1}/beta/vcs-connections/{conn_id}/deliveries"
    (await vhttp.get(theirs, token=beta["admin"])).problem("not-found", 404)
    (await vhttp.get(path, token=beta["admin"])).problem("not-found", 404)
