"""runplane-managed state through Terraform's http backend, and the sealed saved plan.

Real nats-server, real Terraform, executors in this process and as `runplane executor`
processes: state versions live sealed in the object store, the head and the lock in KV,
and nothing is shared between executors but NATS.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from events.run import FailRun, PhaseStarted, StateVersionCreated, Workspace
from executor import statebackend
from executor.statestore import StateStore, StateStoreError
from executor.worker import default_jobs_dir
from infra.crypto import KeyRing, encode_key
from infra.natsserver import EmbeddedNats
from infra.streams import PLANS_BUCKET, STATE_BUCKET
from services.app.commands import App
from tests.builders import api_workspace
from tests.helpers import eventually
from tests.lock_support import backends
from tests.plane_support import (  # noqa: F401  # registers the fixtures
    Plane,
    commit,
    plane_fixture,
)
from tests.procs import Proc
from tests.state_support import current_state, opened_plan, sealed_object

pytestmark = pytest.mark.terraform

COUNTED_TF = """
variable "n" { default = "N" }
resource "null_resource" "hello" {
  count    = tonumber(var.n)
  triggers = { index = count.index }
}
"""


def counted(n: int) -> dict[str, str]:
    return {"main.tf": COUNTED_TF.replace('"N"', f'"{n}"')}


async def _apply(plane: Plane, ws: str = "net") -> str:
    run_id = await plane.start(ws)
    await plane.reaches(ws, run_id, "awaiting_approval")
    await plane.approve(run_id)
    await plane.reaches(ws, run_id, "applied")
    return run_id


async def test_the_plan_is_sealed_and_a_flipped_byte_stops_the_apply(
    plane: Plane, repo: Path
) -> None:
    """The stored plan is no zip (no `PK`), opens to the recorded digest; one flipped byte
    and the apply fails with plan_digest_mismatch, nothing applied."""
    commit(repo, counted(2))
    await api_workspace(plane.http, repo)
    await plane.executor("ex1")
    run_id = await plane.start("net")
    planned = await plane.reaches("net", run_id, "awaiting_approval")
    sealed = await sealed_object(plane.nc, PLANS_BUCKET, planned.plan_object)
    assert not sealed.startswith(b"PK") and b"null_resource" not in sealed
    clear = await opened_plan(plane.nc, plane.keyring, planned.plan_object)
    assert clear.startswith(b"PK") and hashlib.sha256(clear).hexdigest() == planned.plan_digest

    flipped = bytearray(sealed)
    flipped[len(flipped) // 2] ^= 0x01
    store = await plane.nc.jetstream().object_store(PLANS_BUCKET)
    await store.put(planned.plan_object, bytes(flipped))
    await plane.approve(run_id)
    failed = await plane.reaches("net", run_id, "failed")
    assert failed.reason == "plan_digest_mismatch"
    assert "failed authentication" in failed.error_message
    assert await current_state(plane.nc, plane.keyring, "acme", "net") is None


async def test_a_state_changed_after_the_plan_makes_terraform_refuse_it(
    plane: Plane, repo: Path
) -> None:
    """A state version written out of band after the plan: the apply fails with
    Terraform's own 'Saved plan is stale'."""
    commit(repo, counted(1))
    await api_workspace(plane.http, repo)
    await plane.executor("ex1")
    await _apply(plane)
    commit(repo, counted(2))
    run_id = await plane.start("net")
    await plane.reaches("net", run_id, "awaiting_approval")

    store = StateStore(plane.nc.jetstream(), plane.keyring)
    head, revision = await store.head("acme", "net")
    assert head is not None
    state = json.loads(await store.read(head))
    state["serial"] += 1
    newer = await store.put_version("acme", "net", json.dumps(state).encode(), "out-of-band")
    await store.move_head("acme", "net", newer, revision)

    await plane.approve(run_id)
    failed = await plane.reaches("net", run_id, "failed")
    assert failed.reason == "apply_failed"
    assert "Saved plan is stale" in failed.error_message


async def test_state_is_carried_to_another_executor_process_and_listed(
    plane: Plane, repo: Path, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    """Run 1 applied by one `runplane executor`, run 2 on another (other data dir): it
    sees the existing resources (2 -> 3 adds 1). Versions list newest first, serials
    rising, sealed in the object store; another org cannot see them."""
    env = {"RUNPLANE_ENCRYPTION_KEY": encode_key(plane.keyring.current)}
    commit(repo, counted(2))
    await api_workspace(plane.http, repo)
    first = await _executor_process(nats_server, tmp_path / "a", env)
    try:
        run1 = await _apply(plane)
    finally:
        assert await first.stop() == 0, first.output()[-3000:]
    commit(repo, counted(3))
    second = await _executor_process(nats_server, tmp_path / "b", env)
    try:
        run2 = await plane.start("net")
        planned = await plane.reaches("net", run2, "awaiting_approval")
        assert planned.plan_summary is not None
        assert (planned.plan_summary.add, planned.plan_summary.destroy) == (1, 0)
        await plane.approve(run2)
        await plane.reaches("net", run2, "applied")
    finally:
        assert await second.stop() == 0, second.output()[-3000:]
    assert await _executor_of(plane, run1) != await _executor_of(plane, run2)
    state = await current_state(plane.nc, plane.keyring, "acme", "net")
    assert state is not None and len(state["resources"][0]["instances"]) == 3
    jobs = [default_jobs_dir(tmp_path / d / "work") / "jobs" for d in ("a", "b")]
    assert not [p for d in jobs if d.exists() for p in d.iterdir()]  # the last one out removes it

    versions = await _state_versions(plane, run2)
    assert [v["run_id"] for v in versions] == [run2, run1]
    assert versions[0]["serial"] > versions[1]["serial"]
    assert versions[0]["object"] == f"acme/net/{versions[0]['serial']}-{versions[0]['digest'][:16]}"
    sealed = await sealed_object(plane.nc, STATE_BUCKET, versions[0]["object"])
    assert b"lineage" not in sealed and b"null_resource" not in sealed
    beta = await plane.http.org("beta")
    a = await plane.http.get("/api/v1/orgs/acme/workspaces/net/state-versions", token=beta["admin"])
    a.problem("not-found", 404)


async def _executor_process(nats: EmbeddedNats, data: Path, env: dict[str, str]) -> Proc:
    args = ["executor", "--nats-url", nats.url, "--data-dir", str(data)]
    data.mkdir(parents=True, exist_ok=True)
    proc = await Proc(args, data.parent / f"{data.name}.log", env).start()
    await eventually(
        lambda: _said(proc, "executor_ready"), timeout=60, what=f"executor {data.name} ready"
    )
    return proc


async def _said(proc: Proc, what: str) -> bool:
    assert proc.proc is not None and proc.proc.returncode is None, proc.output()[-2000:]
    return what in proc.output()


async def _executor_of(plane: Plane, run_id: str) -> set[str]:
    events = await plane.events("net", run_id)
    return {e.executor_id for e in events if isinstance(e, PhaseStarted)}


async def _state_versions(plane: Plane, last_run: str) -> list[dict[str, Any]]:
    async def listed() -> list[dict[str, Any]]:
        a = await plane.http.get("/api/v1/orgs/acme/workspaces/net/state-versions")
        assert a.status == 200, a.body
        assert a.body["items"] and a.body["items"][0]["run_id"] == last_run
        return a.body["items"]  # type: ignore[no-any-return]  # JSON list

    return await eventually(listed, what="the state versions projected")


async def test_a_workspace_may_bring_its_own_backend(
    plane: Plane, repo: Path, tmp_path: Path
) -> None:
    """managed_state false: no override, the configuration's backend keeps the state,
    runplane records no version."""
    own = tmp_path / "own" / "terraform.tfstate"
    backend = f'terraform {{\n  backend "local" {{ path = "{own}" }}\n}}\n'
    commit(repo, {**counted(1), "backend.tf": backend})
    await api_workspace(plane.http, repo, managed_state=False)
    await plane.executor("ex1")
    run_id = await _apply(plane)
    assert json.loads(own.read_text())["resources"][0]["type"] == "null_resource"
    assert await current_state(plane.nc, plane.keyring, "acme", "net") is None
    events = await plane.events("net", run_id)
    assert not [e for e in events if isinstance(e, StateVersionCreated)]


# ---------------------------------------------------------------- the lock, over HTTP


async def test_a_second_locker_gets_423_with_the_holders_info_until_the_holder_ends(
    nc: NATS, app: App
) -> None:
    """LOCK is exclusive (423 and the holder's lock info, without its ID); only the
    holder may write or unlock; once the holder's run has ended, its lock is dead and is
    broken."""
    await app.create_org("acme", "alice")
    await app.create_workspace("acme", "net", Workspace(repository="/nowhere"), "alice")
    async with backends(nc, app, KeyRing.generate()) as (a, b):
        assert (await a.call("LOCK", {"ID": "lock-a", "Who": "alice@a"})).status == 200
        held = await b.call("LOCK", {"ID": "lock-b", "Who": "bob@b"})
        assert held.status == 423
        info = json.loads(held.body)
        assert info["Who"] == "alice@a" and "ID" not in info  # the ID is the holder's key
        assert a.job.run_id in info["Info"]
        assert (await b.call("UNLOCK", {"ID": "lock-b"})).status == 423
        assert (await b.post({"serial": 1, "lineage": "l"}, "lock-b")).status == 409
        assert (await a.call("LOCK", {"ID": "x"}, password="wrong")).status == 401

        written = await a.post({"version": 4, "serial": 1, "lineage": "l"}, "lock-a")
        assert written.status == 200, written.body
        assert json.loads((await a.call("GET", None)).body)["serial"] == 1
        envs = await app.store.read(f"rp.run.acme.net.{a.job.run_id}")
        events = [e.event for e in envs]
        assert [e.serial for e in events if isinstance(e, StateVersionCreated)] == [1]

        reap = FailRun(actor="scheduler", reason="executor_unavailable")
        await app.run_command("acme", "net", a.job.run_id, reap)
        assert (await b.call("LOCK", {"ID": "lock-b", "Who": "bob@b"})).status == 200
        assert (await a.post({"serial": 2, "lineage": "l"}, "lock-a")).status == 409


async def test_a_version_recorded_but_not_yet_the_head_is_promoted_by_the_next_reader(
    plane: Plane, repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The executor records a state version on its run, then moves the head. Dying in
    between (simulated: moving the head fails once) must not leave the next plan on the
    older state: the version is pending, and the next reader promotes it because its run
    recorded it. The next plan of the same configuration then finds nothing to change."""
    await plane.executor("exec-a")
    commit(repo, counted(2))
    await api_workspace(plane.http, repo)
    await _apply(plane)
    real_move = StateStore.move_head
    crashed: list[str] = []

    async def crashing(self: StateStore, org: str, ws: str, head: Any, last: int) -> int:
        if run2_open:  # every attempt of run 2's executor "dies" right there
            crashed.append(head.object)
            raise StateStoreError("simulated crash between recording and moving the head")
        return await real_move(self, org, ws, head, last)

    run2_open = True
    monkeypatch.setattr(StateStore, "move_head", crashing)
    # Terraform retries each refused push (TF_HTTP_RETRY_*): the shortest waits it takes
    monkeypatch.setattr(statebackend, "RETRY_WAIT_MIN_S", 1)
    monkeypatch.setattr(statebackend, "RETRY_WAIT_MAX_S", 1)
    commit(repo, counted(3))
    run2 = await plane.start("net")
    await plane.reaches("net", run2, "awaiting_approval")
    await plane.approve(run2)
    await plane.reaches("net", run2, "applied", "failed")
    run2_open = False
    recorded = [e for e in await plane.events("net", run2) if isinstance(e, StateVersionCreated)]
    assert crashed and crashed[0] in {e.object for e in recorded}

    run3 = await plane.start("net")
    done = await plane.reaches("net", run3, "no_changes", "awaiting_approval", "failed")
    assert done.status == "no_changes", done
    state = await current_state(plane.nc, plane.keyring, "acme", "net")
    assert state is not None and len(state["resources"][0]["instances"]) == 3
