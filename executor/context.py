"""Which phase a job is (`PhaseContext`): the run as claimed, the lease, and the phase's
directories. Below the job and its tools, so that what a phase does (its logs, its
custody, reading its plan) can be given the context without the whole job."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from events.run import RunState, Workspace


@dataclass(frozen=True, kw_only=True)
class PhaseContext:
    """Which phase this is: the run as claimed, the lease, and the phase's directories."""

    org: str
    ws: str
    run_id: str
    phase: str
    lease_id: str
    executor_id: str
    run: RunState
    root: Path  # fresh, removed when the phase ends
    keep_dir: Path  # where files that must not be lost go if the object store refuses them
    grace: float = 20.0
    warm: bool = False  # an apply in the plan's own checkout, kept here (executor/warm.py)

    @property
    def actor(self) -> str:
        return f"executor:{self.executor_id}"

    @property
    def config(self) -> Workspace:
        assert self.run.config is not None, "a claimed run always has its workspace config"
        return self.run.config

    @property
    def src(self) -> Path:
        return self.root / "src"

    @property
    def workdir(self) -> Path:
        """The Terraform working directory: the workspace's directory in the clone."""
        return self.src / self.config.directory
