"""What a job holds on disk: the walk of its directories (bytes and inodes, stopped once
past a cap) and the files its processes keep open after unlinking them.

A file unlinked while open keeps its blocks until its last descriptor (or mapping) goes,
and no walk of a directory finds it: a job could write a file up to its disk cap, keep
it open, unlink it, and repeat, filling the host's disk. So the watch also looks at the
descriptors and mappings of each process of the phase (`/proc/<pid>/fd`,
`/proc/<pid>/map_files`, which root may read) for files with no name left, on the file
systems of the job's directories (a deleted file in the sandbox's tmpfs is that tmpfs's
size; a memfd is memory, the memory cap's), each inode counted once.

The cost of a look is bounded: the walk stops once past the most files (`--job-files`),
the descriptors a process may have are `NOFILE` (executor/caps.py), the processes are the
processes cap, and the watch waits longer after a slow look (executor/runner.py).
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

DELETED = " (deleted)"


def _never() -> bool:
    return False


@dataclass(frozen=True)
class Usage:
    """Bytes allocated and inodes (files, directories, links) found; `complete` False if
    the walk stopped early (past its most files, or told to stop)."""

    bytes: int
    files: int
    complete: bool = True


def walk(
    paths: Iterable[Path], *, most_files: int | None = None, stop: Callable[[], bool] = _never
) -> Usage:
    """Bytes allocated on disk under `paths` (each inode once) and the inodes found, never
    following a link; what vanishes meanwhile is skipped (the job is running). Stops once
    more than `most_files` were found, or when `stop()` says so (its phase ended)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    stack = [str(p) for p in paths]
    most = sys.maxsize if most_files is None else most_files
    while stack:
        if len(seen) > most or stop():
            return Usage(total, len(seen), complete=False)
        top = stack.pop()
        with contextlib.suppress(OSError):
            st = os.lstat(top)
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
            if not stat.S_ISDIR(st.st_mode):
                continue
            with os.scandir(top) as entries:
                for entry in entries:
                    if len(seen) + len(stack) > most:  # one directory may hold millions
                        return Usage(total, len(seen) + len(stack), complete=False)
                    with contextlib.suppress(OSError):
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
                            continue
                        est = entry.stat(follow_symlinks=False)
                        if (est.st_dev, est.st_ino) not in seen:
                            seen.add((est.st_dev, est.st_ino))
                            total += est.st_blocks * 512
    return Usage(total, len(seen))


def devices(paths: Iterable[Path]) -> frozenset[int]:
    """The file systems (st_dev) `paths` are on."""
    found = set()
    for path in paths:
        with contextlib.suppress(OSError):
            found.add(os.lstat(path).st_dev)
    return frozenset(found)


def open_deleted(
    pids: Iterable[int], devs: frozenset[int], stop: Callable[[], bool] = _never
) -> Usage:
    """Bytes allocated to files on `devs` that processes `pids` hold open (a descriptor or
    a mapping) after their last name went, each inode once, and how many such files."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for pid in pids:
        for kind in ("fd", "map_files"):
            if stop():
                return Usage(total, len(seen), complete=False)
            try:
                entries = list(os.scandir(f"/proc/{pid}/{kind}"))
            except OSError:
                continue  # gone, or a kernel without map_files
            for entry in entries:
                with contextlib.suppress(OSError):
                    if not os.readlink(entry.path).endswith(DELETED):
                        continue
                    st = os.stat(entry.path)  # the open file itself, through its link
                    key = (st.st_dev, st.st_ino)
                    if st.st_dev in devs and stat.S_ISREG(st.st_mode) and key not in seen:
                        seen.add(key)
                        total += st.st_blocks * 512
    return Usage(total, len(seen))


def pids_of_uid(uid: int) -> list[int]:
    """The processes running as `uid` now (its real uid, as /proc/<pid> is owned)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{name}").st_uid == uid:
                    out.append(int(name))
    return out
