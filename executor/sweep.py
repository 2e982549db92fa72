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
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import structlog

from executor.isolation import terraform_processes

log = structlog.get_logger(__name__)

LOCK_FILE = ".executor.lock"
# How long a start waits for the Terraform of a killed executor to end on its own: its
# parent death signal (SIGTERM) makes it finish what is in flight, fail to reach the dead
# state backend (a few tries) and write `errored.tfstate`, the only record of what it did.
TERRAFORM_GRACE_S = 60.0
MAX_KEPT_STATE = 256 * 1024 * 1024  # an errored.tfstate larger than this is not a state


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
    _let_terraform_finish(root, _job_uids(jobs))
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
        for errored in job.rglob("errored.tfstate"):  # rglob does not enter linked dirs
            _keep_state(errored, keep / f"{job.name}.errored.tfstate")
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


def _keep_state(errored: Path, kept: Path) -> None:
    """Copy a leftover `errored.tfstate` to `kept` (0600), never through a link: the job's
    uid owned that directory and could have left a link to a file of ours there, which
    would then be recorded as the workspace's state for the tenant to read."""
    try:
        fd = os.open(errored, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        log.warning("errored_state_refused", path=str(errored), why=repr(e))
        return
    with os.fdopen(fd, "rb") as src:
        info = os.fstat(src.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_KEPT_STATE:
            log.warning("errored_state_refused", path=str(errored), why="not a regular file")
            return
        kept.parent.mkdir(parents=True, exist_ok=True)
        out = os.open(kept, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(out, "wb") as dst:
            shutil.copyfileobj(src, dst)
    log.error("state_not_stored", kept=str(kept), left_by="a killed executor")


def _let_terraform_finish(root: Path, uids: set[int], grace: float = TERRAFORM_GRACE_S) -> None:
    """Wait (bounded) while a Terraform of a leftover job still runs, so that it writes
    its `errored.tfstate` before the sweep kills what is left and keeps that file."""
    deadline = time.monotonic() + grace
    waited = False
    while _terraform_running(root, uids):
        if time.monotonic() >= deadline:
            log.warning("leftover_terraform_killed", after_s=grace)
            return
        if not waited:
            log.warning("waiting_for_leftover_terraform", grace_s=grace)
            waited = True
        time.sleep(0.1)  # a start on a work directory, before any work: nothing else waits


def _terraform_running(root: Path, uids: set[int]) -> bool:
    """Whether a process named terraform runs under `root` or as one of `uids`."""
    for entry, uid in terraform_processes():
        if uid in uids:
            return True
        try:
            cwd = Path(os.readlink(entry / "cwd"))
        except OSError:
            continue
        if cwd == root or root in cwd.parents:
            return True
    return False
