"""The settings that steer how a run executes, enforced end to end through the HTTP API
with real Terraform: `executor_pool` (the pool its phases are dispatched to),
`terraform_binary` (the binary its steps run) and `speculative_plans` (plan-only runs
that bypass the workspace queue and take no state lock)."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import nats.js.errors
import pytest

from executor import terraform as tf
from executor.binary import find_as_job
from infra import streams
from services.root.cli import options, parser
from tests.builders import api_workspace
from tests.helpers import eventually, shared_file
from tests.plane_support import (  # noqa: F401  # registers the fixtures
    Plane,
    commit,
    plane_fixture,
)

pytestmark = pytest.mark.terraform

ORG = "/api/v1/orgs/acme"
TWO = """
resource "null_resource" "a" {}
resource "null_resource" "b" {}
"""


async def _patch(plane: Plane, path: str, body: dict[str, Any]) -> None:
    a = await plane.http.call("PATCH", ORG + path, json=body)
    assert a.status == 200, a.body


async def _shown(plane: Plane, path: str) -> dict[str, Any]:
    """GET from a read model that holds every event appended so far."""
    seq = str(await plane.app.store.last_seq())
    a = await plane.http.get(ORG + path, headers={"RP-Min-Seq": seq})
    assert a.status == 200, a.body
    return a.body  # type: ignore[no-any-return]  # JSON object


async def _waiting_on(plane: Plane, pool: str) -> int:
    """How many dispatched phases wait on the pool's work queue."""
    js = plane.nc.jetstream()
    info = await js.stream_info(streams.DISPATCH, subjects_filter=streams.pool_subjects(pool))
    return sum((info.state.subjects or {}).values())


# ---------------------------------------------------------------- executor_pool


async def test_a_run_waits_for_an_executor_of_its_workspace_pool_and_that_one_runs_it(
    plane: Plane, repo: Path
) -> None:
    """A workspace whose folder sets `executor_pool: gpu`: its run is dispatched to
    rp.dispatch.gpu and stays queued while only default-pool executors run (they keep
    running other workspaces' runs); an executor of pool gpu then runs it."""
    commit(repo, {"main.tf": TWO})
    assert (await plane.http.post(ORG + "/folders", json={"name": "ml"})).status == 201
    await api_workspace(plane.http, repo, "train", folder="ml")
    await api_workspace(plane.http, repo, "web")
    await _patch(plane, "/folders/ml/settings", {"executor_pool": "gpu"})
    await plane.executor("e-default")

    gpu_run = await plane.start("train", "plan")
    await plane.reaches("train", gpu_run, "queued")
    await eventually(lambda: _waiting_on(plane, "gpu"), timeout=10, what="the gpu dispatch")
    # The default pool is served meanwhile, and its executor never takes the gpu phase.
    web_run = await plane.start("web", "plan")
    done = await plane.reaches("web", web_run, "planned", "failed")
    assert done.status == "planned", done.error_message
    assert done.executor_id == "e-default"
    assert str((await plane.run("train", gpu_run)).status) == "queued"
    assert await _waiting_on(plane, "gpu") == 1
    shown = await _shown(plane, f"/runs/{gpu_run}")
    assert shown["status"] == "queued"
    assert shown["snapshot"]["settings"]["executor_pool"] == {
        "value": "gpu",
        "origin": "folder:ml",
    }

    await plane.executor("e-gpu", pool="gpu")
    planned = await plane.reaches("train", gpu_run, "planned", "failed")
    assert planned.status == "planned", planned.error_message
    assert planned.executor_id == "e-gpu"
    assert await _waiting_on(plane, "gpu") == 0


async def test_a_run_of_a_pool_with_no_executor_fails_after_its_dispatch_timeout(
    plane: Plane, repo: Path
) -> None:
    commit(repo, {"main.tf": TWO})
    await plane.stack.enter_async_context(plane.system.reaper(interval=0.1))
    await api_workspace(plane.http, repo)
    await _patch(plane, "/settings", {"executor_pool": "gpu", "dispatch_timeout": 1})
    await plane.executor("e-default")  # the wrong pool
    run_id = await plane.start("net", "plan")
    failed = await plane.reaches("net", run_id, "failed")
    assert failed.reason == "executor_unavailable"
    assert failed.executor_id == ""


def test_runplane_executor_takes_its_pool_from_the_command_line() -> None:
    ns = parser().parse_args(["executor", "--nats-url", "nats://x:4222", "--pool", "gpu"])
    assert options(ns).pool == "gpu"


# ---------------------------------------------------------------- terraform_binary


def _wrapper(directory: Path, marker: Path, name: str = "terraform-wrapper") -> Path:
    """A script that records its arguments, then execs the real Terraform."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / name
    shared_file(marker)
    script.write_text(f'#!/bin/sh\necho "$*" >> "{marker}"\nexec "{tf.default_binary()}" "$@"\n')
    script.chmod(0o755)
    return script


async def test_a_terraform_binary_set_on_a_folder_runs_every_step_of_both_phases(
    plane: Plane, repo: Path, tmp_path: Path
) -> None:
    commit(repo, {"main.tf": TWO})
    marker = tmp_path / "called"
    script = _wrapper(tmp_path / "bin", marker)
    assert (await plane.http.post(ORG + "/folders", json={"name": "platform"})).status == 201
    await api_workspace(plane.http, repo, folder="platform")
    await _patch(plane, "/folders/platform/settings", {"terraform_binary": str(script)})
    await plane.executor("e1")
    run_id = await plane.start("net")
    await plane.reaches("net", run_id, "awaiting_approval")
    await plane.approve(run_id)
    done = await plane.reaches("net", run_id, "applied", "failed")
    assert done.status == "applied", done.error_message
    commands = [line.split()[0] for line in marker.read_text().splitlines()]
    # the apply is warm (one executor): it runs in the plan's own initialized directory
    assert commands == ["init", "plan", "show", "apply"]
    shown = await _shown(plane, f"/runs/{run_id}")
    assert shown["snapshot"]["settings"]["terraform_binary"] == {
        "value": str(script),
        "origin": "folder:platform",
    }


async def test_a_terraform_binary_named_on_the_org_is_looked_up_on_path(
    plane: Plane, repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    commit(repo, {"main.tf": TWO})
    marker = tmp_path / "called"
    bindir = tmp_path / "bin"
    _wrapper(bindir, marker, name="tofu-like")
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    await api_workspace(plane.http, repo)
    await _patch(plane, "/settings", {"terraform_binary": "tofu-like"})
    await plane.executor("e1")
    run_id = await plane.start("net", "plan")
    done = await plane.reaches("net", run_id, "planned", "failed")
    assert done.status == "planned", done.error_message
    assert marker.read_text().split()[0] == "init"


@pytest.mark.parametrize("wanted", ["rp-no-such-terraform", "/nonexistent/bin/terraform"])
async def test_a_missing_terraform_binary_fails_the_run_with_a_clear_reason(
    plane: Plane, repo: Path, wanted: str
) -> None:
    commit(repo, {"main.tf": TWO})
    await api_workspace(plane.http, repo)
    await _patch(plane, "/settings", {"terraform_binary": wanted})
    await plane.executor("e1")
    run_id = await plane.start("net")
    failed = await plane.reaches("net", run_id, "failed")
    assert failed.reason == "terraform_binary_not_found"
    assert wanted in failed.error_message and "(from org)" in failed.error_message
    assert "Traceback" not in failed.error_message
    steps = (await _shown(plane, f"/runs/{run_id}/steps"))["items"]
    assert [(s["step"], s["status"]) for s in steps] == [("checkout", "ok"), ("init", "failed")]
    assert wanted in steps[1]["error"]
    # The workspace is free again: a run with the setting unset goes through.
    await _patch(plane, "/settings", {"terraform_binary": None})
    again = await plane.start("net", "plan")
    done = await plane.reaches("net", again, "planned", "failed")
    assert done.status == "planned", done.error_message


async def test_a_terraform_binary_setting_tells_nothing_of_paths_the_job_cannot_read(
    plane: Plane, repo: Path, tmp_path: Path
) -> None:
    """Attack F7 (issue 23): an organization's admin names, as its `terraform_binary`, a
    file in a directory no job may read, a path that does not exist, the data directory
    and a file the job may read but not run. The executor resolved them
    as root, and the run's error said which existed (`does not exist`, `is not a file`,
    `is not executable`). Now they are looked up as the job, and every one fails with the
    same error, but for the name itself."""
    secret_dir = Path(f"/root/.rp-f7-{os.getpid()}")
    secret_dir.mkdir(mode=0o700, exist_ok=True)
    hidden = secret_dir / "terraform"
    hidden.write_text("#!/bin/sh\n")
    hidden.chmod(0o755)
    plain = tmp_path / "plain"
    shared_file(plain)
    commit(repo, {"main.tf": TWO})
    await api_workspace(plane.http, repo)
    await plane.executor("e1")
    said = set()
    try:
        for wanted in (
            str(hidden),
            "/nonexistent/terraform",
            str(plane.system.opts.data_dir),
            str(secret_dir),
            str(plain),
        ):
            await _patch(plane, "/settings", {"terraform_binary": wanted})
            run_id = await plane.start("net", "plan")
            failed = await plane.reaches("net", run_id, "failed")
            assert failed.reason == "terraform_binary_not_found", failed.error_message
            assert wanted in failed.error_message
            said.add(failed.error_message.replace(repr(wanted), "<name>"))
    finally:
        hidden.unlink()
        secret_dir.rmdir()
    assert len(said) == 1, said


# ---------------------------------------------------------------- speculative_plans

# `b` is applied only once the test creates the file named in its provisioner, so the
# apply holds the workspace's state lock for as long as the test needs.
GATED = """
resource "null_resource" "a" {}
resource "null_resource" "b" {
  provisioner "local-exec" {
    command = "while [ ! -f '%s' ]; do sleep 0.1; done"
  }
}
"""


async def test_a_speculative_plan_runs_beside_an_apply_that_holds_the_workspace(
    plane: Plane, repo: Path, tmp_path: Path
) -> None:
    """With `speculative_plans` on: an apply awaiting approval holds the workspace, and a
    plan run on it is admitted at once, planned meanwhile, never queued on the workspace;
    it plans again while the apply holds the state lock (-lock=false); the apply is
    unaffected."""
    gate = tmp_path / "gate"
    commit(repo, {"main.tf": GATED % gate})
    marker = tmp_path / "called"
    await api_workspace(plane.http, repo)
    await _patch(
        plane,
        "/settings",
        {"speculative_plans": True, "terraform_binary": str(_wrapper(tmp_path / "b", marker))},
    )
    await plane.executor("e1")
    await plane.executor("e2")
    apply_id = await plane.start("net")
    await plane.reaches("net", apply_id, "awaiting_approval")

    spec = await plane.start("net", "plan")
    planned = await plane.reaches("net", spec, "planned", "failed")
    assert planned.status == "planned", planned.error_message
    assert planned.speculative and planned.plan_summary is not None
    assert planned.plan_summary.add == 2
    assert str((await plane.run("net", apply_id)).status) == "awaiting_approval"
    ws = await _shown(plane, "/workspaces/net")
    assert ws["active_run"] == apply_id and ws["queue"] == []
    shown = await _shown(plane, f"/runs/{spec}")
    assert shown["speculative"] is True and shown["status"] == "planned"
    assert (await _shown(plane, f"/runs/{apply_id}"))["speculative"] is False
    ws_events = await plane.app.store.read("rp.ws.acme.net")
    assert spec not in str([e.event for e in ws_events])  # never enqueued, never released

    # While the apply runs (and holds the state lock) a second one plans all the same.
    await plane.approve(apply_id)
    await plane.reaches("net", apply_id, "applying")
    await eventually(lambda: _state_locked(plane), timeout=30, what="the apply's state lock")
    second = await plane.start("net", "plan")
    again = await plane.reaches("net", second, "planned", "no_changes", "failed")
    assert again.status in ("planned", "no_changes"), again.error_message
    assert str((await plane.run("net", apply_id)).status) == "applying"
    gate.write_text("go")
    applied = await plane.reaches("net", apply_id, "applied", "failed")
    assert applied.status == "applied", applied.error_message
    assert applied.apply_summary is not None and applied.apply_summary.add == 2

    plans = [line for line in marker.read_text().splitlines() if line.startswith("plan ")]
    assert len(plans) == 3  # the apply's own plan, then the two speculative ones
    assert ["-lock=false" in p.split() for p in plans] == [False, True, True]


async def _state_locked(plane: Plane) -> bool:
    kv = await plane.nc.jetstream().key_value("rp-state-locks")
    try:
        return bool(await kv.get("acme.net"))
    except nats.js.errors.KeyNotFoundError:  # not locked yet
        return False


async def test_a_speculative_plan_runs_on_a_locked_workspace(plane: Plane, repo: Path) -> None:
    """A lock stops admission from the queue; a speculative plan changes nothing and is
    not in the queue, so it runs."""
    commit(repo, {"main.tf": TWO})
    await api_workspace(plane.http, repo)
    await _patch(plane, "/workspaces/net/settings", {"speculative_plans": True})
    a = await plane.http.post(ORG + "/workspaces/net/lock", json={"reason": "freeze"})
    assert a.status == 200, a.body
    await plane.executor("e1")
    held = await plane.start("net")  # an apply: it waits for the unlock
    spec = await plane.start("net", "plan")
    planned = await plane.reaches("net", spec, "planned", "failed")
    assert planned.status == "planned", planned.error_message
    assert str((await plane.run("net", held)).status) == "pending"


async def test_with_speculative_plans_off_a_plan_queues_behind_the_apply(
    plane: Plane, repo: Path
) -> None:
    commit(repo, {"main.tf": TWO})
    await api_workspace(plane.http, repo)
    await plane.executor("e1")
    apply_id = await plane.start("net")
    await plane.reaches("net", apply_id, "awaiting_approval")
    plan_id = await plane.start("net", "plan")
    ws = await _shown(plane, "/workspaces/net")
    assert ws["active_run"] == apply_id and ws["queue"] == [plan_id]
    pending = await plane.run("net", plan_id)
    assert str(pending.status) == "pending" and not pending.speculative
    a = await plane.http.post(f"{ORG}/runs/{apply_id}/discard", json={})
    assert a.status == 200, a.body
    planned = await plane.reaches("net", plan_id, "planned", "failed")
    assert planned.status == "planned", planned.error_message


def test_a_speculative_plan_takes_no_state_lock() -> None:
    assert "-lock=false" not in tf.plan_args("plan")
    assert "-lock=false" in tf.plan_args("plan", lock=False)


async def test_a_deployment_list_of_binaries_takes_only_those(tmp_path: Path) -> None:
    """`--terraform-binaries`: a name not listed is refused without a look (the same
    None as a missing one); a listed one is found as the job finds it."""
    script = _wrapper(tmp_path / "bin", tmp_path / "m")
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"}
    find = functools.partial(find_as_job, jail=None, env=env, cwd=tmp_path)
    assert await find(str(script), allowed=("terraform-wrapper",)) is None
    assert await find("terraform-wrapper", allowed=("terraform-wrapper",)) == script
    assert await find(str(script), allowed=()) == script
    assert await find("bin/terraform-wrapper", allowed=()) is None
