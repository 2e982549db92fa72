"""`runplane stack ...` against the real API: the real `runplane` process, the API in this
process (real NATS, real projector)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.builders import api_workspace
from tests.cli_client_support import ESC, Cli
from tests.plane_support import (  # noqa: F401  # registers the fixtures
    Plane,
    commit,
    plane_fixture,
)

V1 = "/api/v1/orgs/acme"


async def test_stack_create_show_set_list_and_delete_from_the_command_line(
    plane: Plane, repo: Path, tmp_path: Path
) -> None:
    commit(repo, {"main.tf": 'resource "null_resource" "a" {}\n'})
    for ws in ("net", "app", "db"):
        await api_workspace(plane.http, repo, ws)
    a = await plane.http.post(f"{V1}/tokens", json={"user": "alice", "role": "admin"})
    cli = Cli(tmp_path / "home")
    await cli.login(str(plane.http.client.make_url("")).rstrip("/"), str(a.body["token"]))

    made = await cli("stack", "create", "prod", "--workspace", "net", "--workspace", "app",
                     "--workspace", "db", "--edge", "net:app", "--edge", "net:db")  # fmt: skip
    assert made.code == 0, made.err
    assert made.out.splitlines() == [
        "stack prod  failure_policy=pause",
        "  level 0: net",
        "  level 1: app db",
    ]
    shown = json.loads((await cli("stack", "show", "prod", "--json")).out)
    assert shown["edges"] == [{"source": "net", "target": "app"},
                              {"source": "net", "target": "db"}]  # fmt: skip
    changed = await cli("stack", "set", "prod", "--workspace", "net", "--workspace", "app",
                        "--edge", "app:net", "--failure-policy", "continue")  # fmt: skip
    assert changed.code == 0, changed.err
    assert "failure_policy=continue" in changed.out and "level 0: app" in changed.out
    seq = str(await plane.app.store.last_seq())  # the read model past the change, then:
    assert (await plane.http.get(f"{V1}/stacks", headers={"RP-Min-Seq": seq})).status == 200
    listed = await cli("stack", "list")
    assert listed.code == 0 and "stack prod" in listed.out, listed.err
    # refusals are one line with the problem's type; a bad edge never reaches the API
    cycle = await cli("stack", "set", "prod", "--workspace", "net", "--workspace", "app",
                      "--edge", "app:net", "--edge", "net:app")  # fmt: skip
    cycle.one_error("stack-cycle")
    (await cli("stack", "create", "x", "--workspace", "net", "--edge", "net")).one_error(
        "SOURCE:TARGET"
    )
    (await cli("stack", "show", f"x{ESC}")).one_error("not a valid name")
    assert (await cli("stack", "delete", "prod")).code == 0
    (await cli("stack", "show", "prod")).one_error("not-found")


async def test_stack_run_run_show_and_resume_from_the_command_line(
    plane: Plane, repo: Path, tmp_path: Path
) -> None:
    """No subscribers here: the stack run stays as created, which is all these need."""
    commit(repo, {"main.tf": 'resource "null_resource" "a" {}\n'})
    for ws in ("net", "app"):
        await api_workspace(plane.http, repo, ws)
    body = {"name": "prod", "workspaces": ["net", "app"],
            "edges": [{"source": "net", "target": "app"}]}  # fmt: skip
    assert (await plane.http.post(f"{V1}/stacks", json=body)).status == 201
    a = await plane.http.post(f"{V1}/tokens", json={"user": "bob", "role": "operator"})
    cli = Cli(tmp_path / "home")
    await cli.login(str(plane.http.client.make_url("")).rstrip("/"), str(a.body["token"]))
    made = await cli("stack", "run", "prod", "--type", "plan", "--json")
    assert made.code == 0, made.err
    sid = json.loads(made.out)["id"]
    shown = await cli("stack", "run-show", sid)
    assert shown.code == 0, shown.err
    assert shown.out.splitlines() == [
        f"stack run {sid} prod  plan  running",
        "  level 0: net=waiting",
        "  level 1: app=waiting",
    ]
    (await cli("stack", "resume", sid)).one_error("conflict")
    (await cli("stack", "run", "prod", "--target", "nope")).one_error("invalid-stack")
