"""Fixtures shared by the step-log tests: a driven run, a repository, a running executor.

Named with `name=` so that a test module imports them without shadowing its parameters.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from events.run import Workspace
from services.app.commands import App
from tests.executor_support import Harness, commit

# Prints on stdout and stderr (local-exec merges both into Terraform's output), a URL with
# credentials, then waits for the gate file before its last line: a test that creates the
# gate only after it saw "begin-42" proves that lines arrive while the step runs. (The
# markers are computed so that Terraform's echo of the command does not contain them.)
SECRET = "s3cr3t-token"
TALKING_TF = """
variable "gate" {}
resource "null_resource" "talk" {
  provisioner "local-exec" {
    command = <<-EOT
      echo begin-$((40+2))
      echo oops >&2
      echo "cloning https://bob:SECRET@example.com/x.git"
      for i in $(seq 600); do [ -f ${var.gate} ] && break; sleep 0.1; done
      echo end-$((6*7))
    EOT
  }
}
""".replace("SECRET", SECRET)


@pytest.fixture(name="h")
def harness_fixture(nc: NATS, app: App) -> Harness:
    return Harness(nc, app)


class Collected:
    """Messages of a core subscription, kept as they are published."""

    def __init__(self) -> None:
        self.msgs: list[Msg] = []

    async def subscribe(self, nc: NATS, subject: str) -> None:
        async def keep(msg: Msg) -> None:
            self.msgs.append(msg)

        await nc.subscribe(subject, cb=keep)

    def has(self, needle: str) -> bool:
        return any(needle in m.data.decode() for m in self.msgs)

    def seen(self, needle: str) -> Callable[[], Awaitable[bool]]:
        async def probe() -> bool:
            return self.has(needle)

        return probe


async def talking_run(h: Harness, repo: Path, gate: Path, ws: str = "net") -> str:
    """A run of TALKING_TF on a new workspace, planned and awaiting approval."""
    commit(repo, TALKING_TF)
    await h.workspace(ws, Workspace(repository=str(repo), variables={"gate": str(gate)}))
    run_id = await h.start_run(ws)
    await h.reaches(ws, run_id, "awaiting_approval")
    return run_id
