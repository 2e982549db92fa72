"""The job uids of `user` isolation (executor/isolation.py): the pool, who holds which,
and what still runs as one.

A uid is allocated by an exclusive `flock` on `<lock dir>/<uid>`, held for the phase's
life, so two executors of one machine never share one; whatever still runs as that uid is
killed (`kill_uid`) when it is given back (in the sandbox with a phase group, the group
is emptied instead: executor/isolation.py `Jail.close`) and when it is taken, unless its
last phase gave it back clean (`CLEAN`). A clean uid is taken first, with no look at what
runs (`_clean_one`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from executor.errors import IsolationError
from executor.jobfiles import private_dir

DEFAULT_UIDS = range(1_500_000_000, 1_500_065_536)  # far above any real user or subuid range
UIDS_ENV = "RUNPLANE_JOB_UIDS"  # "first-last", both included


def uid_range(text: str | None = None) -> range:
    """The job uids `RUNPLANE_JOB_UIDS` ("first-last") names; DEFAULT_UIDS if unset."""
    text = os.environ.get(UIDS_ENV, "") if text is None else text
    if not text:
        return DEFAULT_UIDS
    first, sep, last = text.partition("-")
    try:
        lo, hi = int(first), int(last)
    except ValueError:
        lo = hi = -1
    if not sep or lo < 1000 or hi < lo or hi >= 2**32 - 1:
        raise IsolationError(f"{UIDS_ENV}={text!r}: expected first-last, uids >= 1000")
    return range(lo, hi + 1)


def default_lock_dir() -> Path:
    """Where job uids are locked: one place per machine (per user without root)."""
    if os.geteuid() == 0 and os.path.isdir("/run") and os.access("/run", os.W_OK):
        return Path("/run/runplane-uids")
    return Path(tempfile.gettempdir()) / f"runplane-uids-{os.geteuid()}"


# What a uid's lock file holds once its last phase ended with nothing of it left
# (`gave_back_clean`); emptied when the uid is taken again, so a phase whose executor
# dies leaves it dirty.
CLEAN = b"clean"


def allocate(pool: range, lock_dir: Path) -> tuple[int, int, bool]:
    """A job uid no other phase of this machine holds, the fd of its lock, and whether
    its last holder gave it back clean (`gave_back_clean`: no process, file in a shared
    place, SysV IPC object nor unsealed directory of it left, and none could appear since:
    only its holder starts anything as it). A clean uid needs no look at what runs and
    no sweep; any other is looked at, and swept by the caller."""
    locks = private_dir(lock_dir, 0o700)
    taken = _clean_one(pool, locks)
    if taken is not None:
        return taken
    # Uids in use when last looked: one look (all of /proc, every jobs directory)
    # serves the whole walk, not one per uid: with dozens of uids left by killed
    # executors that walk took 0.4-0.5 s per phase, on the executor's event loop.
    seen: set[int] | None = None
    for uid in pool:
        fd = os.open(locks / str(uid), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        if os.pread(fd, len(CLEAN) + 1, 0) == CLEAN:
            os.ftruncate(fd, 0)  # dirty until its phase gives it back clean
            return uid, fd, True
        if seen is None or uid not in seen:  # looked at again holding its lock
            seen = uids_in_use()
        if uid in seen:
            # A killed executor's Terraform, stopping gracefully on its parent death
            # signal to write errored.tfstate, or a killed executor's job directories,
            # still its uid's (not sealed): left to that executor's next start
            # (executor/sweep.py), never handed to another phase with them.
            os.close(fd)
            continue
        return uid, fd, False
    raise IsolationError(f"all {len(pool)} job uids are in use")


def _clean_one(pool: range, locks: Path) -> tuple[int, int, bool] | None:
    """A uid of `pool` given back clean that no one holds, with its lock, or None.

    Only a uid that has a lock file can be clean, so this looks at the lock files there
    are (the uids this process gave back clean first) and never needs the look at what
    runs: a machine whose low uids were left dirty by killed executors (each a look at
    all of /proc and every jobs directory, tens of ms) still finds its clean one at once."""
    with _GIVEN_LOCK:
        recent = [u for u in reversed(_GIVEN_BACK) if u in pool]
    for uid in recent:
        if (taken := _take_clean(uid, locks)) is not None:
            return taken
    try:
        names = os.listdir(locks)
    except OSError:
        return None
    for uid in sorted(int(n) for n in names if n.isdigit() and int(n) in pool):
        if (taken := _take_clean(uid, locks)) is not None:
            return taken
    return None


def _take_clean(uid: int, locks: Path) -> tuple[int, int, bool] | None:
    """`uid` with its lock if no one holds it and it was given back clean, else None."""
    try:
        fd = os.open(locks / str(uid), os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.pread(fd, len(CLEAN) + 1, 0) == CLEAN:
            os.ftruncate(fd, 0)  # dirty until its phase gives it back clean
            with _GIVEN_LOCK:
                _GIVEN_BACK.pop(uid, None)
            return uid, fd, True
    except BlockingIOError:
        pass
    os.close(fd)
    return None


# The uids this process gave back clean lately, most recent last: tried first (a phase's
# end gives its uid back in a thread of its own, hence the lock).
_GIVEN_BACK: dict[int, None] = {}
_GIVEN_BACK_MOST = 64
_GIVEN_LOCK = threading.Lock()


def gave_back_clean(fd: int, uid: int) -> None:
    """Mark the uid whose lock `fd` is as given back clean (`allocate`), just before its
    lock is let go."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, CLEAN, 0)
    with _GIVEN_LOCK:
        _GIVEN_BACK.pop(uid, None)
        _GIVEN_BACK[uid] = None
        while len(_GIVEN_BACK) > _GIVEN_BACK_MOST:
            del _GIVEN_BACK[next(iter(_GIVEN_BACK))]


def reclaim_uid(lock_dir: Path, uid: int) -> bool:
    """Kill what runs as `uid` if no live phase holds its lock in `lock_dir`; False if
    it was never allocated there or is held."""
    try:
        fd = os.open(lock_dir / str(uid), os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return False  # never allocated here: not ours to kill
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # a live phase of some executor has it now
    else:
        kill_uid(uid)
        return True
    finally:
        os.close(fd)


def leftover_job_uids() -> set[int]:
    """The uids that still own a job directory of some executor of this machine (under
    `<tmpdir>/runplane-*/jobs/`): ones whose executor died before sealing it."""
    found: set[int] = set()
    for home in Path(tempfile.gettempdir()).glob("runplane-*/jobs/*/home"):
        with contextlib.suppress(OSError):
            found.add(os.lstat(home).st_uid)
    return found


def uids_in_use() -> set[int]:
    """The uids a job may not be given now: one Terraform runs as (a killed executor's,
    stopping gracefully), or that owns a leftover job directory."""
    return {uid for _, uid in terraform_processes()} | leftover_job_uids()


def terraform_processes() -> Iterator[tuple[Path, int]]:
    """`(/proc/<pid>, uid)` of each live process named terraform (Linux /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != "terraform":
                continue
            status = dict(
                line.split(":", 1)
                for line in (entry / "status").read_text().splitlines()
                if ":" in line
            )
            if status["State"].split()[0] != "Z":  # a zombie is dead, only not reaped
                yield entry, int(status["Uid"].split()[0])
        except (OSError, ValueError, KeyError, IndexError):
            continue


def kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid`: a child turned `uid` calls kill(-1), which the
    kernel delivers to all of that uid's processes at once (a forking daemon cannot
    slip through), sparing only the caller, which then runs /bin/true."""
    if uid < 1000:
        raise ValueError(f"refusing to kill every process of uid {uid}")

    def kill_all() -> None:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass  # nothing runs as uid

    true = shutil.which("true") or "/bin/true"
    subprocess.run(
        [true],
        user=uid,
        group=uid,
        extra_groups=[],
        preexec_fn=kill_all,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        close_fds=True,
        check=False,
    )
