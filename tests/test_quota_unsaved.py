"""What a phase leaves in `<work>/unsaved-state/` is bounded, and none of it blocks a start
(executor/phase_custody.py, executor/recovery.py, executor/sweep.py; an attacker's review
of the state quotas).

- After every apply the executor copied the job's `errored.tfstate` whole, on its event
  loop: `truncate -s 10G errored.tfstate` (sparse, free to the job) made it write 10 GiB
  of zeros outside every cap while every other phase stalled. It is now refused past
  `--state-max-mb` by its size on the open file, and the run's error says so. On the old
  code the test's 200 MB sparse file was copied whole (and its message said "kept").
- At the next start such a file was refused and left for ever, as were files of no run or
  no state, and the `.incoming-*.part` / `.*.sealed` files a kill leaves: now deleted (too
  large, half written) or set aside in a bounded quarantine.
- A store error on one kept file (a ledger NATS will not take) stopped every start of the
  executor: now that file waits for the next start and the others are recorded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client as NATS

from events.run import CancelRun, StateVersionCreated, Workspace
from executor import recovery, sweep
from executor.stateledger import Entry, Ledger
from executor.statestore import StateStore
from infra.crypto import KeyRing
from infra.kv import STATE_LEDGER_BUCKET
from infra.quotas import Quotas
from services.app.commands import App
from services.root.bootstrap import Plane
from tests import bootstrap_support
from tests.executor_support import Harness, commit
from tests.logs_support import harness_fixture

__all__ = ["harness_fixture"]

SPARSE_TF = """
resource "null_resource" "sparse" {
  provisioner "local-exec" {
    command = "truncate -s 200M errored.tfstate && exit 1"
  }
}
"""


@pytest.mark.terraform
async def test_a_sparse_errored_state_past_the_bound_is_refused_not_copied(
    h: Harness, repo: Path, system: Plane, tmp_path: Path
) -> None:
    """An apply whose provisioner leaves a 200 MB sparse `errored.tfstate` and fails, on
    an executor bound to 1 MiB: nothing is copied to unsaved-state, and the run's error
    names the bound."""
    commit(repo, SPARSE_TF)
    await h.workspace("net", Workspace(repository=str(repo)))
    work = tmp_path / "exec"
    async with bootstrap_support.executor(
        system, work_dir=work, executor_id="sparse", quotas=Quotas(state_max_mb=1)
    ):
        run_id = await h.start_run("net")
        await h.reaches("net", run_id, "awaiting_approval")
        await h.approve("net", run_id)
        run = await h.reaches("net", run_id, "failed")

    assert "errored.tfstate (200 MiB)" in run.error_message, run.error_message
    assert "--state-max-mb" in run.error_message and "not kept" in run.error_message
    kept = list((work / recovery.UNSAVED).glob("*")) if (work / recovery.UNSAVED).is_dir() else []
    assert kept == []


async def _ended_run(app: App, org: str = "acme") -> str:
    await app.create_workspace(org, "net", Workspace(repository="/nowhere"), "alice")
    run_id = str((await app.create_run(org, "net", "apply", "alice")).state.run_id)
    await app.run_command(org, "net", run_id, CancelRun(actor="alice"))
    return run_id


def _state(serial: int) -> str:
    return json.dumps({"version": 4, "serial": serial, "lineage": "l", "resources": []})


async def test_a_start_deletes_or_sets_aside_what_it_can_never_record(
    nc: NATS, app: App, tmp_path: Path
) -> None:
    """Kept files past the bound (a sparse 2 GiB one), of no state, of no run: none is
    left to be refused at every start; the quarantine holds at most its bound; a good
    state beside them is recorded."""
    await app.create_org("acme", "alice")
    run_id = await _ended_run(app)
    keep = tmp_path / "work" / recovery.UNSAVED
    keep.mkdir(parents=True)
    with (keep / f"acme.net.{run_id}.7.tfstate").open("wb") as f:
        f.truncate(2 * 1024**3)
    (keep / f"acme.net.{run_id}.8.tfstate").write_text("not a state")
    for i in range(recovery.QUARANTINE + 2):
        (keep / f"acme.net.run{i}.tfstate").write_text(_state(i))  # of no run
    (keep / f"acme.net.{run_id}.9.tfstate").write_text(_state(9))
    store = StateStore(nc.jetstream(), KeyRing.generate(), Quotas(state_max_mb=1))

    assert await recovery.record_unsaved(app, store, keep, "executor:test") == 1

    assert sorted(p.name for p in keep.glob("*.tfstate")) == []
    assert (keep / f"acme.net.{run_id}.9.tfstate.recorded").exists()
    refused = sorted(p.name for p in (keep / recovery.REFUSED).iterdir())
    assert len(refused) == recovery.QUARANTINE
    assert f"acme.net.{run_id}.7.tfstate" not in refused  # too large: deleted


async def test_a_store_error_on_one_kept_state_does_not_block_the_start(
    nc: NATS, app: App, tmp_path: Path
) -> None:
    """Organization "big"'s ledger is at NATS's payload limit: its kept state cannot be
    stored (StateStoreError). The start goes on, the file stays for the next one, and
    acme's kept state is recorded."""
    big = "b" * 63
    for org in ("acme", big):
        await app.create_org(org, "alice")
    runs = {org: await _ended_run(app, org) for org in ("acme", big)}
    kv = await nc.jetstream().key_value(STATE_LEDGER_BUCKET)
    filler = Entry("x" * (nc.max_payload - 100), "o", 1)  # one entry: the ledger at the limit
    ledger = msgspec.json.encode(Ledger([filler]))
    assert nc.max_payload - 100 < len(ledger) <= nc.max_payload - 60
    await kv.put(big, ledger)
    keep = tmp_path / "work" / recovery.UNSAVED
    keep.mkdir(parents=True)
    for org, run_id in runs.items():
        (keep / f"{org}.net.{run_id}.3.tfstate").write_text(_state(3))
    store = StateStore(nc.jetstream(), KeyRing.generate())

    assert await recovery.record_unsaved(app, store, keep, "executor:test") == 1

    assert (keep / f"acme.net.{runs['acme']}.3.tfstate.recorded").exists()
    assert (keep / f"{big}.net.{runs[big]}.3.tfstate").exists()  # for the next start
    events = await app.store.read(f"rp.run.acme.net.{runs['acme']}")
    assert [e.event.serial for e in events if isinstance(e.event, StateVersionCreated)] == [3]


def test_a_lone_start_clears_what_a_killed_executor_left_half_written(tmp_path: Path) -> None:
    """`.incoming-*.part` (a state being received) and `.*.sealed` (one being stored) are
    removed when no other executor lives on the work directory; kept states stay."""
    work = tmp_path / "work"
    keep = work / recovery.UNSAVED
    keep.mkdir(parents=True)
    for name in (".incoming-abc.part", ".acme.net.r1.3.tfstate.sealed", "acme.net.r1.3.tfstate"):
        (keep / name).write_text("x")
    fd = sweep.hold(work)
    os.close(fd)
    assert sorted(p.name for p in keep.iterdir()) == ["acme.net.r1.3.tfstate"]
