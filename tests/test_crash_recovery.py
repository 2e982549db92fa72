"""kill -9 of an executor mid-apply, then a restart on the same work directory.

The restarted executor tells the truth at once: the dead life's lease fails with
"executor restarted" (not after the 600 s heartbeat timeout) and the workspace moves on.
What the dead executor's Terraform applied is not lost: on its parent death signal (one
SIGTERM, `executor/spawn.py`) it tries the dead state backend for some seconds while
its provisioners finish, stops, and writes `errored.tfstate`, which the restart keeps and
records as a recovered state version; the next plan has nothing to do.

(Measured before: the executor's threads ending one after the other gave Terraform two
parent death signals in most kills, "Two interrupts received. Exiting immediately", and
no state was written; in the other kills Terraform's default retries (1 s, 2 s) stopped
the 4 s provisioners half way, and the recovered state had them tainted, to be replaced.)
"""

from __future__ import annotations

import json
import signal
import time
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from events import run as R
from executor import recovery
from executor.statestore import Head, StateStore
from infra.crypto import load_keyring
from infra.natsserver import EmbeddedNats
from services.app.commands import App
from tests.bootstrap_support import System
from tests.executor_support import commit
from tests.helpers import eventually
from tests.procs import Proc
from tests.reaper_support import KEY, ORG, count, reaches, run_events, setup_workspace, signal_tree

pytestmark = pytest.mark.terraform

# Three resources, each leaving a line in the marker; two take a few seconds, so the
# executor is killed while Terraform is still applying them.
CRASH_TF = """
variable "marker" {}
resource "null_resource" "r" {
  count = 3
  provisioner "local-exec" {
    command = "echo applied-${count.index} >> ${var.marker} && sleep ${count.index == 0 ? 0 : 4}"
  }
}
"""


def executor(nats: EmbeddedNats, tmp: Path, log: str) -> Proc:
    args = ["executor", "--nats-url", nats.url, "--data-dir", str(tmp / "exec")]
    return Proc(args, tmp / log, env={"RUNPLANE_ENCRYPTION_KEY": KEY})


async def ready(proc: Proc) -> bool:
    assert proc.proc is not None
    if proc.proc.returncode is not None:
        raise RuntimeError(f"exited {proc.proc.returncode}: {proc.output()[-2000:]}")
    return "runplane executor running" in proc.output()


async def test_a_restart_fails_the_dead_lives_lease_at_once_and_the_workspace_moves_on(
    nats_server: EmbeddedNats, nc: NATS, app: App, system: System, repo: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "applies"
    commit(repo, CRASH_TF)
    await setup_workspace(
        app, "net", repo, heartbeat_timeout=600, variables={"marker": str(marker)}
    )
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(system.scheduler())
        await stack.enter_async_context(system.reaper(interval=0.2))
        first = await executor(nats_server, tmp_path, "first.log").start()
        stack.callback(signal_tree, first, signal.SIGKILL)
        await eventually(lambda: ready(first), timeout=30, what="the executor")
        run_id = str((await app.create_run(ORG, "net", "apply", "alice")).state.run_id)
        await reaches(app, "net", run_id, "awaiting_approval", timeout=90)
        await app.run_command(ORG, "net", run_id, R.ApproveRun(actor="bob"))

        async def applying() -> bool:
            return marker.exists() and "applied-0" in marker.read_text()

        await eventually(applying, timeout=60, what="the apply under way")
        first.kill()  # kill -9 of the executor alone: its Terraform applies on
        assert first.proc is not None
        await first.proc.wait()

        restarted = time.monotonic()
        second = await executor(nats_server, tmp_path, "second.log").start()
        stack.callback(signal_tree, second, signal.SIGKILL)
        failed = await reaches(app, "net", run_id, "failed", timeout=30)
        elapsed = time.monotonic() - restarted
        print(f"restart -> failed: {elapsed:.2f}s (heartbeat timeout 600 s)")
        await eventually(lambda: ready(second), timeout=30, what="the restarted executor")

        plan = str((await app.create_run(ORG, "net", "plan", "alice")).state.run_id)
        planned = await ended(app, "net", plan)  # the workspace moved on

    assert failed.reason == "executor_unavailable"
    assert "executor restarted" in failed.error_message, failed.error_message
    assert elapsed < 20, elapsed
    events = await run_events(app, "net", run_id)
    [fail] = [e for e in events if isinstance(e, R.RunFailed)]
    assert fail.actor.startswith("executor:"), fail.actor  # not the reaper's timeout
    assert count(events, R.PhaseStarted, phase="apply") == 1
    # What Terraform applied after its executor died is the workspace's state now...
    [version] = [e for e in events if isinstance(e, R.StateVersionCreated)]
    assert version.recovered and version.lease_id == "", version
    assert "the workspace's state" in version.message, version.message
    doc = json.loads(
        await StateStore(nc.jetstream(), load_keyring(KEY, tmp_path)).read(
            Head(object=version.object, serial=version.serial, digest=version.digest)
        )
    )
    instances = [i for r in doc["resources"] for i in r["instances"]]
    assert sorted(i["index_key"] for i in instances) == [0, 1, 2], instances
    assert all(i.get("status") != "tainted" for i in instances), instances
    # ...so the next plan creates nothing again, and each resource was applied once.
    assert str(planned.status) == "no_changes", (planned.status, planned.plan_summary)
    lines = marker.read_text().split()
    assert sorted(lines) == ["applied-0", "applied-1", "applied-2"], lines


async def ended(app: App, ws: str, run_id: str) -> R.RunState:
    """The run once it is terminal (whichever way it ended)."""

    async def probe() -> R.RunState:
        run: R.RunState = (await app.load_run(ORG, ws, run_id)).state
        assert run.terminal, run.status
        return run

    return await eventually(probe, timeout=90, what=f"run {run_id} ended")


async def test_a_kept_state_is_recorded_once_as_recovered_and_becomes_the_head(
    nc: NATS, app: App, repo: Path, tmp_path: Path
) -> None:
    """A state left in `<work>/unsaved-state/` (as the backend keeps one it could not
    record) is recorded at the next start as a recovered version of its run, after that
    run ended, and moves the head; a second start records nothing again."""
    await setup_workspace(app, "net", repo)
    run_id = str((await app.create_run(ORG, "net", "apply", "alice")).state.run_id)
    await app.run_command(ORG, "net", run_id, R.CancelRun(actor="alice"))
    keep = tmp_path / "work" / recovery.UNSAVED
    keep.mkdir(parents=True)
    doc = {"version": 4, "serial": 3, "lineage": "l-1", "resources": [], "outputs": {}}
    (keep / f"{ORG}.net.{run_id}.3.tfstate").write_text(json.dumps(doc))
    store = StateStore(nc.jetstream(), load_keyring("", tmp_path, create=True))

    for _ in range(2):
        await recovery.record_unsaved(app, store, keep, "executor:test")

    events = await run_events(app, "net", run_id)
    [version] = [e for e in events if isinstance(e, R.StateVersionCreated)]
    assert version.recovered and version.serial == 3 and version.lease_id == ""
    assert "recovered at restart" in version.message
    head, _ = await store.head(ORG, "net")
    assert head is not None and head.object == version.object
    assert [p.name for p in keep.iterdir()] == [f"{ORG}.net.{run_id}.3.tfstate.recorded"]
