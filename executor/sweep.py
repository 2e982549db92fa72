"""What a killed executor left behind in its work directory, cleared at the next start.

An executor killed with -9 takes Terraform down with it within moments (its parent death
signal, `executor/isolation.py`), but not what Terraform started (provider plugins, a
provisioner's daemon): they live on, and the phase's job directory stays on disk. Those
phases are lost anyway (the reaper fails their runs; the state backend died with the
executor), so an executor starting on a work directory kills every process whose
working directory lies under its jobs directory (and under `<work>/jobs`, where older
versions kept them) and every process of each leftover job's uid (the owner of its
`home/`, unless a live phase of some executor holds that uid now), keeps any
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
from collections.abc import Callable, Sequence
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

LOCK_FILE = ".executor.lock"


Reclaim = Callable[[int], bool]  # kill what runs as a job uid unless a live phase holds it


def hold(work_dir: Path, jobs: Sequence[Path] = (), reclaim: Reclaim | None = None) -> int:
    """Sweep if no other executor lives on `work_dir`, then hold it shared; the fd to keep
    open for the executor's life (closing it releases the hold). `jobs`: the executor's
    directories of jobs (phases, their TMPDIRs), besides `<work>/jobs`; `reclaim`:
    `Isolation.reclaim`."""
    fd = os.open(work_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.info("work_dir_shared", work_dir=str(work_dir))  # a live sibling: leave it be
    else:
        for where in dict.fromkeys([work_dir / "jobs", *jobs]):
            sweep(where, work_dir / "unsaved-state", reclaim)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def sweep(jobs: Path, keep: Path, reclaim: Reclaim | None = None) -> tuple[int, int]:
    """Kill the processes working under `jobs` (and of each job's uid, through `reclaim`),
    keep errored states, remove the job directories; (processes killed, directories
    removed; a uid's processes count as one)."""
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
    if reclaim is not None:
        killed += sum(reclaim(uid) for uid in _job_uids(jobs))
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


def _job_uids(jobs: Path) -> set[int]:
    """The uids leftover jobs ran as: the owners of their `home/` other than us."""
    uids = set()
    for job in jobs.iterdir():
        try:
            uid = os.lstat(job / "home").st_uid
        except OSError:
            continue
        if uid != os.geteuid():
            uids.add(uid)
    return uids


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
