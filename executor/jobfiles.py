"""A job's files: its directories handed to its uid and back, and what it leaves removed.

Under `user` isolation (executor/isolation.py) the job's uid owns only its checkout
(`src/`, handed over by `adopt`) and its `home/`; `seal` takes both back when the phase
ends, and `remove_files_of` clears what the uid left where anyone may write, before the
uid serves another phase. `remove_tree` removes a tree whatever its depth, and
`private_dir` makes a directory that only the executor may have made.
"""

from __future__ import annotations

import functools
import os
import shutil
import stat
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog

from executor.errors import IsolationError

log = structlog.get_logger(__name__)

# Where any uid may create files (sticky, world-writable): a job's leftovers there would
# be readable by the next phase given the same uid, of another organization perhaps.
SHARED_TEMP = (Path("/tmp"), Path("/var/tmp"), Path("/dev/shm"))
# Where else a world-writable directory may be (`/run/lock` on Debian, /var/lock's
# target), looked for at most this deep below each (never /proc or /sys).
_WRITABLE_ROOTS = ("/run", "/var", "/dev", "/srv", "/opt", "/home", "/mnt", "/media")
_WRITABLE_DEPTH = 3
_IPC_BATCH = 2000  # ids per ipcrm: far below the kernel's bound on arguments
_IPC = (("/proc/sysvipc/shm", "-m"), ("/proc/sysvipc/sem", "-s"), ("/proc/sysvipc/msg", "-q"))


@functools.cache
def world_writable() -> tuple[Path, ...]:
    """Every directory of this machine any uid may write in (the shared temporary ones
    and whatever else the system left so: `/run/lock`), found once per process."""
    found = {p for p in SHARED_TEMP if p.is_dir()}
    for top in _WRITABLE_ROOTS:
        base = top.count("/")
        for here, dirs, _ in os.walk(top, onerror=lambda _e: None):
            if here.count("/") - base >= _WRITABLE_DEPTH:
                dirs.clear()
            try:
                st = os.lstat(here)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_IWOTH:
                found.add(Path(here))
    return tuple(sorted(found))


def ipc_of(uid: int) -> list[tuple[str, str]]:
    """(ipcrm's flag, id) of each SysV IPC object `uid` owns or made."""
    found = []
    for table, flag in _IPC:
        try:
            head, *rows = Path(table).read_text().splitlines()
        except (OSError, ValueError):
            continue
        names = head.split()
        uid_at, cuid_at, id_at = names.index("uid"), names.index("cuid"), 1
        for row in rows:
            cols = row.split()
            if uid in (int(cols[uid_at]), int(cols[cuid_at])):
                found.append((flag, cols[id_at]))
    return found


def remove_ipc_of(uid: int) -> int:
    """Remove the SysV IPC objects (shared memory, semaphores, message queues) `uid`
    owns or made, with `ipcrm`; how many. A segment a job left outlives it otherwise,
    readable by whoever holds its uid next. One `ipcrm` per `_IPC_BATCH` objects: a job
    may leave tens of thousands (one process each took a minute)."""
    found = ipc_of(uid)
    for at in range(0, len(found), _IPC_BATCH):
        argv = ["ipcrm"]
        for flag, ipc_id in found[at : at + _IPC_BATCH]:
            argv += [flag, ipc_id]
        subprocess.run(argv, capture_output=True, check=False)  # one gone meanwhile: fine
    return len(found) - len(ipc_of(uid)) if found else 0


def private_dir(path: Path, mode: int) -> Path:
    """Create `path` (parents as needed) or check it: a directory, not a link, ours, and
    writable by no one else; then give it `mode`. A shared temporary directory is
    writable by everyone: what someone else made there in advance is refused."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise IsolationError(f"{path} is not a directory of this user's (a link, or another's)")
    os.chmod(path, mode, follow_symlinks=False)
    return path


def seal(root: Path) -> bool:
    """Make a finished job's directories (`src/`, `home/`) the executor's again, 0700, so
    that what is in them (a plan file, a state) cannot be read by the next phase given the
    same uid, perhaps another organization's, while the directory waits to be removed.
    The job cannot have replaced them: `root` is the executor's (0711). False if one
    that is there could not be sealed."""
    sealed = True
    for name in ("src", "home"):
        path = root / name
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                continue
            os.chown(path, os.geteuid(), os.getegid(), follow_symlinks=False)
            os.chmod(path, 0o700)  # a directory still: the job cannot replace it
        except FileNotFoundError:
            continue  # never made (a phase that ended before its checkout)
        except OSError as e:
            log.warning("job_dir_not_sealed", path=str(path), error=repr(e))
            sealed = False
    return sealed


def remove_tree(path: Path, *, as_uid: int | None = None) -> bool:
    """`rm -rf` of `path` without following links and without recursion in Python (a
    job's tree may be deeper than Python's recursion limit: shutil.rmtree raised there),
    as `as_uid` when given (then it can remove only what that uid could); True if gone."""
    if not os.path.lexists(path):
        return True
    if as_uid is None and _removed_here(path):
        return True
    rm = shutil.which("rm") or "/bin/rm"
    ids: dict[str, Any] = {} if as_uid is None else {"user": as_uid, "group": as_uid}
    if as_uid is not None:
        ids["extra_groups"] = []
    done = subprocess.run(
        [rm, "-rf", "--one-file-system", "--", str(path)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        close_fds=True,
        check=False,
        **ids,
    )
    if done.returncode != 0:
        log.warning(
            "tree_not_removed", path=str(path), error=done.stderr[-300:].decode(errors="replace")
        )
    return not os.path.lexists(path)


_HERE_MOST = 2000  # entries a tree may have to be removed in-process rather than by rm
_HERE_DEPTH = 64  # and levels: one descriptor open per level while it is removed


class _NotHere(Exception):
    """The tree is not one to remove in-process (too large or deep, a mount)."""


def _removed_here(path: Path) -> bool:
    """Remove a small tree (a short phase's) in this process, bottom up, never following
    a link nor crossing into another file system; False if it is not one (too large or
    deep, a mount, an error: `rm -rf` then removes what is left). Spares a process per
    removal: most of a short phase's cost is the processes it starts. Every entry is
    removed relative to a descriptor of the directory listed (opened without following
    a link), never by a path that a directory swapped for a link meanwhile would lead
    elsewhere; at most `_HERE_DEPTH` descriptors are open at once."""
    try:
        top = os.lstat(path)
        if not stat.S_ISDIR(top.st_mode):
            os.unlink(path)
            return True
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if not os.path.samestat(os.fstat(fd), top):
                return False  # replaced meanwhile
            _clear(fd, top.st_dev, [0], 0)
        finally:
            os.close(fd)
        os.rmdir(path)
    except (OSError, _NotHere):
        return False
    return True


def _clear(dirfd: int, dev: int, count: list[int], depth: int) -> None:
    """Empty the directory open as `dirfd` (`count`: entries seen so far, shared)."""
    with os.scandir(dirfd) as it:
        entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
    count[0] += len(entries)
    if count[0] > _HERE_MOST:
        raise _NotHere
    for name, is_dir in entries:
        if not is_dir:  # a file, or a link (to a directory too): unlinked, not followed
            os.unlink(name, dir_fd=dirfd)
            continue
        if depth >= _HERE_DEPTH:
            raise _NotHere
        sub = os.open(
            name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd
        )
        try:
            if os.fstat(sub).st_dev != dev:
                raise _NotHere
            _clear(sub, dev, count, depth + 1)
        finally:
            os.close(sub)
        os.rmdir(name, dir_fd=dirfd)


def remove_files_of(uid: int, places: Sequence[Path] | None = None) -> int:
    """Remove what `uid` owns at the top of each world-writable directory (a directory
    with all below it, removed as that uid); how many entries were removed. Never follows
    a link, and never fails the caller: what is left is logged."""
    return clear_files_of(uid, places)[0]


def clear_files_of(uid: int, places: Sequence[Path] | None = None) -> tuple[int, bool]:
    """`remove_files_of`, and whether nothing of `uid` was left there."""
    removed, cleared = 0, True
    for place in world_writable() if places is None else places:
        try:
            entries = list(os.scandir(place))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    gone = remove_tree(Path(entry.path), as_uid=uid)
                else:
                    os.unlink(entry.path)
                    gone = True
                removed += gone
                cleared = cleared and gone
            except FileNotFoundError:
                continue  # gone meanwhile
            except Exception as e:  # noqa: BLE001  # a job's leftovers never stop a phase's end
                log.warning("job_file_not_removed", path=entry.path, error=repr(e))
                cleared = False
    return removed, cleared


def adopt(top: Path, uid: int) -> int:
    """Give the executor's files under `top` to `uid`, never following a link; the count.

    fd-relative throughout (`os.fwalk`, which checks it descends into the directory it
    listed): the job may be running and renaming things meanwhile. Each file is opened
    without following links and checked on its fd before `fchown`; a file with other
    hard links (git's local clone shares objects with their source) is left as it is,
    readable but not the job's, so that nothing outside `top` changes owner."""
    me = os.geteuid()
    try:
        st = os.lstat(top)
    except FileNotFoundError:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        raise IsolationError(f"{top} is not a directory")
    changed = 0
    for _, dirs, files, dirfd in os.fwalk(top, follow_symlinks=False):
        here = os.fstat(dirfd)
        if here.st_uid == me:
            os.fchown(dirfd, uid, uid)
            changed += 1
        for name in (*dirs, *files):
            changed += _adopt_file(name, dirfd, me, uid)
    os.chmod(top, 0o700, follow_symlinks=False)
    return changed


def _adopt_file(name: str, dirfd: int, me: int, uid: int) -> int:
    try:
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return 0
    if st.st_uid != me or not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        return 0  # a directory is done by the walk; links stay the executor's
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dirfd)
    except OSError:
        return 0  # gone or replaced by a link meanwhile
    try:
        st = os.fstat(fd)
        if st.st_uid != me or not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            return 0
        os.fchown(fd, uid, uid)
        return 1
    finally:
        os.close(fd)
