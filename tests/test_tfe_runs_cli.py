"""The real Terraform 1.0.3 (`backend "remote"`) runs plan and apply on runplane's
executors, end to end against `runplane up --tls`.

`terraform plan` uploads the working directory, runs a speculative plan remotely and
prints its log with the right counts; `terraform apply -auto-approve` applies it; an
apply whose CLI waits at its prompt is approved from runplane's API; `-destroy`
destroys; a hard-mandatory policy refuses a plan and the CLI shows its message. Every
run is recorded with cause `cli`.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest

from executor.terraform import default_binary
from tests.tfe_cli_support import (
    CLOUD_HCL,
    Cli,
    Https,
    _newer_terraform,
    cli_fixture,  # noqa: F401  # the `cli` fixture
    ok,
    resources,
)

pytestmark = [pytest.mark.terraform, pytest.mark.slow]

NO_CREATES = """package terraform.creates
import rego.v1

deny contains msg if {
  some rc in input.resource_changes
  rc.type == "null_resource"
  "create" in rc.change.actions
  msg := sprintf("no creating %s here", [rc.address])
}
"""


async def test_plan_then_apply_then_destroy_run_remotely(cli: Cli) -> None:
    work = cli.workdir("net", resources(3))
    ok(cli.tf(work, "init", "-input=false", "-no-color"))

    plan = await asyncio.to_thread(cli.tf, work, "plan", "-no-color")
    out = ok(plan)
    assert "Plan: 3 to add, 0 to change, 0 to destroy." in out, out
    assert "null_resource.r2: Plan to create" in out, out
    run = await cli.newest("net", "planned")
    assert run["type"] == "plan" and len(await cli.runs("net")) == 1
    assert run["cause"] == {"kind": "cli", "user": "alice"}

    applied = ok(await asyncio.to_thread(cli.tf, work, "apply", "-auto-approve", "-no-color"))
    assert "Apply complete! Resources: 3 added, 0 changed, 0 destroyed." in applied, applied
    pulled = json.loads(ok(cli.tf(work, "state", "pull")))
    assert sorted(r["name"] for r in pulled["resources"]) == ["r0", "r1", "r2"]
    latest = await cli.newest("net", "applied")
    assert latest["type"] == "apply"
    assert latest["cause"]["kind"] == "cli"

    destroyed = ok(
        await asyncio.to_thread(cli.tf, work, "apply", "-destroy", "-auto-approve", "-no-color")
    )
    assert "Resources: 0 added, 0 changed, 3 destroyed." in destroyed, destroyed
    assert json.loads(ok(cli.tf(work, "state", "pull")))["resources"] == []
    assert (await cli.newest("net", "applied"))["type"] == "destroy"


async def test_an_apply_waiting_at_the_cli_prompt_is_approved_from_runplane(cli: Cli) -> None:
    work = cli.workdir("wait", resources(2))
    ok(cli.tf(work, "init", "-input=false", "-no-color"))
    proc = await asyncio.create_subprocess_exec(
        str(default_binary()),
        "apply",
        "-no-color",
        cwd=work,
        env=cli.env,
        stdin=asyncio.subprocess.PIPE,  # kept open, never answered: approved elsewhere
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert proc.stdout is not None
    out = b""
    try:
        # the CLI asks (its prompt has no newline): the run waits for its "yes"
        while b"Enter a value:" not in out:
            chunk = await asyncio.wait_for(proc.stdout.read(4096), timeout=90)
            assert chunk, out.decode()
            out += chunk
        (run,) = await cli.runs("wait")
        assert run["status"] == "awaiting_approval", run
        await cli.api.ok(
            "POST", f"/api/v1/orgs/acme/runs/{run['id']}/approve", {"acknowledged": []}
        )
        out += await asyncio.wait_for(proc.stdout.read(), timeout=120)
        code = await asyncio.wait_for(proc.wait(), timeout=10)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    text = out.decode()
    assert code == 0, text
    assert "Apply complete! Resources: 2 added, 0 changed, 0 destroyed." in text, text
    done = await cli.newest("wait", "applied")
    assert done["approved_by"] == "admin", done


async def test_a_hard_mandatory_policy_refuses_the_cli_plan_with_its_message(cli: Cli) -> None:
    policy = {"enforcement": "hard-mandatory", "source": NO_CREATES}
    await cli.api.ok("PUT", "/api/v1/orgs/acme/policies/no-creates", policy)
    work = cli.workdir("guarded", resources(1))
    ok(cli.tf(work, "init", "-input=false", "-no-color"))
    refused = await asyncio.to_thread(cli.tf, work, "plan", "-no-color")
    text = refused.stdout + refused.stderr
    assert refused.returncode != 0, text
    assert "no creating null_resource.r0 here" in text, text
    assert "hard failed" in text, text
    run = await cli.newest("guarded", "failed")
    assert run["reason"] == "policy_failed", run


async def _apply_answering(cli: Cli, work: Path, answer: bytes, *args: str) -> tuple[int, str]:
    """`terraform apply` that answers its prompt with `answer` once it asks."""
    proc = await asyncio.create_subprocess_exec(
        str(default_binary()),
        "apply",
        "-no-color",
        *args,
        cwd=work,
        env=cli.env,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert proc.stdout is not None and proc.stdin is not None
    out = b""
    try:
        while b"Enter a value:" not in out:
            chunk = await asyncio.wait_for(proc.stdout.read(4096), timeout=90)
            assert chunk, out.decode()
            out += chunk
        proc.stdin.write(answer)
        await proc.stdin.drain()
        out += await asyncio.wait_for(proc.stdout.read(), timeout=120)
        code = await asyncio.wait_for(proc.wait(), timeout=10)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return code, out.decode()


async def test_the_clis_yes_applies_and_its_no_discards(cli: Cli) -> None:
    work = cli.workdir("prompt", resources(1))
    ok(cli.tf(work, "init", "-input=false", "-no-color"))
    code, out = await _apply_answering(cli, work, b"no\n")
    assert code != 0 and "Apply discarded." in out, out
    await cli.newest("prompt", "discarded")
    code, out = await _apply_answering(cli, work, b"yes\n")
    assert code == 0, out
    assert "Apply complete! Resources: 1 added, 0 changed, 0 destroyed." in out, out
    done = await cli.newest("prompt", "applied")
    assert done["approved_by"] == "alice", done


async def test_target_replace_and_refresh_only_reach_the_remote_plan(cli: Cli) -> None:
    work = cli.workdir("flags", resources(3))
    ok(cli.tf(work, "init", "-input=false", "-no-color"))
    out = ok(
        await asyncio.to_thread(
            cli.tf, work, "apply", "-auto-approve", "-no-color", "-target=null_resource.r1"
        )
    )
    assert "Resources: 1 added, 0 changed, 0 destroyed." in out, out
    state = json.loads(ok(cli.tf(work, "state", "pull")))
    assert [r["name"] for r in state["resources"]] == ["r1"]
    out = ok(
        await asyncio.to_thread(
            cli.tf,
            work,
            "plan",
            "-no-color",
            "-replace=null_resource.r1",
            "-target=null_resource.r1",
        )
    )
    assert "Plan: 1 to add, 0 to change, 1 to destroy." in out, out
    out = ok(await asyncio.to_thread(cli.tf, work, "plan", "-no-color", "-refresh-only"))
    # r0 and r2 are not in the state: a normal plan would add them, a refresh-only none
    assert "Plan: 0 to add, 0 to change, 0 to destroy." in out, out
    # an address that is none is refused (by the CLI itself here; runplane checks it
    # again, events.values.ADDRESS_RE: test_tfe_runs_api)
    bad = await asyncio.to_thread(cli.tf, work, "plan", "-no-color", "-target=null_resource.r1[")
    assert bad.returncode != 0


async def test_confirm_destructive_holds_a_cli_destroy_for_approval_in_runplane(cli: Cli) -> None:
    work = cli.workdir("careful", resources(1))
    ok(cli.tf(work, "init", "-input=false", "-no-color"))
    ok(await asyncio.to_thread(cli.tf, work, "apply", "-auto-approve", "-no-color"))
    await cli.api.ok(
        "PATCH", "/api/v1/orgs/acme/workspaces/careful/settings", {"confirm_destructive": True}
    )
    out = ok(
        await asyncio.to_thread(cli.tf, work, "apply", "-destroy", "-auto-approve", "-no-color")
    )
    # the CLI cannot acknowledge the deletion: it stops, saying where the run waits
    assert "confirm_destructive is on" in out and "null_resource.r0" in out, out
    assert "Apply complete" not in out, out
    run = await cli.newest("careful", "awaiting_approval")
    assert run["type"] == "destroy"
    refused = await cli.api.call(
        "POST", f"/api/v1/orgs/acme/runs/{run['id']}/approve", {"acknowledged": []}
    )
    assert refused[0] == 409
    await cli.api.ok(
        "POST",
        f"/api/v1/orgs/acme/runs/{run['id']}/approve",
        {"acknowledged": ["null_resource.r0"]},
    )
    await cli.api.run_to(run["id"], {"applied"})
    assert json.loads(ok(cli.tf(work, "state", "pull")))["resources"] == []


async def test_four_eyes_holds_a_cli_apply_for_another_person_in_runplane(cli: Cli) -> None:
    """four_eyes: the CLI's user (alice) created the run, so the CLI is not asked to
    confirm it (`is-confirmable` false): its log says why and it stops; alice cannot
    approve it in runplane either, another person can, and the apply follows."""
    work = cli.workdir("pair", resources(1))
    ok(cli.tf(work, "init", "-input=false", "-no-color"))
    await cli.api.ok("PATCH", "/api/v1/orgs/acme/workspaces/pair/settings", {"four_eyes": True})
    out = ok(await asyncio.to_thread(cli.tf, work, "apply", "-auto-approve", "-no-color"))
    assert "four_eyes is on" in out, out
    assert "Apply complete" not in out, out
    run = await cli.newest("pair", "awaiting_approval")
    assert run["cause"]["kind"] == "cli" and run["created_by"] == "alice", run
    issued = await cli.api.ok(
        "POST", "/api/v1/orgs/acme/tokens", {"user": "alice", "role": "admin"}
    )
    alice = Https(cli.api.base, Path(cli.env["SSL_CERT_FILE"]), issued["token"])
    try:
        status, problem = await alice.call(
            "POST", f"/api/v1/orgs/acme/runs/{run['id']}/approve", {"acknowledged": []}
        )
    finally:
        await alice.session.close()
    assert status == 403 and "four_eyes" in problem["detail"], (status, problem)
    await cli.api.ok("POST", f"/api/v1/orgs/acme/runs/{run['id']}/approve", {"acknowledged": []})
    done = await cli.api.run_to(run["id"], {"applied"})
    assert done["approved_by"] == "admin", done
    assert len(json.loads(ok(cli.tf(work, "state", "pull")))["resources"]) == 1


async def test_a_cloud_block_plans_and_applies_remotely_with_run_variables(cli: Cli) -> None:
    """A newer Terraform's `cloud` block (1.11 here, where the machine has one) runs the
    same remote operations on an executor running the same version, and sends `-var` as
    run variables."""
    newer = _newer_terraform()
    work = cli.root / "cloud"
    work.mkdir()
    (work / "main.tf").write_text(
        CLOUD_HCL.format(host=cli.host, ws="cloudy").replace('output "greeting"', "# ", 1)
        + 'variable "who" { type = string }\n'
        + 'resource "null_resource" "a" { triggers = { who = var.who } }\n'
        + 'output "who" { value = var.who }\n'
    )

    def tf(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [newer, *args], cwd=work, env=cli.env, capture_output=True, text=True, timeout=90
        )

    ok(await asyncio.to_thread(tf, "init", "-input=false", "-no-color"))
    # the executors run what the workspace's terraform_binary names: Terraform 1.0.3
    # cannot read a `cloud` block, so this workspace runs the newer one
    # newer clients' -auto-approve sends `auto-apply` and no apply action: runplane's
    # require_approval (on by default) would hold the run for an approval in runplane
    settings = {"terraform_binary": newer, "require_approval": False}
    await cli.api.ok("PATCH", "/api/v1/orgs/acme/workspaces/cloudy/settings", settings)
    out = ok(await asyncio.to_thread(tf, "plan", "-no-color", "-var", "who=alice"))
    assert "Plan: 1 to add, 0 to change, 0 to destroy." in out, out
    out = ok(await asyncio.to_thread(tf, "apply", "-auto-approve", "-no-color", "-var", "who=bob"))
    assert "Apply complete! Resources: 1 added" in out, out
    state = json.loads(ok(await asyncio.to_thread(tf, "state", "pull")))
    assert state["outputs"]["who"]["value"] == "bob"
