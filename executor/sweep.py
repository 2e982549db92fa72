"""What a killed executor left behind in its work directory, cleared at the next start.

An executor killed with -9 takes Terraform down with it within moments, but not
Terraform's provider plugins (Terraform's own children): they live on, and the phase's
job directory stays on disk. Those phases are lost anyway (the reaper fails their runs;
the state backend died with the executor), so an executor starting on a work directory
kills every process whose working directory lies under `<work>/jobs`, keeps any
`errored.tfstate` found there in `<work>/unsaved-state/`, and removes the directories.

Executors may share a work directory: each holds a shared `flock` on `<work>/.executor.lock`
for its life, and sweeps only if it can take it exclusively first, so it never kills
the Terraform of a live sibling.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

LOCK_FILE = ".executor.lock"


def hold(work_dir: Path) -> int:
    """Sweep if no other executor lives on `work_dir`, then hold it shared; the fd to keep
    open for the executor's life (closing it releases the hold)."""
    fd = os.open(work_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.info("work_dir_shared", work_dir=str(work_dir))  # a live sibling: leave it be
    else:
        sweep(work_dir / "jobs", work_dir / "unsaved-state")
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def sweep(jobs: Path, keep: Path) -> tuple[int, int]:
    """Kill the processes working under `jobs`, keep errored states, remove the job
    directories; (processes killed, directories removed)."""
    if not jobs.is_dir():
        return 0, 0
    root = jobs.resolve()
    killed = 0
    for pid in _pids_under(root):
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except ProcessLookupError:
            pass
        except PermissionError:
            log.warning("sweep_cannot_kill", pid=pid)
    removed = 0
    for job in sorted(p for p in jobs.iterdir() if p.is_dir()):
        for errored in job.rglob("errored.tfstate"):
            keep.mkdir(parents=True, exist_ok=True)
            kept = keep / f"{job.name}.errored.tfstate"
            shutil.copyfile(errored, kept)
            os.chmod(kept, 0o600)
            log.error("state_not_stored", kept=str(kept), left_by="a killed executor")
        shutil.rmtree(job, ignore_errors=True)
        removed += 1
    if killed or removed:
        log.warning("work_dir_swept", processes_killed=killed, job_dirs_removed=removed)
    return killed, removed


def _pids_under(root: Path) -> list[int]:
    """Processes (Linux /proc) whose working directory is `root` or below it."""
    found: list[int] = []
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cwd = Path(os.readlink(entry / "cwd"))
        except OSError:  # gone, or not ours to read
            continue
        if cwd == root or root in cwd.parents:
            found.append(int(entry.name))
    return found
