"""A tenant printing without end grows neither RP_LOGS nor `rp-logs` without end (issue 23,
item 6): a phase's log is cut at the deployment's `--log-max-mb`, with a marker line, and
the step's metrics tell the run how much was left out.

Real NATS, real Terraform: an apply whose provisioner prints 1.5 MB, on an executor whose
bound is 1 MiB. On the old code the whole 1.5 MB went to RP_LOGS and to the stored log.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from events.run import StepFinished, Workspace
from infra.quotas import Quotas
from infra.steplogs import decode_records, log_subject, read_live
from infra.streams import LOGS
from services.root.bootstrap import Plane
from tests import bootstrap_support
from tests.executor_support import Harness, commit
from tests.logs_support import harness_fixture
from tests.quota_support import MIB

__all__ = ["harness_fixture"]
pytestmark = pytest.mark.terraform

FLOOD_TF = """
resource "null_resource" "flood" {
  provisioner "local-exec" {
    command = "yes 012345678901234567890123456789012345678901234567890123456789 | head -n 25000"
  }
}
"""


async def test_a_phase_printing_without_end_is_cut_at_the_bound_and_the_run_told(
    h: Harness, repo: Path, nc: NATS, system: Plane, tmp_path: Path
) -> None:
    """1.5 MB printed by an apply's provisioner, a bound of 1 MiB: the stored log and the
    live stream hold at most the bound, the stored log ends with the marker, the apply
    step's metrics count what was cut, and the run still applies."""
    commit(repo, FLOOD_TF)
    await h.workspace("net", Workspace(repository=str(repo)))
    async with bootstrap_support.executor(
        system, work_dir=tmp_path / "exec", executor_id="flood", quotas=Quotas(log_max_mb=1)
    ):
        run_id = await h.start_run("net")
        await h.reaches("net", run_id, "awaiting_approval")
        await h.approve("net", run_id)
        await h.reaches("net", run_id, "applied")

    raw = await h.get("rp-logs", f"{run_id}/apply/apply.log")
    assert len(raw) <= 1 * MIB
    stored = list(decode_records(raw.splitlines()))
    assert "log cut" in stored[-1].text and "--log-max-mb" in stored[-1].text
    live = await read_live(nc, log_subject(run_id, "apply"))
    assert sum(len(line.text) for line in live) <= 1 * MIB
    assert (await nc.jetstream().stream_info(LOGS)).state.bytes < 2 * MIB

    events = [e.event for e in await h.app.store.read(f"rp.run.acme.net.{run_id}")]
    finished = [e for e in events if isinstance(e, StepFinished) and e.step == "apply"]
    assert finished and finished[-1].metrics.get("log_cut_lines", 0) > 5_000
