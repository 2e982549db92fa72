"""What a killed executor left behind in its work directory, cleared at the next start.

An executor killed with -9 stops its Terraform (its parent death signal,
`executor/spawn.py`): Terraform tries to save its state for a few seconds
(`executor.statebackend.RETRY_MAX`), stops what is in flight, tries again and writes
`errored.tfstate`, some 12 s in all; what Terraform started (provider plugins, a
provisioner's daemon) may live on, and the phase's job directory stays on disk. Those
phases are lost anyway (the restart fails their runs; the state backend died with the
executor), so an executor starting on a work directory waits for each leftover
Terraform until it ended or its `errored.tfstate` is whole, then kills every process whose
working directory lies under its jobs directory (and under `<work>/jobs`, where older
versions kept them) and every process of each leftover job's uid (the owner of its
`home/`, unless a live phase of some executor holds that uid now), keeps any
`errored.tfstate` found there in `<work>/unsaved-state/`, and removes the directories,
and what it left half written in `<work>/unsaved-state/` (`clear_leftovers`).

Executors may share a work directory: each holds a shared `flock` on `<work>/.executor.lock`
for its life, and sweeps only if it can take it exclusively first, so it never kills
the Terraform of a live sibling.
"""

from __future__ import annotations

import fcntl
import os
import signal
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import structlog

from executor.jobfiles import remove_tree
from executor.statestore import parse_state
from executor.uids import terraform_processes

log = structlog.get_logger(__name__)

LOCK_FILE = ".executor.lock"
# How long a start waits at most for the Terraform of a killed executor: its parent death
# signal (SIGTERM) makes it fail to reach the dead state backend (a few tries, meanwhile
# what is in flight goes on), stop, fail again and write `errored.tfstate`, the only
# record of what it did (some 12 s after the kill).
TERRAFORM_GRACE_S = 60.0
ERRORED = "errored.tfstate"
MAX_KEPT_STATE = 256 * 1024 * 1024  # an errored.tfstate larger than this is not a state


Reclaim = Callable[[int], bool]  # kill what runs as a job uid unless a live phase holds it


def hold(
    work_dir: Path,
    jobs: Sequence[Path] = (),
    reclaim: Reclaim | None = None,
    groups: Callable[[], int] | None = None,
) -> int:
    """Sweep if no other executor lives on `work_dir`, then hold it shared; the fd to keep
    open for the executor's life (closing it releases the hold). `jobs`: the executor's
    directories of jobs (phases, their TMPDIRs), besides `<work>/jobs`; `reclaim`:
    `Isolation.reclaim`; `groups`: removes a killed executor's phase groups (what is in
    them killed: `Isolation.sweep`), after its Terraform had its time to stop."""
    fd = os.open(work_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.info("work_dir_shared", work_dir=str(work_dir))  # a live sibling: leave it be
    else:
        for where in dict.fromkeys([work_dir / "jobs", *jobs]):
            sweep(where, work_dir / "unsaved-state", reclaim)
        clear_leftovers(work_dir / "unsaved-state")
        if groups is not None and (removed := groups()):
            log.warning("phase_groups_swept", groups_removed=removed)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def sweep(jobs: Path, keep: Path, reclaim: Reclaim | None = None) -> tuple[int, int]:
    """Kill the processes working under `jobs` (and of each job's uid, through `reclaim`),
    keep errored states, remove the job directories; (processes killed, directories
    removed; a uid's processes count as one)."""
    if not jobs.is_dir():
        return 0, 0
    root = jobs.resolve()
    _let_terraform_finish(root, _job_owners(root))
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
        killed += sum(reclaim(uid) for uid in _job_owners(root))
    removed = 0
    for job in sorted(p for p in jobs.iterdir() if p.is_dir()):
        for errored in _errored_states(job):
            _keep_state(errored, keep / f"{job.name}.errored.tfstate")
        remove_tree(job)  # a job's tree may be deeper than Python's recursion limit
        removed += 1
    if killed or removed:
        log.warning("work_dir_swept", processes_killed=killed, job_dirs_removed=removed)
    return killed, removed


def clear_leftovers(keep: Path) -> int:
    """Remove what a killed executor left half done in `keep`: states being received
    (`.incoming-*.part`) and sealed copies being stored (`.*.sealed`). Only when no other
    executor lives on the work directory (`hold`): a live one's may be in flight."""
    removed = 0
    for pattern in (".incoming-*.part", ".*.sealed"):
        for path in keep.glob(pattern) if keep.is_dir() else []:
            path.unlink(missing_ok=True)
            removed += 1
    if removed:
        log.warning("unsaved_leftovers_removed", files=removed)
    return removed


def _job_owners(jobs: Path) -> dict[int, Path]:
    """The uids leftover jobs ran as (the owners of their `home/` other than us), with
    each one's job directory."""
    owners = {}
    for job in jobs.iterdir():
        try:
            uid = os.lstat(job / "home").st_uid
        except OSError:
            continue
        if uid != os.geteuid():
            owners[uid] = job
    return owners


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


MAX_DEPTH = 64  # Terraform writes errored.tfstate in the workspace's directory: not deeper


def _errored_states(job: Path) -> list[Path]:
    """Each `errored.tfstate` under `job`, found without recursion and without entering a
    linked directory (pathlib's rglob recurses in Python: a job's 1,200 nested directories
    would have stopped the executor's start)."""
    found: list[Path] = []
    stack = [(job, 0)]
    while stack:
        here, depth = stack.pop()
        try:
            entries = list(os.scandir(here))
        except OSError:
            continue
        for entry in entries:
            if entry.name == ERRORED:
                found.append(Path(entry.path))
            elif depth < MAX_DEPTH and entry.is_dir(follow_symlinks=False):
                stack.append((Path(entry.path), depth + 1))
    return found


def _keep_state(errored: Path, kept: Path) -> None:
    """Copy a leftover `errored.tfstate` to `kept` (0600)."""
    data = _read_errored(errored)
    if data is None:
        return
    kept.parent.mkdir(parents=True, exist_ok=True)
    out = os.open(kept, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(out, "wb") as dst:
        dst.write(data)
    log.error("state_not_stored", kept=str(kept), left_by="a killed executor")


def _read_errored(errored: Path, quiet: bool = False) -> bytes | None:
    """A leftover `errored.tfstate`, read never through a link: the job's uid owned that
    directory and could have left a link to a file of ours there, which would then be
    recorded as the workspace's state for the tenant to read. None: not a regular file."""
    try:
        fd = os.open(errored, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if not quiet:
            log.warning("errored_state_refused", path=str(errored), why=repr(e))
        return None
    with os.fdopen(fd, "rb") as src:
        info = os.fstat(src.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_KEPT_STATE:
            if not quiet:
                log.warning("errored_state_refused", path=str(errored), why="not a regular file")
            return None
        return src.read(MAX_KEPT_STATE + 1)


def _state_written(job: Path) -> bool:
    """Whether Terraform wrote a whole `errored.tfstate` in `job` (one that parses:
    Terraform writes it in place, a half-written one does not)."""
    for errored in job.rglob(ERRORED):
        data = _read_errored(errored, quiet=True)
        try:
            if data is not None:
                parse_state(data)
                return True
        except ValueError:
            continue
    return False


def _let_terraform_finish(
    root: Path, owners: dict[int, Path], grace: float = TERRAFORM_GRACE_S
) -> None:
    """Wait (bounded) while the Terraform of a leftover job still runs and has not written
    its `errored.tfstate`, so that the sweep keeps that file before it kills what is
    left. (Once written, Terraform only tries to unlock the dead backend.)"""
    deadline = time.monotonic() + grace
    waited = False
    while jobs := _waiting_for(root, owners):
        if time.monotonic() >= deadline:
            log.warning("leftover_terraform_killed", after_s=grace, jobs=len(jobs))
            return
        if not waited:
            log.warning("waiting_for_leftover_terraform", grace_s=grace, jobs=len(jobs))
            waited = True
        time.sleep(0.2)  # a start on a work directory, before any work: nothing else waits
    if waited:
        log.info("leftover_terraform_done")


def _waiting_for(root: Path, owners: dict[int, Path]) -> set[Path]:
    """The job directories (under `root`, or of one of `owners`' uids) where a process
    named terraform runs and no whole `errored.tfstate` is written yet."""
    jobs: set[Path] = set()
    for entry, uid in terraform_processes():
        job = owners.get(uid)
        if job is None:
            try:
                cwd = Path(os.readlink(entry / "cwd"))
            except OSError:
                continue
            if cwd != root and root not in cwd.parents:
                continue
            job = root if cwd == root else root / cwd.relative_to(root).parts[0]
        jobs.add(job)
    return {job for job in jobs if job == root or not _state_written(job)}
