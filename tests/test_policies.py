"""OPA policies end to end: real Terraform, through the HTTP API.

Saving (a source that does not compile is refused with the compiler's message), the three
enforcement levels (advisory recorded, soft-mandatory needs an approval that records its
override, hard-mandatory fails the run with the policy's messages), scopes (organization,
folder, workspace) and the sets a run pinned at admission.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.builders import api_workspace
from tests.plane_support import (  # noqa: F401  # registers the fixtures
    Plane,
    commit,
    plane_fixture,
)

pytestmark = pytest.mark.terraform

V1 = "/api/v1/orgs/acme"
TWO = 'resource "null_resource" "a" {}\nresource "null_resource" "b" {}\n'
NO_CREATES = """package terraform.creates
import rego.v1

deny contains msg if {
  some rc in input.resource_changes
  rc.type == "null_resource"
  "create" in rc.change.actions
  msg := sprintf("%s would be created", [rc.address])
}
"""
CREATED = ["null_resource.a would be created", "null_resource.b would be created"]
NO_DELETES = """package terraform.deletes
import rego.v1

deny contains msg if {
  some rc in input.resource_changes
  "delete" in rc.change.actions
  msg := sprintf("%s would be deleted", [rc.address])
}
"""


async def _read(plane: Plane, path: str, token: str | None = None) -> Any:
    """GET once the projection holds everything written so far."""
    seq = await plane.app.store.last_seq()
    kw = {"token": token} if token else {}
    answer = await plane.http.get(path, headers={"RP-Min-Seq": str(seq)}, **kw)
    assert answer.status == 200, answer.body
    return answer.body


async def _policy(plane: Plane, name: str, enforcement: str, source: str, **extra: str) -> Any:
    body = {"enforcement": enforcement, "source": source, **extra}
    a = await plane.http.call("PUT", f"{V1}/policies/{name}", json=body)
    assert a.status in (200, 201), a.body
    return a.body


def _results(run: Any) -> list[tuple[str, str, str, bool, list[str]]]:
    return [
        (p["name"], p["enforcement"], p["scope"], p["passed"], sorted(p["messages"]))
        for p in run["policies"]
    ]


async def test_saving_policies_compile_errors_scopes_and_roles(plane: Plane, repo: Path) -> None:
    """A source that does not compile is 422 invalid-policy with the compiler's message
    (and saves nothing); a missing folder or workspace is 404; a viewer reads, only an
    admin writes; list, filter by scope, replace, delete."""
    commit(repo, {"main.tf": TWO})
    await api_workspace(plane.http, repo)
    broken = {"enforcement": "hard-mandatory", "source": "package p\ndeny contains m if {\n"}
    a = await plane.http.call("PUT", f"{V1}/policies/broken", json=broken)
    body = a.problem("invalid-policy", 422)
    assert body["detail"].startswith("the policy does not compile: broken.rego:2:"), body
    assert "unclosed" in body["detail"]
    no_deny = {"enforcement": "advisory", "source": "package p\nallow := true\n"}
    a = await plane.http.call("PUT", f"{V1}/policies/nodeny", json=no_deny)
    assert "no `deny` rule" in a.problem("invalid-policy", 422)["detail"]
    bad_level = {"enforcement": "mandatory", "source": NO_DELETES}
    a = await plane.http.call("PUT", f"{V1}/policies/p", json=bad_level)
    a.problem("invalid-command", 422)
    for scope, what in (("workspace:nope", "workspace nope"), ("folder:nope", "folder nope")):
        body = {"enforcement": "advisory", "source": NO_DELETES, "scope": scope}
        a = await plane.http.call("PUT", f"{V1}/policies/p", json=body)
        assert what in a.problem("not-found", 404)["detail"]
    a = await plane.http.call("PUT", f"{V1}/policies/p", json={"enforcement": "advisory"})
    a.problem("invalid-body", 400)
    assert (await _read(plane, f"{V1}/policies"))["items"] == []

    viewer = await plane.http.post(f"{V1}/tokens", json={"user": "vera", "role": "viewer"})
    token = viewer.body["token"]
    body = {"enforcement": "advisory", "source": NO_DELETES}
    a = await plane.http.call("PUT", f"{V1}/policies/p", json=body, token=token)
    a.problem("forbidden", 403)

    saved = await plane.http.call(
        "PUT", f"{V1}/policies/no-deletes", json={**body, "description": "keep things"}
    )
    assert saved.status == 201 and saved.headers["Location"] == f"{V1}/policies/no-deletes"
    assert saved.body == {
        "name": "no-deletes",
        "enforcement": "advisory",
        "scope": "org",
        "description": "keep things",
        "package": "terraform.deletes",
        "source": NO_DELETES,
    }
    await _policy(plane, "ws-only", "soft-mandatory", NO_CREATES, scope="workspace:net")
    replaced = await _policy(plane, "no-deletes", "hard-mandatory", NO_DELETES)
    assert replaced["enforcement"] == "hard-mandatory"
    listed = await _read(plane, f"{V1}/policies", token=token)
    assert [(p["name"], p["scope"]) for p in listed["items"]] == [
        ("no-deletes", "org"),
        ("ws-only", "workspace:net"),
    ]
    only = await _read(plane, f"{V1}/policies?scope=workspace:net")
    assert [p["name"] for p in only["items"]] == ["ws-only"]
    one = await _read(plane, f"{V1}/policies/ws-only", token=token)
    assert one["enforcement"] == "soft-mandatory"
    (await plane.http.get(f"{V1}/policies?bogus=1")).problem("invalid-query", 400)

    gone = await plane.http.call("DELETE", f"{V1}/policies/ws-only")
    assert gone.status == 204 and int(gone.headers["RP-Seq"]) > 0
    (await plane.http.get(f"{V1}/policies/ws-only")).problem("not-found", 404)
    (await plane.http.call("DELETE", f"{V1}/policies/ws-only")).problem("not-found", 404)


async def test_an_advisory_failure_is_recorded_and_the_run_proceeds(
    plane: Plane, repo: Path
) -> None:
    """require_approval off: an advisory policy that fails is recorded in the run (and its
    `policy` step's log) and the run applies; the next plan, with nothing to change, is
    checked too (and passes)."""
    commit(repo, {"main.tf": TWO})
    await api_workspace(plane.http, repo, settings={"require_approval": False})
    await _policy(plane, "no-creates", "advisory", NO_CREATES)
    await plane.executor("e1")
    run_id = await plane.start("net")
    done = await plane.reaches("net", run_id, "applied", "failed")
    assert done.status == "applied", done.error_message
    shown = await _read(plane, f"{V1}/runs/{run_id}")
    assert _results(shown) == [("no-creates", "advisory", "org", False, CREATED)]
    assert shown["overridden"] == [] and shown["approved_by"] is None
    assert [p["name"] for p in shown["snapshot"]["policies"]] == ["no-creates"]

    steps = (await _read(plane, f"{V1}/runs/{run_id}/steps"))["items"]
    plan_steps = [s["step"] for s in steps if s["phase"] == "plan"]
    assert plan_steps == ["checkout", "init", "plan", "policy"]
    assert next(s for s in steps if s["step"] == "policy")["status"] == "ok"
    log = await _read(plane, f"{V1}/runs/{run_id}/logs?phase=plan&step=policy")
    text = "\n".join(line["text"] for line in log["items"])
    assert "no-creates (advisory, org): failed" in text
    assert "  - null_resource.a would be created" in text
    assert "advisory failed (no-creates): recorded only" in text

    again = await plane.start("net", "plan")
    nothing = await plane.reaches("net", again, "no_changes", "failed")
    assert nothing.status == "no_changes", nothing.error_message
    shown = await _read(plane, f"{V1}/runs/{again}")
    assert _results(shown) == [("no-creates", "advisory", "org", True, [])]


async def test_a_soft_mandatory_failure_needs_an_approval_that_records_the_override(
    plane: Plane, repo: Path
) -> None:
    """require_approval off, but a soft-mandatory policy fails: the run awaits approval;
    approving records who overrode which policy, in the run and in run.approved."""
    commit(repo, {"main.tf": TWO})
    await api_workspace(plane.http, repo, settings={"require_approval": False})
    await _policy(plane, "no-creates", "soft-mandatory", NO_CREATES)
    await _policy(plane, "no-deletes", "soft-mandatory", NO_DELETES)  # passes
    alice = await plane.http.post(f"{V1}/tokens", json={"user": "alice", "role": "approver"})
    await plane.executor("e1")
    run_id = await plane.start("net")
    waiting = await plane.reaches("net", run_id, "awaiting_approval", "failed")
    assert waiting.status == "awaiting_approval", waiting.error_message
    shown = await _read(plane, f"{V1}/runs/{run_id}")
    assert _results(shown) == [
        ("no-creates", "soft-mandatory", "org", False, CREATED),
        ("no-deletes", "soft-mandatory", "org", True, []),
    ]
    assert shown["overridden"] == []

    a = await plane.http.post(f"{V1}/runs/{run_id}/approve", json={}, token=alice.body["token"])
    assert a.status == 200, a.body
    assert (a.body["approved_by"], a.body["overridden"]) == ("alice", ["no-creates"])
    done = await plane.reaches("net", run_id, "applied", "failed")
    assert done.status == "applied", done.error_message
    assert done.overridden == ["no-creates"]
    shown = await _read(plane, f"{V1}/runs/{run_id}")
    assert (shown["approved_by"], shown["overridden"]) == ("alice", ["no-creates"])
    history = (await _read(plane, f"{V1}/runs/{run_id}/events"))["items"]
    (approved,) = [e for e in history if e["type"] == "run.approved"]
    assert approved["actor"] == "alice" and approved["at"]
    assert approved["data"]["overridden"] == ["no-creates"]
    (plan,) = [e for e in history if e["type"] == "run.plan_finished"]
    assert [p["name"] for p in plan["data"]["policies"]] == ["no-creates", "no-deletes"]


async def test_a_hard_mandatory_failure_fails_the_run_with_the_policys_messages(
    plane: Plane, repo: Path
) -> None:
    commit(repo, {"main.tf": TWO})
    await api_workspace(plane.http, repo)
    await _policy(plane, "no-creates", "hard-mandatory", NO_CREATES)
    await _policy(plane, "advice", "advisory", NO_DELETES)
    await plane.executor("e1")
    run_id = await plane.start("net")
    failed = await plane.reaches("net", run_id, "failed", "awaiting_approval")
    assert (failed.status, failed.reason) == ("failed", "policy_failed")
    assert failed.error_message == "\n".join(f"no-creates: {m}" for m in CREATED)
    shown = await _read(plane, f"{V1}/runs/{run_id}")
    assert (shown["reason"], shown["error_message"]) == ("policy_failed", failed.error_message)
    assert _results(shown) == [
        ("advice", "advisory", "org", True, []),
        ("no-creates", "hard-mandatory", "org", False, CREATED),
    ]
    history = (await _read(plane, f"{V1}/runs/{run_id}/events"))["items"]
    types = [e["type"] for e in history]
    assert types.index("run.failed") == types.index("run.plan_finished") + 1
    # the workspace is free again: the next run is admitted and checked the same way
    second = await plane.start("net")
    assert (await plane.reaches("net", second, "failed")).reason == "policy_failed"


async def test_policies_apply_by_scope_org_folder_and_workspace(plane: Plane, repo: Path) -> None:
    """`net` (in folder inner, inside outer) is checked against the organization's, both
    folders' and its own sets, outermost first; `other` (no folder) only against the
    organization's: a workspace-scoped set does not touch another workspace."""
    commit(repo, {"main.tf": TWO})
    for folder, parent in (("outer", None), ("inner", "outer")):
        a = await plane.http.post(f"{V1}/folders", json={"name": folder, "parent": parent})
        assert a.status == 201, a.body
    await api_workspace(plane.http, repo, "net", folder="inner")
    await api_workspace(plane.http, repo, "other")
    await _policy(plane, "ws-net", "advisory", NO_CREATES, scope="workspace:net")
    await _policy(plane, "in-inner", "advisory", NO_CREATES, scope="folder:inner")
    await _policy(plane, "in-outer", "advisory", NO_DELETES, scope="folder:outer")
    await _policy(plane, "everywhere", "advisory", NO_DELETES)
    await plane.executor("e1")
    runs = {ws: await plane.start(ws, "plan") for ws in ("net", "other")}
    for ws, run_id in runs.items():
        done = await plane.reaches(ws, run_id, "planned", "failed")
        assert done.status == "planned", done.error_message
    net = await _read(plane, f"{V1}/runs/{runs['net']}")
    assert _results(net) == [
        ("everywhere", "advisory", "org", True, []),
        ("in-outer", "advisory", "folder:outer", True, []),
        ("in-inner", "advisory", "folder:inner", False, CREATED),
        ("ws-net", "advisory", "workspace:net", False, CREATED),
    ]
    other = await _read(plane, f"{V1}/runs/{runs['other']}")
    assert _results(other) == [("everywhere", "advisory", "org", True, [])]


async def test_a_run_keeps_the_policy_sets_it_pinned_at_admission(plane: Plane, repo: Path) -> None:
    """Admitted (queued, no executor yet) with an advisory set; the set then becomes
    hard-mandatory and a new one is added: the run is still checked against what it
    pinned, and applies. The next run gets the new sets and fails."""
    commit(repo, {"main.tf": TWO})
    await api_workspace(plane.http, repo, settings={"require_approval": False})
    await _policy(plane, "gate", "advisory", NO_CREATES)
    run_id = await plane.start("net")
    queued = await plane.pinned("net", run_id)
    assert queued.snapshot is not None
    assert [p.name for p in queued.snapshot.policies] == ["gate"]
    await _policy(plane, "gate", "hard-mandatory", NO_CREATES)
    await _policy(plane, "late", "hard-mandatory", NO_CREATES)

    await plane.executor("e1")
    done = await plane.reaches("net", run_id, "applied", "failed")
    assert done.status == "applied", done.error_message
    shown = await _read(plane, f"{V1}/runs/{run_id}")
    assert _results(shown) == [("gate", "advisory", "org", False, CREATED)]

    commit(repo, {"main.tf": TWO + 'resource "null_resource" "c" {}\n'})
    later = await plane.start("net")
    failed = await plane.reaches("net", later, "failed", "applied")
    assert failed.reason == "policy_failed"
    shown = await _read(plane, f"{V1}/runs/{later}")
    assert [(p["name"], p["enforcement"]) for p in shown["policies"]] == [
        ("gate", "hard-mandatory"),
        ("late", "hard-mandatory"),
    ]


SECRET_TF = """
variable "token" {
  type      = string
  sensitive = true
}
resource "null_resource" "t" {
  triggers = { h = sha256(var.token) }
}
output "token" {
  value     = var.token
  sensitive = true
}
"""
# Quotes what the plan carries in clear: the variable's value and the sensitive output.
LEAKY = """package leaky
import rego.v1

deny contains msg if {
  msg := sprintf("token is %s", [input.variables.token.value])
}
deny contains msg if {
  msg := sprintf("output is %s", [input.planned_values.outputs.token.value])
}
"""


async def test_policy_messages_never_carry_secret_or_sensitive_values(
    plane: Plane, repo: Path
) -> None:
    """A policy that quotes a secret variable and a sensitive output from the plan: its
    messages are masked in the run, its event and its step's log."""
    value = f"canary-{plane.root.name}-s3cr3t"
    commit(repo, {"main.tf": SECRET_TF})
    body = {"name": "net", "repository": str(repo), "secret_variables": {"token": value}}
    a = await plane.http.post(f"{V1}/workspaces", json=body)
    assert a.status == 201, a.body
    await _policy(plane, "leaky", "advisory", LEAKY)
    await plane.executor("e1")
    run_id = await plane.start("net", "plan")
    done = await plane.reaches("net", run_id, "planned", "failed")
    assert done.status == "planned", done.error_message
    shown = await _read(plane, f"{V1}/runs/{run_id}")
    assert _results(shown) == [
        ("leaky", "advisory", "org", False, ["output is ***", "token is ***"])
    ]
    history = await _read(plane, f"{V1}/runs/{run_id}/events")
    log = await _read(plane, f"{V1}/runs/{run_id}/logs?phase=plan&step=policy")
    assert "token is ***" in str(log)
    assert value not in str(history) and value not in str(log) and value not in str(shown)
