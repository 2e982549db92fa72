"""Stopping runs held by real Terraform (tests/test_stop.py, tests/ui/test_ui_runs.py): an
apply slow enough to be caught mid-way, the probes that see Terraform at the named pipe
(the gate) and gone from it, and the workspace `net`. Holds no tests itself."""

from __future__ import annotations

import os
from pathlib import Path

from tests.procs import descendants

# Each apply takes long enough to be caught mid-way.
SLOW_APPLY_TF = """
resource "null_resource" "slow" {
  provisioner "local-exec" { command = "sleep 4" }
}
"""


async def at_the_gate(gate: Path) -> bool:
    """Has a process of this test (Terraform, under the in-process executor) the pipe open?"""
    for pid in descendants(os.getpid())[1:]:  # not the test itself: it holds the writer
        try:
            if any(os.readlink(fd) == str(gate) for fd in Path(f"/proc/{pid}/fd").iterdir()):
                return True
        except OSError:
            continue
    return False


async def at_the_gate_not(gate: Path) -> bool:
    return not await at_the_gate(gate)
