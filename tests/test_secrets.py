"""Secret variables: stored sealed, handed over only under the current lease, used by
Terraform through its environment, and found nowhere in clear afterwards."""

from __future__ import annotations

import hashlib
import secrets
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from events.run import ClaimPhase, FailRun, Workspace
from executor import secrets as executor_secrets
from executor.errors import StepFailed
from infra.crypto import KeyRing
from infra.kv import SECRETS_BUCKET
from infra.streams import LOGS_BUCKET
from services.app.commands import App
from services.app.secrets import SecretsResponder, SecretStore
from tests.canary_support import assert_no_file_holds, assert_no_stream_holds
from tests.helpers import eventually
from tests.plane_support import (  # noqa: F401  # registers the fixtures
    Plane,
    commit,
    plane_fixture,
)
from tests.state_support import current_state, sealed_object

CANARY_TF = """
variable "token" {
  type      = string
  sensitive = true
}
resource "null_resource" "t" {
  triggers = { h = sha256(var.token) }
  provisioner "local-exec" {
    command = "echo leak-${nonsensitive(var.token)}"
  }
}
output "token" {
  value     = var.token
  sensitive = true
}
"""


def canary() -> str:
    return f"canary-{secrets.token_hex(12)}"


async def test_secret_values_are_sealed_and_shown_by_name_only(plane: Plane) -> None:
    """Create, set and remove secret variables: answers and events say `(sensitive)` or
    the name; the KV entry is sealed and bound to its key."""
    value = canary()
    body = {
        "name": "net",
        "repository": "/r",
        "variables": {"n": "1"},
        "secret_variables": {"token": value},
    }
    created = await plane.http.post("/api/v1/orgs/acme/workspaces", json=body)
    assert created.status == 201, created.body
    assert created.body["secret_variables"] == {"token": "(sensitive)"}
    got = await plane.http.get("/api/v1/orgs/acme/workspaces/net")
    assert got.body["secret_variables"] == {"token": "(sensitive)"}
    ws = (await plane.app.load_ws("acme", "net")).state
    assert ws.config is not None
    assert ws.config.secret_variables == ["token"]

    kv = await plane.nc.jetstream().key_value(SECRETS_BUCKET)
    sealed = (await kv.get("acme.net.token")).value or b""
    assert value.encode() not in sealed
    assert plane.keyring.open(sealed, "acme.net.token") == value.encode()

    path = "/api/v1/orgs/acme/workspaces/net/secret-variables"
    put = await plane.http.call("PUT", f"{path}/other", json={"value": "v2"})
    assert (put.status, put.body) == (200, {"name": "other", "value": "(sensitive)"})
    assert await plane.secrets.names("acme", "net") == ["other", "token"]
    assert (await plane.http.call("DELETE", f"{path}/other")).status == 204
    (await plane.http.call("DELETE", f"{path}/other")).problem("not-found", 404)
    (await plane.http.call("PUT", f"{path}/n", json={"value": "x"})).problem("invalid-command", 422)
    (await plane.http.call("PUT", f"{path}/9bad", json={"value": "x"})).problem("invalid-id", 422)
    bad = {**body, "name": "net2", "secret_variables": {"n": "x"}}
    (await plane.http.post("/api/v1/orgs/acme/workspaces", json=bad)).problem(
        "invalid-command", 422
    )


async def test_the_responder_answers_only_the_runs_current_lease(nc: NATS, app: App) -> None:
    """The run's current lease gets the values; a stale or unknown lease, or a run that
    has ended, gets a refusal; with no responder the executor says so."""
    keyring = KeyRing.generate()
    store = SecretStore(nc, keyring)
    await app.create_org("acme", "alice")
    config = Workspace(repository="/r", secret_variables=["token"])
    await app.create_workspace("acme", "net", config, "alice")
    await store.put("acme", "net", "token", "t0k")
    run_id = (await app.create_run("acme", "net", "plan", "alice")).state.run_id
    await app.admit_next("acme", "net")
    claim = ClaimPhase(actor="executor:e", phase="plan", lease_id="lease-1", executor_id="e")
    await app.run_command("acme", "net", run_id, claim)

    def fetch(lease: str) -> object:
        return executor_secrets.fetch(
            nc, keyring, org="acme", ws="net", run_id=run_id, lease_id=lease, timeout=2
        )

    with pytest.raises(StepFailed, match="no secrets responder"):
        await fetch("lease-1")  # type: ignore[misc]  # a coroutine
    async with SecretsResponder(nc, app, store):
        assert await fetch("lease-1") == {"token": "t0k"}  # type: ignore[misc]
        with pytest.raises(StepFailed, match="not the current lease") as refused:
            await fetch("lease-0")  # type: ignore[misc]
        assert refused.value.reason == "secrets_unavailable"
        await app.run_command("acme", "net", run_id, FailRun(actor="s", reason="x"))
        with pytest.raises(StepFailed, match="not the current lease"):
            await fetch("lease-1")  # type: ignore[misc]


@pytest.mark.terraform
async def test_a_secret_canary_is_used_by_terraform_and_found_nowhere_in_clear(
    plane: Plane, repo: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Plan and apply use the secret (through TF_VAR_*); changing it before the apply
    changes nothing (the saved plan carries its values); then every message of every
    stream (KV and object buckets included), every file under the data directories and
    every log line is free of both values."""
    first, second = canary(), canary()
    commit(repo, {"main.tf": CANARY_TF})
    body = {"name": "net", "repository": str(repo), "secret_variables": {"token": first}}
    assert (await plane.http.post("/api/v1/orgs/acme/workspaces", json=body)).status == 201
    await plane.executor("ex1")
    run_id = await plane.start("net")
    await plane.reaches("net", run_id, "awaiting_approval")
    path = "/api/v1/orgs/acme/workspaces/net/secret-variables/token"
    assert (await plane.http.call("PUT", path, json={"value": second})).status == 200
    await plane.approve(run_id)
    applied = await plane.reaches("net", run_id, "applied")
    assert applied.apply_summary is not None and applied.apply_summary.add == 1

    state = await current_state(plane.nc, plane.keyring, "acme", "net")
    assert state is not None
    triggers = state["resources"][0]["instances"][0]["attributes"]["triggers"]
    assert triggers["h"] == hashlib.sha256(first.encode()).hexdigest(), "the planned value"
    assert state["outputs"]["token"]["value"] == first
    apply_log = await _step_log(plane, run_id, "apply")
    assert b"leak-***" in apply_log

    needles = [first.encode(), second.encode()]
    await assert_no_stream_holds(plane.nc.jetstream(), needles)
    assert_no_file_holds(tmp_path, needles)
    logs = capfd.readouterr()
    for needle in (first, second):
        assert needle not in logs.out and needle not in logs.err, "a log line holds the secret"


async def _step_log(plane: Plane, run_id: str, step: str) -> bytes:
    async def stored() -> str:  # the read model may not have folded the step's end yet
        a = await plane.http.get(f"/api/v1/orgs/acme/runs/{run_id}/steps")
        obj = next(s["log_object"] for s in a.body["items"] if s["step"] == step)
        assert obj, f"step {step} has no stored log yet"
        return str(obj)

    obj = await eventually(stored, timeout=10, what=f"the {step} step's log object")
    return await sealed_object(plane.nc, LOGS_BUCKET, obj)
