"""A canary secret, configured as secret variables of two workspaces, used by real
Terraform (null provider) through a full apply, a destroy and an apply that fails with
the secret in its command, is found in clear nowhere afterwards (as it is, each line of
it, JSON-escaped the Go and the Python way; one value holds `<>&"\\`, unicode and a line
break, and is not declared sensitive, so Terraform prints it in clear in the plan, its
outputs, a provisioner's output and an error): not in any message of any stream
(RP_EVENTS, RP_LOGS, dispatch, heartbeats, every KV and object store bucket: plans,
state versions, step logs), not in any file (SQLite read models and WAL, the
nats-server store, executor work directories), not in any answer of the API about the
runs, and not in this process's output (every log line of api, scheduler, projector and
executor). As a positive control, the sealed state version does hold it once opened.

The scanning is `tests/canary_support.py`, shared with `tests/test_secrets.py`."""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import pytest

from tests.canary_support import (
    assert_no_file_holds,
    assert_no_stream_holds,
    encodings,
    tricky_canary,
)
from tests.executor_support import git
from tests.plane_support import (  # noqa: F401  # registers the fixtures
    Plane,
    commit,
    plane_fixture,
)
from tests.state_support import current_state

pytestmark = pytest.mark.terraform

TF = """
variable "token" {
  type      = string
  sensitive = true
}
variable "quoted" {
  type      = string
  sensitive = true
}
# Not declared sensitive: Terraform shows it in clear in the plan, its -json output (Go's
# HTML-safe escaping) and the provisioner's output, line by line.
variable "tricky" { type = string }
resource "null_resource" "t" {
  triggers = { h = sha256(var.token), q = sha256(var.quoted), t = var.tricky }
  provisioner "local-exec" {
    command = "echo leak-${nonsensitive(var.token)}; printf '%s\\\\n' \\"$T\\""
    environment = { T = var.tricky }
  }
}
output "token" {
  value     = var.token
  sensitive = true
}
output "quoted" {
  value     = var.quoted
  sensitive = true
}
output "tricky" { value = var.tricky }
"""

# Fails its apply with the secret in the command Terraform quotes in its error.
FAILING_TF = """
variable "token" {
  type      = string
  sensitive = true
}
variable "tricky" { type = string }
resource "null_resource" "boom" {
  provisioner "local-exec" {
    command     = "echo boom-${nonsensitive(var.token)} >&2; printf '%s\\\\n' \\"$T\\" >&2; exit 3"
    environment = { T = var.tricky }
  }
}
"""

RUN_PATHS = ("", "/events", "/steps", "/changes", "/resources", "/logs")


def _needles(*values: str, cores: list[str]) -> list[bytes]:
    """Each value and each of its lines as it is and as JSON strings hold it (Go's and
    Python's escaping), and the random cores of the tricky value's lines (in any
    encoding, a core in clear is a leak)."""
    out = [n for v in values for n in encodings(v)]
    return sorted({*out, *(c.encode() for c in cores)})


async def _answers(plane: Plane, runs: dict[str, str]) -> list[tuple[str, bytes]]:
    """Every API answer about the runs and their workspaces, as raw JSON."""
    paths = []
    for run_id, ws in runs.items():
        paths += [f"/api/v1/orgs/acme/runs/{run_id}{p}" for p in RUN_PATHS]
        paths += [
            f"/api/v1/orgs/acme/workspaces/{ws}{p}"
            for p in ("", "/runs", "/state-versions", "/settings")
        ]
    paths += ["/api/v1/orgs/acme/runs", "/api/v1/orgs/acme/workspaces", "/api/v1/orgs/acme"]
    out = []
    for path in sorted(set(paths)):
        a = await plane.http.get(path)
        assert a.status == 200, (path, a.body)
        out.append((path, json.dumps(a.body).encode()))
    return out


async def _logs(plane: Plane, run_id: str) -> list[dict[str, Any]]:
    a = await plane.http.get(f"/api/v1/orgs/acme/runs/{run_id}/logs")
    assert a.status == 200, a.body
    return a.body["items"]  # type: ignore[no-any-return]  # JSON list


async def _full_lifecycle(
    plane: Plane, repo: Path, bad_repo: Path
) -> tuple[list[bytes], dict[str, str]]:
    token = f"canary-{secrets.token_hex(12)}"
    quoted = f'canary-"{secrets.token_hex(6)}\\{secrets.token_hex(6)}'
    tricky, cores = tricky_canary()
    commit(repo, {"main.tf": TF})
    commit(bad_repo, {"main.tf": FAILING_TF})
    for name, path, values in (
        ("net", repo, {"token": token, "quoted": quoted, "tricky": tricky}),
        ("bad", bad_repo, {"token": token, "tricky": tricky}),
    ):
        body = {"name": name, "repository": str(path), "secret_variables": values}
        created = await plane.http.post("/api/v1/orgs/acme/workspaces", json=body)
        assert created.status == 201, created.body
    await plane.executor("ex1")
    runs: dict[str, str] = {}

    # 1. apply: plan (saved plan sealed), approval, apply (a state version), logs masked
    applied = await plane.start("net")
    runs[applied] = "net"
    await plane.reaches("net", applied, "awaiting_approval")
    await plane.approve(applied)
    done = await plane.reaches("net", applied, "applied")
    assert done.apply_summary is not None and done.apply_summary.add == 1
    state = await current_state(plane.nc, plane.keyring, "acme", "net")
    assert state is not None
    assert state["outputs"]["token"]["value"] == token, "positive control: sealed, not gone"
    assert state["outputs"]["quoted"]["value"] == quoted
    assert state["outputs"]["tricky"]["value"] == tricky
    lines = await _logs(plane, applied)
    apply_text = [i["text"] for i in lines if i["phase"] == "apply"]
    assert apply_text and any("leak-***" in t for t in apply_text), "the apply log is masked"
    assert sum(t.endswith("(local-exec): ***") for t in apply_text) == 2, "line by line"

    # 2. destroy: a second plan, approval and state version
    destroyed = await plane.start("net", "destroy")
    runs[destroyed] = "net"
    await plane.reaches("net", destroyed, "awaiting_approval")
    await plane.approve(destroyed)
    await plane.reaches("net", destroyed, "applied")

    # 3. an apply that fails with the secret in the command Terraform reports
    failed = await plane.start("bad")
    runs[failed] = "bad"
    await plane.reaches("bad", failed, "awaiting_approval")
    await plane.approve(failed)
    broken = await plane.reaches("bad", failed, "failed")
    assert broken.reason == "apply_failed", broken
    assert "boom" in broken.error_message, "the error is kept, masked"

    versions = (await plane.http.get("/api/v1/orgs/acme/workspaces/net/state-versions")).body
    assert len(versions["items"]) >= 2, "state versions of the apply and of the destroy"
    return _needles(token, quoted, tricky, cores=cores), runs


async def test_a_canary_secret_is_found_nowhere_after_full_runs(
    plane: Plane, repo: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    bad_repo = tmp_path / "bad-repo"
    bad_repo.mkdir()
    git(bad_repo, "init", "-q", "-b", "main")
    needles, runs = await _full_lifecycle(plane, repo, bad_repo)

    required = {"RP_EVENTS", "RP_LOGS", "KV_rp-secrets", "OBJ_rp-state", "OBJ_rp-plans"}
    scanned = await assert_no_stream_holds(plane.nc.jetstream(), needles, required=required)
    for bucket in ("OBJ_rp-plans", "OBJ_rp-state", "OBJ_rp-logs", "KV_rp-secrets"):
        assert scanned.get(bucket), f"{bucket} was empty: nothing scanned"
    files = assert_no_file_holds(tmp_path, needles)
    answers = await _answers(plane, runs)
    for path, raw in answers:
        for needle in needles:
            assert needle not in raw, f"GET {path} holds the secret"
    out = capfd.readouterr()
    for needle in needles:
        text = needle.decode()
        assert text not in out.out and text not in out.err, "a log line holds the secret"
    with capfd.disabled():
        print(
            f"\ncanary: {len(runs)} runs; scanned {sum(scanned.values())} stream messages "
            f"{scanned}, {files} files, {len(answers)} API answers, "
            f"{len(out.out) + len(out.err)} bytes of log output"
        )
