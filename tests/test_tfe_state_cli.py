"""The real Terraform against `runplane up --tls`: who may read the state, CLI pushes in
runplane's record, and run variables with Terraform 1.0.3.

- a viewer's token: `terraform state pull` fails with runplane's message (both the
  bundled 1.0.3's `remote` backend and a newer `cloud` block); the `cloud` block's
  `terraform output` (Terraform >= 1.3) works from the outputs alone, a sensitive
  value withheld; an operator's token pulls;
- `terraform state push` is recorded: runplane's list of versions names the user and
  the serial;
- Terraform 1.0.3's `remote` backend refuses `-var` itself ("Run variables are
  currently not supported", before any request: internal/backend/remote/backend_plan.go
  in every release through 1.15), and a `*.auto.tfvars` in the uploaded directory is how
  it sets variables (slow: a remote plan).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from executor.terraform import default_binary
from tests.tfe_cli_support import (
    CLOUD_HCL,
    HCL,
    Cli,
    _newer_terraform,
    cli_fixture,
    ok,
    plane,
    terraform,
)

__all__ = ["cli_fixture"]

pytestmark = pytest.mark.terraform
REFUSED = "may read this workspace's outputs but not its whole state"


def _env(home: Path, ca: Path, host: str, token: str) -> dict[str, str]:
    (home / ".terraform.d").mkdir(parents=True, exist_ok=True)
    creds = {"credentials": {host: {"token": token}}}
    (home / ".terraform.d" / "credentials.tfrc.json").write_text(json.dumps(creds))
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "SSL_CERT_FILE": str(ca),
        "TF_IN_AUTOMATION": "1",
        "CHECKPOINT_DISABLE": "1",
    }


def _state(serial: int, lineage: str) -> dict[str, Any]:
    return {
        "version": 4,
        "terraform_version": "1.0.3",
        "serial": serial,
        "lineage": lineage,
        "outputs": {
            "greeting": {"value": "from the cli", "type": "string"},
            "secret": {"value": "hunter2", "type": "string", "sensitive": True},
        },
        "resources": [],
    }


async def test_a_viewer_reads_outputs_but_cannot_pull_state_and_pushes_are_recorded(
    tmp_path: Path,
) -> None:
    newer = _newer_terraform()
    async with plane(tmp_path) as (api, host, ca, _):
        await api.ok("POST", "/api/v1/orgs", {"name": "acme"})
        tokens = {
            role: (
                await api.ok(
                    "POST", "/api/v1/orgs/acme/tokens", {"user": f"{role}-u", "role": role}
                )
            )["token"]
            for role in ("viewer", "operator", "admin")
        }
        env = {r: _env(tmp_path / f"home-{r}", ca, host, t) for r, t in tokens.items()}
        cloud, remote = tmp_path / "cloud", tmp_path / "remote"
        for work, hcl in ((cloud, CLOUD_HCL), (remote, HCL)):
            work.mkdir()
            (work / "main.tf").write_text(hcl.format(host=host, ws="edge"))
        ok(terraform(cloud, env["admin"], "init", "-input=false", "-no-color", binary=newer))
        ok(terraform(remote, env["admin"], "init", "-input=false", "-no-color"))

        # the operator pushes (the 1.0.3 remote backend): each push recorded with its user
        # and serial; into no state the CLI writes a lineage of its own (Terraform's doing)
        lineage = "8e5b8f54-0000-4000-8000-000000000002"
        (remote / "s.tfstate").write_text(json.dumps(_state(3, lineage)))
        ok(terraform(remote, env["operator"], "state", "push", "s.tfstate"))
        first = json.loads(ok(terraform(remote, env["operator"], "state", "pull")))
        (remote / "s.tfstate").write_text(json.dumps(_state(7, lineage)))  # another lineage
        ok(terraform(remote, env["operator"], "state", "push", "-force", "s.tfstate"))
        pulled = json.loads(ok(terraform(remote, env["operator"], "state", "pull")))
        assert pulled["lineage"] == lineage and pulled["serial"] >= 7
        versions = (await api.ok("GET", "/api/v1/orgs/acme/workspaces/edge/state-versions"))[
            "items"
        ]
        assert [(v["pushed_by"], v["serial"], v["lineage"], v["forced"]) for v in versions] == [
            ("operator-u", pulled["serial"], lineage, True),
            ("operator-u", first["serial"], first["lineage"], False),
        ]
        assert {v["run_id"] for v in versions} == {None}

        # the viewer: no whole state through either client, runplane's reason printed
        for argv, work, binary in (
            (("state", "pull"), remote, ""),
            (("output", "-no-color"), remote, ""),  # 1.0.3 reads outputs from the state
            (("state", "pull"), cloud, newer),
        ):
            refused = terraform(work, env["viewer"], *argv, binary=binary)
            assert refused.returncode != 0, (argv, refused.stdout)
            said = " ".join((refused.stdout + refused.stderr).split())
            assert REFUSED in said and "hunter2" not in said, (argv, said)
        # the cloud block's `output` reads the outputs alone; the secret stays withheld
        out = json.loads(ok(terraform(cloud, env["viewer"], "output", "-json", binary=newer)))
        assert out["greeting"]["value"] == "from the cli"
        assert out["secret"]["sensitive"] is True and out["secret"].get("value") is None
        # an operator reads all of it
        out = json.loads(ok(terraform(cloud, env["operator"], "output", "-json", binary=newer)))
        assert out["secret"]["value"] == "hunter2"
        ws = await api.ok("GET", "/api/v1/orgs/acme/workspaces/edge")
        assert ws["lock"] is None


async def test_terraform_1_0_3_refuses_run_variables_itself_with_its_own_message(
    tmp_path: Path,
) -> None:
    """The `remote` backend of Terraform 1.0.3 (and of every release since) does not send
    `-var`: it stops the plan before creating a run, and says how to set variables."""
    async with plane(tmp_path) as (api, host, ca, _):
        await api.ok("POST", "/api/v1/orgs", {"name": "acme"})
        issued = await api.ok(
            "POST", "/api/v1/orgs/acme/tokens", {"user": "alice", "role": "admin"}
        )
        env = _env(tmp_path / "home", ca, host, issued["token"])
        work = tmp_path / "cli"
        work.mkdir()
        (work / "main.tf").write_text(
            HCL.format(host=host, ws="vars") + 'variable "who" { type = string }\n'
        )
        ok(terraform(work, env, "init", "-input=false", "-no-color"))
        refused = terraform(work, env, "plan", "-no-color", "-var", "who=alice")
        assert refused.returncode != 0
        said = " ".join(refused.stderr.split())
        assert "Run variables are currently not supported" in said, said
        assert "*.auto.tfvars" in said
        runs = await api.ok("GET", "/api/v1/orgs/acme/workspaces/vars/runs")
        assert runs["items"] == []  # refused before any run was created
    assert str(default_binary())  # the bundled 1.0.3


@pytest.mark.slow
async def test_an_auto_tfvars_file_sets_variables_for_terraform_1_0_3s_remote_plan(
    cli: Cli,
) -> None:
    """What the remote backend documents instead of `-var`: `*.auto.tfvars` in the
    working directory is uploaded with it, and the remote plan loads it."""
    work = cli.workdir(
        "tfvars",
        'variable "who" { type = string }\n'
        'resource "null_resource" "a" { triggers = { who = var.who } }\n'
        'output "who" { value = var.who }\n',
    )
    (work / "who.auto.tfvars").write_text('who = "alice"\n')
    ok(await asyncio.to_thread(cli.tf, work, "init", "-input=false", "-no-color"))
    out = ok(await asyncio.to_thread(cli.tf, work, "apply", "-auto-approve", "-no-color"))
    assert "Apply complete! Resources: 1 added" in out, out
    state = json.loads(ok(await asyncio.to_thread(cli.tf, work, "state", "pull")))
    assert state["outputs"]["who"]["value"] == "alice"
