"""The real Terraform 1.0.3 against `runplane up --tls` with a workspace allowed one
unused configuration version: its plan runs (the run frees the slot), and once the slot
is taken the CLI prints the quota's refusal, naming the limit and how to free it."""

from __future__ import annotations

import pytest

from services.surfaces.tfe import quota
from tests.tfe_cli_support import Cli, cli_fixture, ok, resources

__all__ = ["cli_fixture"]

pytestmark = [pytest.mark.terraform, pytest.mark.slow]


@pytest.fixture(autouse=True)
def one_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """`runplane up` reads the setting from the environment it inherits."""
    monkeypatch.setenv(quota.PENDING_PER_WORKSPACE_ENV, "1")


async def test_the_cli_plans_within_the_quota_and_prints_its_refusal(cli: Cli) -> None:
    work = cli.workdir("net", resources(1))
    ok(cli.tf(work, "init", "-input=false"))
    for _ in range(2):  # each plan's run frees the one slot its upload took
        assert "Plan: 1 to add, 0 to change, 0 to destroy." in ok(cli.tf(work, "plan"))
    status, _ = await cli.api.call("POST", "/api/v2/workspaces/ws-acme.net/configuration-versions")
    assert status == 201  # the slot, taken by a version never uploaded
    refused = cli.tf(work, "plan")
    assert refused.returncode != 0
    said = " ".join((refused.stdout + refused.stderr).split())
    assert "workspace net has 1 configuration version no run has used (the limit is 1)" in said
    assert "start a run of one" in said
    assert "Traceback" not in said
