"""`runplane login | run ... | workspace ...` against the real API: the real `runplane`
process, the API in this process (real NATS, real projector), and for `--wait` the whole
plane with real Terraform.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.builders import api_workspace
from tests.cli_client_support import ESC, Cli
from tests.plane_support import (  # noqa: F401  # registers the fixtures
    Plane,
    commit,
    plane_fixture,
)

V1 = "/api/v1/orgs/acme"
ONE = 'resource "null_resource" "a" {}\n'
# A Terraform error quoting the tenant's own line: an escape sequence in it
BROKEN = 'resource "null_resource" "a" {\n  ??? = "\x1b]0;pwned\x07"\n}\n'


def _url(plane: Plane) -> str:
    return str(plane.http.client.make_url("")).rstrip("/")


async def _token(plane: Plane, user: str, role: str) -> str:
    a = await plane.http.post(f"{V1}/tokens", json={"user": user, "role": role})
    assert a.status == 201, a.body
    return str(a.body["token"])


async def _workspace(plane: Plane, repo: Path, name: str, main_tf: str) -> None:
    commit(repo, {"main.tf": main_tf})
    await api_workspace(plane.http, repo, name)


async def _run(plane: Plane, run_id: str) -> dict[str, Any]:
    seq = await plane.app.store.last_seq()
    a = await plane.http.get(f"{V1}/runs/{run_id}", headers={"RP-Min-Seq": str(seq)})
    assert a.status == 200, a.body
    return a.body  # type: ignore[no-any-return]  # JSON object


def _statuses(out: str) -> list[str]:
    """The statuses of the `HH:MM:SS  run ID org/ws  STATUS ...` lines, in order."""
    return [line.split("  ")[2] for line in out.splitlines() if "  run " in line]


@pytest.mark.terraform
async def test_login_then_run_create_wait_to_approval_approve_and_a_failing_run(
    plane: Plane, repo: Path, tmp_path: Path
) -> None:
    await plane.executor("e1")
    await _workspace(plane, repo, "net", ONE)
    cli = Cli(tmp_path / "home")
    login = await cli.login(_url(plane), await _token(plane, "alice", "approver"))
    assert "as alice (approver in organization acme)" in login.out

    # the workspace requires approval (the default): --wait stops there, exit 3
    done = await cli("run", "create", "net", "--message", "from the cli", "--wait")
    assert done.code == 3, (done.out, done.err)
    statuses = _statuses(done.out)
    assert statuses[-1] == "awaiting_approval" and "planning" in statuses, done.out
    assert len(statuses) == len(set(statuses)), "each status change printed once"
    run_id = done.out.splitlines()[0].split()[2]
    assert f"runplane run approve {run_id}" in done.out
    created = await _run(plane, run_id)
    assert created["message"] == "from the cli" and created["created_by"] == "alice"
    assert created["cause"] == {"kind": "cli", "user": "alice"}  # X-Runplane-Client: cli

    approved = await cli("run", "approve", run_id, "--wait")
    assert approved.code == 0, (approved.out, approved.err)
    assert _statuses(approved.out)[-1] == "applied", approved.out
    await plane.reaches("net", run_id, "applied")
    shown = await cli("run", "show", run_id)
    assert "status       applied" in shown.out and "plan         +1 ~0 -0" in shown.out

    # a plan ends the wait with exit 0; --json prints the final run
    done = await cli("run", "create", "net", "--type", "plan", "--wait", "--json")
    assert done.code == 0, done.err
    assert json.loads(done.out)["status"] in ("planned", "no_changes")

    # a failing run: exit 1, its error (Terraform quoting the tenant's line) escaped
    commit(repo, {"main.tf": BROKEN})
    done = await cli("run", "create", "net", "--wait")
    assert done.code == 1, (done.out, done.err)
    assert _statuses(done.out)[-1] == "failed"
    assert ESC not in done.out and "\x07" not in done.out, repr(done.out)
    failed = done.out.splitlines()[-1]
    assert "error=" in failed and "\\x1b]0;pwned\\x07" in failed, failed


async def test_commands_show_what_the_api_holds_and_escape_a_tenants_message(
    plane: Plane, repo: Path, tmp_path: Path
) -> None:
    """No executor: runs stay queued, which is all these commands need."""
    await _workspace(plane, repo, "web", ONE)
    cli = Cli(tmp_path / "home")
    await cli.login(_url(plane), await _token(plane, "bob", "operator"))
    evil = f"deploy{ESC}]0;pwned{ESC}\\{ESC}[2J\x9b31m"

    created = await cli("run", "create", "web", "--message", evil, "--type", "plan")
    assert created.code == 0, created.err
    run_id = created.out.split()[2]
    stored = await _run(plane, run_id)
    assert stored["message"] == evil and stored["cause"]["kind"] == "cli"  # stored as given
    for args in (["run", "show", run_id], ["run", "list"], ["run", "list", "--workspace", "web"]):
        done = await cli(*args)
        assert done.code == 0, done.err
        assert run_id in done.out
        assert ESC not in done.out and "\x9b" not in done.out, repr(done.out)
        assert "deploy\\x1b]0;pwned" in done.out
    assert "cause        cli user=bob" in (await cli("run", "show", run_id)).out
    as_json = await cli("run", "show", run_id, "--json")
    assert ESC not in as_json.out and json.loads(as_json.out)["message"] == evil

    assert "no runs" in (await cli("run", "list", "--status", "applied")).out
    listed = json.loads((await cli("workspace", "list", "--json")).out)
    assert [w["name"] for w in listed["items"]] == ["web"]
    shown = await cli("workspace", "show", "web")
    assert f"repository   {repo}" in shown.out

    canceled = await cli("run", "cancel", run_id, "--reason", "not now")
    assert canceled.code == 0 and "canceled" in canceled.out, canceled.err
    (await cli("run", "discard", run_id)).one_error("(409 conflict)")


async def test_refusals_are_one_line_with_the_problems_detail_and_type(
    plane: Plane, tmp_path: Path
) -> None:
    a = await plane.http.post(
        f"{V1}/workspaces", json={"name": "web", "repository": "https://example.com/x.git"}
    )
    assert a.status == 201, a.body
    url = _url(plane)
    viewer = Cli(tmp_path / "viewer")
    await viewer.login(url, await _token(plane, "vera", "viewer"))
    viewer_refused = await viewer("run", "create", "web")
    viewer_refused.one_error("has read on workspace", "needs write (403 forbidden)")
    (await viewer("run", "show", "nosuch")).one_error("run nosuch not found", "(404 not-found)")
    (await viewer("run", "list", "--status", "bogus")).one_error("(400 invalid-query)")
    (await viewer("run", "show", "Bad!")).one_error("not a valid name")
    (await viewer("workspace", "show", "web", "--org", "other")).one_error("(404 not-found)")
    operator = Cli(tmp_path / "op", RUNPLANE_TOKEN=await _token(plane, "olga", "operator"))
    refused = await operator("run", "create", "web", "--template", "nosuch", "--server", url)
    refused.one_error("(422 invalid-command)")
    (await viewer("login", url, "--token-stdin", stdin="wrong\n")).one_error("(401 unauthorized)")
    stored = json.loads(viewer.credentials.read_text())
    assert stored["servers"][url]["user"] == "vera"  # the refused login stored nothing


async def test_the_org_is_the_flag_else_the_tokens_else_an_error(
    plane: Plane, tmp_path: Path
) -> None:
    url = _url(plane)
    who = await plane.http.get("/api/v1/whoami")
    shown = {k: who.body[k] for k in ("user", "role", "org", "token_id", "user_id", "kind")}
    assert shown == {
        "user": "admin", "role": "admin", "org": None, "token_id": None, "user_id": None,
        "kind": "admin",
    }  # fmt: skip
    bob = await plane.http.get("/api/v1/whoami", token=await _token(plane, "bob", "viewer"))
    assert (bob.body["user"], bob.body["role"], bob.body["org"]) == ("bob", "viewer", "acme")
    (await plane.http.get("/api/v1/whoami", token=None)).problem("unauthorized", 401)
    admin = Cli(tmp_path / "admin")
    login = await admin.login(url, "test-admin-token")
    assert "as admin (admin in every organization)" in login.out
    (await admin("workspace", "list")).one_error("pass --org")
    assert (await admin("workspace", "list", "--org", "acme")).code == 0
    # a token from the environment, never logged in: its organization asked from the API
    env = Cli(tmp_path / "env", RUNPLANE_TOKEN=await _token(plane, "bob", "viewer"))
    done = await env("workspace", "list", "--server", url, "--json")
    assert done.code == 0, done.err
    assert json.loads(done.out) == {"items": []}
