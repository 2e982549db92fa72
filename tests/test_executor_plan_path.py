"""The executor's path from a claim to a plan: what it costs, and what it may not share.

Each phase's `init` installs the providers from the executor's published mirror
(`executor/terraform.py`, unpacked layout, read-only to every job: Terraform links them,
nothing is copied or cached per run). No plugin cache is shared between jobs: a tenant's
job must never be able to write a provider another organization's run then executes.
The attack below plants providers wherever a shared store could be; it fails as soon as
the published mirror, or a plugin cache handed to jobs, is writable by them.

A phase's uid is found without a look at all of /proc and every jobs directory per uid
(executor/uids.py), which took 0.4-0.5 s per phase on a machine where killed
executors had left a few dozen uids in use.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from executor import uids as job_uids
from executor.isolation import Isolation
from executor.worker import default_jobs_dir
from tests.executor_support import commit
from tests.procs import Client, Proc, free_port, wait_healthy

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="user isolation needs root")

TOKEN = "admin-canary-plan-path-5c1e"


# ---------------------------------------------------------------- uids


def test_a_uid_past_many_left_in_use_is_found_with_two_looks_at_proc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """30 uids own job directories killed executors left: none of them is handed out,
    and finding the 31st looks at /proc twice (once per uid before: 31 looks)."""
    base = 1_600_000_000 + (os.getpid() % 10_000) * 100  # a range no executor here uses
    uids = range(base, base + 40)
    left = Path(tempfile.mkdtemp(prefix="runplane-leftovers-", dir=tempfile.gettempdir()))
    looks = 0
    real = job_uids.terraform_processes

    def counted() -> Iterator[tuple[Path, int]]:
        nonlocal looks
        looks += 1
        return real()

    monkeypatch.setattr(job_uids, "terraform_processes", counted)
    try:
        for i, uid in enumerate(uids[:30]):
            home = left / "jobs" / f"dead-{i}" / "home"
            home.mkdir(parents=True)
            os.chown(home, uid, uid)
        iso = Isolation(mode="user", uids=uids, lock_dir=tmp_path / "locks")
        (tmp_path / "tmp").mkdir()
        (tmp_path / "root").mkdir()
        jail = iso.enter(tmp_path / "root", tmp_path / "tmp")
        try:
            assert jail.uid == uids[30], "a uid owning a leftover job is never handed out"
            assert looks <= 2, f"{looks} looks at /proc for one uid"
        finally:
            jail.close()
    finally:
        shutil.rmtree(left)


# ---------------------------------------------------------------- providers


@dataclass
class Plane:
    proc: Proc
    client: Client
    data: Path

    def tools(self) -> Path:
        return default_jobs_dir(self.data / "work") / "tools"


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[Plane]:
    """`runplane up` (jobs as uids of their own) with two organizations."""
    data, port = tmp_path / "data", free_port()
    proc = await Proc(
        ["up", "--no-demo", "--data-dir", str(data), "--listen", f"127.0.0.1:{port}"],
        tmp_path / "up.log",
        env={"RUNPLANE_ADMIN_TOKEN": TOKEN, "RUNPLANE_ENCRYPTION_KEY": ""},
    ).start()
    base = f"http://127.0.0.1:{port}"
    client = Client(base, TOKEN)
    try:
        await wait_healthy(base)
        for org in ("acme", "other"):
            await client.ok("POST", "/api/v1/orgs", {"name": org})
        yield Plane(proc, client, data)
    finally:
        await client.close()
        await proc.stop(signal.SIGTERM)


def _digest(top: Path) -> str:
    """Every file under `top` (links followed, as Terraform follows them), by content."""
    h = hashlib.sha256()
    for path in sorted(p for p in top.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(top)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _poison(tools: Path, jobs_root: Path) -> str:
    """Shell that overwrites every null provider it can reach, plants a newer version in
    every mirror, and plants one in any plugin cache it can find (TF_PLUGIN_CACHE_DIR, a
    `plugin_cache_dir` of the CLI config, a cache directory beside the jobs)."""
    fake = "printf '#!/bin/sh\\necho POISONED >&2\\nexit 1\\n'"
    newer = "registry.terraform.io/hashicorp/null/9.9.9/linux_amd64"
    same = "registry.terraform.io/hashicorp/null/2.1.2/linux_amd64"
    return (
        "echo uid=$(id -u); "
        f"for f in $(find {tools} -name 'terraform-provider-null*' 2>/dev/null); do "
        f'  ({fake} > "$f") 2>/dev/null && echo WROTE-PROVIDER; done; '
        f"for m in {tools}/*/mirrors/*; do "
        f"  (mkdir -p $m/{newer} && {fake} > $m/{newer}/terraform-provider-null_v9.9.9_x5 "
        f"   && chmod 755 $m/{newer}/terraform-provider-null_v9.9.9_x5) 2>/dev/null "
        "  && echo PLANTED-VERSION; done; "
        'caches="$TF_PLUGIN_CACHE_DIR"; '
        'if [ -n "$TF_CLI_CONFIG_FILE" ]; then caches="$caches '
        '$(sed -n \'s/^ *plugin_cache_dir *= *"\\(.*\\)"/\\1/p\' "$TF_CLI_CONFIG_FILE")"; fi; '
        f'for c in $caches {jobs_root}/*cache*; do [ -d "$c" ] || continue; '
        f"  (mkdir -p $c/{same} && {fake} > $c/{same}/terraform-provider-null_v2.1.2_x4 "
        f"   && chmod 755 $c/{same}/terraform-provider-null_v2.1.2_x4) 2>/dev/null "
        "  && echo PLANTED-CACHE; done; "
        "exit 0"
    )


async def _run(plane: Plane, org: str, body: dict[str, Any]) -> dict[str, Any]:
    run = await plane.client.ok("POST", f"/api/v1/orgs/{org}/workspaces/net/runs", body)
    return await plane.client.wait_status(
        org, run["id"], {"failed", "planned", "awaiting_approval", "applied"}, timeout=120
    )


@pytest.mark.terraform
async def test_a_tenants_job_cannot_plant_a_provider_another_orgs_run_executes(
    plane: Plane, repo: Path
) -> None:
    """Attack: org A's admin runs a custom step that overwrites the null provider in the
    executor's published mirror, plants a newer `null` (which an unconstrained
    requirement would pick) and plants one in any plugin cache it finds. Org B's plan
    right after on the same executor must run the genuine provider: it plans, and the
    mirror is byte for byte what it was."""
    commit(repo, 'resource "null_resource" "a" {}\n')
    for org in ("acme", "other"):
        body = {"name": "net", "repository": str(repo)}
        await plane.client.ok("POST", f"/api/v1/orgs/{org}/workspaces", body)
    warm = await _run(plane, "other", {"type": "plan"})  # the tools are published
    assert warm["status"] == "planned", warm
    before = _digest(plane.tools())
    attack = _poison(plane.tools(), plane.tools().parent)
    steps = [
        {"number": 50, "kind": "custom", "name": "poison", "command": attack},
        {"number": 100, "kind": "plan"},
    ]
    await plane.client.ok("PUT", "/api/v1/orgs/acme/templates/poison", {"steps": steps})
    attacked = await _run(plane, "acme", {"type": "plan", "template": "poison"})
    logs = await plane.client.ok(
        "GET", f"/api/v1/orgs/acme/runs/{attacked['id']}/logs?phase=custom-50"
    )
    lines = [str(item["text"]).rstrip("\n") for item in logs["items"]]
    assert any(ln.startswith("uid=") and ln != "uid=0" for ln in lines), lines
    assert not [ln for ln in lines if ln.startswith(("WROTE-", "PLANTED-"))], lines
    victim = await _run(plane, "other", {"type": "plan"})
    assert victim["status"] == "planned", victim
    assert _digest(plane.tools()) == before, "the published mirror changed"
