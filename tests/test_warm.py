"""Warm applies (issue 26, item 1): the apply runs in the plan's own checkout and
`.terraform` on the executor that planned (no second clone and init), else cold anywhere.

Real nats-server, real Terraform, real executors (user isolation, the harness's default).
On main every apply ran `checkout` and `init` again: the first test fails there; the
others pin the fallbacks and what a hostile plan cannot do through the kept checkout."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from events import run as R
from executor import Executor
from executor.terraform import TerraformConfig, default_binary
from executor.warm import WarmSettings, manifest
from executor.worker import default_jobs_dir
from infra.natsserver import EmbeddedNats
from tests import bootstrap_support
from tests.builders import api_workspace
from tests.executor_support import GATED_PLAN_TF, MAIN_TF, git
from tests.helpers import eventually
from tests.plane_support import (  # noqa: F401  # registers the fixtures
    Plane,
    commit,
    plane_fixture,
)
from tests.procs import Proc
from tests.stop_support import at_the_gate

pytestmark = pytest.mark.terraform

# Terraform as a hostile tenant's provider would make it behave, as the job: a plan of a
# repository holding `hostile` leaves a set-uid file, a world-writable directory and a
# daemon that writes into the checkout (and into every kept checkout it can find) once
# the test pulls the trigger; an apply that finds what such a daemon writes fails.
HOSTILE_TF = """#!/bin/sh
if [ "$1" = plan ] && [ -e hostile ]; then
  "$RP_TEST_REAL_TF" "$@"; code=$?
  echo planted > planted.txt
  cp /bin/true suid-true && chmod 4755 suid-true
  mkdir -p open && chmod 0777 open
  (
    while [ ! -e "$RP_TEST_TRIGGER" ]; do sleep 0.05; done
    echo late > late.txt; echo late > open/late.txt
    for d in /tmp/runplane-*/warm/*/*/src; do echo a > "$d/planted-by-a"; done
  ) </dev/null >/dev/null 2>&1 &
  echo $! > daemon.pid
  exit $code
fi
if [ "$1" = apply ]; then
  for f in late.txt open/late.txt planted-by-a; do
    if [ -e "$f" ]; then echo "found $f" >&2; exit 3; fi
  done
fi
exec "$RP_TEST_REAL_TF" "$@"
"""


def _executor(plane: Plane, name: str, **knobs: Any) -> Executor:
    return bootstrap_support.executor(
        plane.system, work_dir=plane.root / name, executor_id=name, **knobs
    )


@asynccontextmanager
async def _running(plane: Plane, name: str, **knobs: Any) -> AsyncIterator[Executor]:
    async with _executor(plane, name, **knobs) as ex:
        yield ex


async def _apply_steps(plane: Plane, run_id: str, org: str = "acme") -> tuple[str, list[str]]:
    """(the executor that claimed the apply, the apply's steps in order)."""
    events = await plane.events("net", run_id, org)
    [claim] = [e for e in events if isinstance(e, R.PhaseStarted) and e.phase == "apply"]
    steps = [e for e in events if isinstance(e, R.StepFinished) and e.lease_id == claim.lease_id]
    assert all(s.ok for s in steps), [(s.step, s.error) for s in steps]
    return claim.executor_id, [s.step for s in steps]


async def _gone(paths: list[Path]) -> bool:
    async def gone() -> bool:
        assert not [p for p in paths if p.exists()], paths
        return True

    return await eventually(gone, timeout=30, what="nothing kept")


async def _kept(ex: Executor, run_id: str) -> Path:
    src = ex.warm.dir / run_id / "src"

    async def kept() -> Path:
        assert run_id in ex.warm.kept and src.is_dir()
        return src

    return await eventually(kept, timeout=30, what="the plan's checkout kept")


async def test_the_apply_runs_warm_in_the_plans_checkout_on_the_executor_that_planned(
    plane: Plane, repo: Path
) -> None:
    """One executor plans and applies: the apply's steps are `warm` and `apply` (no
    checkout, no init), the resources are created, and once the run ended nothing of
    it is kept."""
    commit(repo, {"main.tf": MAIN_TF})
    await api_workspace(plane.http, repo)
    async with _running(plane, "e1") as ex:
        run_id = await plane.start("net")
        await plane.reaches("net", run_id, "awaiting_approval")
        await _kept(ex, run_id)
        await plane.approve(run_id)
        await plane.reaches("net", run_id, "applied")
        assert await _apply_steps(plane, run_id) == ("e1", ["warm", "apply"])
        events = await plane.events("net", run_id)
        assert [e for e in events if isinstance(e, R.StateVersionCreated)]
        assert run_id not in ex.warm.kept
        await _gone([ex.warm.dir / run_id])
    assert not ex.warm.dir.exists()  # the store goes with the executor


async def test_a_busy_planner_leaves_the_apply_to_another_executor_cold_after_the_wait(
    plane: Plane, repo: Path, tmp_path: Path
) -> None:
    """The planner is busy (a plan held at a gate) when the apply is approved: another
    executor waits `warm_wait`, then claims the apply and runs it cold (checkout, init,
    apply) and well. The planner's kept checkout goes when it stops."""
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    writer = os.open(gate, os.O_RDWR)
    commit(repo, {"main.tf": MAIN_TF})
    await api_workspace(plane.http, repo)
    gated = tmp_path / "gated-repo"
    gated.mkdir()
    git(gated, "init", "-q", "-b", "main")
    commit(gated, {"main.tf": GATED_PLAN_TF})
    await api_workspace(plane.http, gated, name="other", variables={"gate": str(gate)})
    try:
        async with _running(plane, "e1", warm=WarmSettings(wait=1.0)) as e1:
            run_id = await plane.start("net")
            await plane.reaches("net", run_id, "awaiting_approval")
            await _kept(e1, run_id)
            held = await plane.start("other", run_type="plan")
            await plane.reaches("other", held, "planning")
            await eventually(lambda: at_the_gate(gate), timeout=60, what="e1 at the gate")
            async with _running(plane, "e2", warm=WarmSettings(wait=1.0)):
                await plane.approve(run_id)
                await plane.reaches("net", run_id, "applied")
            assert await _apply_steps(plane, run_id) == ("e2", ["checkout", "init", "apply"])
            os.close(writer)
            gate.unlink()
            gate.write_text("open")
            await plane.reaches("other", held, "planned", "no_changes")
        assert not e1.warm.dir.exists()
    finally:
        if gate.is_fifo():
            os.close(writer)


async def test_a_killed_planner_leaves_the_apply_cold_elsewhere_and_its_restart_removes_the_kept(
    plane: Plane, repo: Path, nats_server: EmbeddedNats
) -> None:
    """The planner (a real `runplane executor`) is killed (-9) between plan and apply:
    another executor applies cold after the wait, never anything the dead one kept; the
    dead one's next start on its work directory removes what it kept."""
    commit(repo, {"main.tf": MAIN_TF})
    await api_workspace(plane.http, repo)
    first: Proc | None = await executor_proc(plane, nats_server, "e1")
    assert first is not None
    try:
        run_id = await plane.start("net")
        await plane.reaches("net", run_id, "awaiting_approval")
        store = default_jobs_dir(plane.root / "e1" / "work") / "warm"

        async def kept() -> bool:
            assert list(store.glob(f"*/{run_id}/src"))
            return True

        await eventually(kept, timeout=30, what="e1 keeps the plan's checkout")
        await first.stop(signal.SIGKILL)
        first = None
        async with _running(plane, "e2"):
            await plane.approve(run_id)
            await plane.reaches("net", run_id, "applied")
        assert await _apply_steps(plane, run_id) == ("e2", ["checkout", "init", "apply"])
        left = list(store.glob(f"*/{run_id}"))
        assert left  # the dead one's, until its next start
        first = await _restart(plane, nats_server, "e1")
        await _gone(left)
    finally:
        if first is not None:
            await first.stop(signal.SIGKILL)


async def executor_proc(plane: Plane, server: EmbeddedNats, name: str) -> Proc:
    """A `runplane executor` of the plane's deployment (its key: the plane's key file)."""
    data = plane.root / name
    data.mkdir(mode=0o700)
    shutil.copy(plane.system.opts.data_dir / "encryption.key", data / "encryption.key")
    os.chmod(data / "encryption.key", 0o600)
    return await _restart(plane, server, name)


async def _restart(plane: Plane, server: EmbeddedNats, name: str) -> Proc:
    """`runplane executor` (again) on its data directory."""
    args = ["executor", "--nats-url", server.url, "--data-dir", str(plane.root / name)]
    env = {"RUNPLANE_ENCRYPTION_KEY": ""}
    logs = plane.root / f"{name}.log"
    return await Proc(args, logs.with_suffix(".again.log") if logs.exists() else logs, env).start()


def _hostile_terraform(tmp_path: Path, shared: Path) -> tuple[TerraformConfig, Path]:
    wrapper = tmp_path / "terraform"
    wrapper.write_text(HOSTILE_TF)
    wrapper.chmod(0o755)
    trigger = shared / "trigger"
    env = {"RP_TEST_REAL_TF": str(default_binary()), "RP_TEST_TRIGGER": str(trigger)}
    return TerraformConfig(binary=wrapper, extra_env=env), trigger


def _state(pid: int) -> str:
    """A process's state letter, "" if it is gone (a zombie, "Z", runs nothing)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return ""
    line = next((x for x in status.splitlines() if x.startswith("State:")), "State:\t?")
    return line.split()[1]


def _assert_executors_alone(src: Path) -> None:
    """Every entry the executor's, nothing set-id, nothing writable by another uid."""
    for here, dirs, files in os.walk(src):
        for name in (".", *dirs, *files):
            st = os.lstat(Path(here) / name)
            assert st.st_uid == os.geteuid(), (here, name, st.st_uid)
            if not stat.S_ISLNK(st.st_mode):
                assert not st.st_mode & (stat.S_ISUID | stat.S_ISGID | 0o022), (here, name)


async def test_a_hostile_plan_cannot_change_its_own_apply_nor_another_orgs_through_the_kept(
    plane: Plane, repo: Path, tmp_path: Path
) -> None:
    """Org acme's plan leaves a set-uid file, a world-writable directory and a daemon
    that, once triggered, writes into its checkout and into any kept checkout it finds.
    Once the plan ended the daemon is dead, its kept checkout is the executor's alone
    (no set-id bit, nothing writable by others) and stays as it was: acme's apply (warm)
    finds nothing the daemon would have written. Org beta's run on the same executor,
    planned after it and applied first, meets nothing of acme's."""
    shared = Path(tempfile.mkdtemp())  # the job crosses to it: not under pytest's 0700
    os.chmod(shared, 0o755)
    terraform, trigger = _hostile_terraform(tmp_path, shared)
    commit(repo, {"main.tf": MAIN_TF, "hostile": "yes\n"})
    other_repo = tmp_path / "beta-repo"
    other_repo.mkdir()
    git(other_repo, "init", "-q", "-b", "main")
    commit(other_repo, {"main.tf": MAIN_TF})
    assert (await plane.http.post("/api/v1/orgs", json={"name": "beta"})).status == 201
    await api_workspace(plane.http, repo)
    await api_workspace(plane.http, other_repo, org="beta")
    async with _running(plane, "e1", terraform=terraform) as ex:
        a = await plane.start("net")
        await plane.reaches("net", a, "awaiting_approval")
        src = await _kept(ex, a)
        pid = int((src / "daemon.pid").read_text())
        assert _state(pid) in ("", "Z"), f"the plan's daemon outlived its phase: {_state(pid)}"
        _assert_executors_alone(src)
        b = await plane.start("net", org="beta")
        await plane.reaches("net", b, "awaiting_approval", org="beta")
        await _kept(ex, b)
        trigger.write_text("go")
        assert ex.warm.kept[a].manifest == manifest(src)  # nothing wrote to it
        await plane.approve(b, org="beta")
        await plane.reaches("net", b, "applied", org="beta")
        assert await _apply_steps(plane, b, "beta") == ("e1", ["warm", "apply"])
        await plane.approve(a)
        await plane.reaches("net", a, "applied")
        assert await _apply_steps(plane, a) == ("e1", ["warm", "apply"])
    shutil.rmtree(shared)
