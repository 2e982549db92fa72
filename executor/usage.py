"""What one step's processes used: CPU time and peak memory from the phase's control
group (executor/cgroups.py), and the step's wall time.

The group is the phase's (one per plan or apply, its steps one after the other), so a
step's CPU time is the group's counter at its end less at its start, and its peak is
the group's high-water mark, started afresh when the step starts (cgroup v1; on v2 the
phase's peak so far). Without a group (not root, or no cgroup hierarchy) only the wall
time is measured: the executor's children's rusage would mix every concurrent job's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from executor.cgroups import PhaseGroup
from executor.isolation import Jail


@dataclass(frozen=True)
class Usage:
    """A step's figures; None: not measured."""

    cpu_seconds: float | None
    peak_memory_bytes: int | None
    wall_seconds: float


class StepMeter:
    """Started with a step; `usage()` at its end."""

    def __init__(self, jail: Jail | None) -> None:
        limits = jail.limits if jail is not None else None
        self.group: PhaseGroup | None = limits.group if limits is not None else None
        self.started = time.monotonic()
        self.cpu_at_start = self._cpu()
        if self.group is not None:
            self.group.reset_peak()

    def _cpu(self) -> float | None:
        if self.group is None or "cpu" not in self.group.dirs:
            return None
        return self.group.cpu_seconds()

    def usage(self) -> Usage:
        wall = time.monotonic() - self.started
        cpu, start = self._cpu(), self.cpu_at_start
        peak = self.group.peak_memory() if self.group is not None else None
        used = None if cpu is None or start is None else round(max(0.0, cpu - start), 3)
        return Usage(
            cpu_seconds=used,
            peak_memory_bytes=peak,
            wall_seconds=round(wall, 3),
        )
