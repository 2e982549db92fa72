"""Warm applies: a plan's checkout (its `.terraform` too) kept on the executor that planned,
for that same run's apply, which then needs no second clone and `init`.

What is kept, and how it stays the plan's own:
- only the checkout (`src/`) of a plan that ended with changes, of a run that has an apply
  step; the plan's processes are all dead (its jail closed) before it is taken in;
- taken into custody (`custody`): every entry the plan's uid owned becomes the executor's,
  no set-id bit and nothing writable by group or others remains; a tree holding anything
  else (a file of a third uid, a hard link of the job's own, a FIFO, a socket, a device)
  is not kept. It then moves (a rename) into this executor's store, 0700, that no job
  can reach: nobody but the executor can write it until the apply;
- kept under its run, organization, workspace, commit, plan digest and the digest of the
  workspace's configuration as the plan ran; `take` hands it only to an apply of the same
  run whose claimed state says the same of all of them, and after the tree is found as
  it was left (`manifest`: every entry's path, type, mode, owner, size, inode, times and
  link text). Anything else, and it is removed: the apply goes the cold way (a fresh
  clone and `init`), as it always could;
- bounded: at most `max_bytes` in all and MAX_ENTRIES runs, the oldest removed first;
  removed once its run ended or applied elsewhere (`Executor` prunes), and whole when the
  executor stops or a later start finds its owner dead (each store is held by an `flock`
  for its executor's life).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import structlog

from events.run import RunState
from executor.jobfiles import private_dir, remove_tree

log = structlog.get_logger(__name__)

MAX_ENTRIES = 16  # runs kept at once per executor
LOCK = ".lock"
_STRIP = stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX | 0o022
_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# What an entry costs the bound at least: an empty file or a link takes no blocks, but an
# inode of the executor's file system (and a step of every keep's and take's walk) for as
# long as its run waits; in bytes alone a tree of empty files was kept whole.
ENTRY_COST = 4096


@dataclass(frozen=True)
class WarmSettings:
    """`wait`: seconds another executor leaves an apply to the one that planned it (0:
    nothing is kept); `max_bytes`: what an executor keeps, in all."""

    wait: float = 2.0
    max_bytes: int = 1 << 30


class Refused(Exception):
    """The tree cannot be kept (it holds what no apply should meet)."""


def config_digest(run: RunState) -> str:
    """The digest of the workspace's configuration as the run was claimed (pinned)."""
    return hashlib.sha256(msgspec.json.encode(run.config)).hexdigest()


@dataclass(frozen=True)
class Facts:
    """What a kept checkout was planned for; an apply takes it only if its run says the
    same of every one."""

    org: str
    ws: str
    run_id: str
    commit: str
    plan_digest: str
    config: str  # config_digest

    @classmethod
    def of(cls, org: str, ws: str, run: RunState) -> Facts:
        return cls(org, ws, run.run_id, run.commit, run.plan_digest, config_digest(run))


@dataclass(frozen=True)
class Kept:
    facts: Facts
    path: Path  # the store's directory of the run; the checkout is `path / "src"`
    size: int
    manifest: str
    at: float


def _refuse(why: str) -> None:
    raise Refused(why)


def _custody_entry(name: str, dirfd: int, me: int, uid: int | None) -> int:
    """One entry (not a directory) of the tree made the executor's; its blocks' bytes
    (at least ENTRY_COST)."""
    st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    if stat.S_ISDIR(st.st_mode):
        return 0  # the walk's own
    if st.st_uid not in (me, uid):
        _refuse(f"{name}: owned by uid {st.st_uid}")
    if stat.S_ISLNK(st.st_mode):
        if st.st_uid != me:
            os.chown(name, me, me, dir_fd=dirfd, follow_symlinks=False)
        return max(st.st_blocks * 512, ENTRY_COST)
    if not stat.S_ISREG(st.st_mode):
        _refuse(f"{name}: not a regular file, a directory or a link")
    if st.st_uid != me and st.st_nlink != 1:
        _refuse(f"{name}: a hard link of the job's")
    fd = os.open(name, _OPEN, dir_fd=dirfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            _refuse(f"{name}: replaced meanwhile")
        if st.st_uid != me:
            os.fchown(fd, me, me)
        if st.st_mode & _STRIP and st.st_nlink == 1:
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~_STRIP)
    finally:
        os.close(fd)
    return max(st.st_blocks * 512, ENTRY_COST)


def custody(src: Path, uid: int | None) -> int:
    """Make the finished plan's checkout the executor's alone (module docstring); its
    size in bytes (each entry at least ENTRY_COST). Raises Refused. `uid`: the plan
    job's (None: it ran as the executor)."""
    me = os.geteuid()
    size = 0
    for _, dirs, files, dirfd in os.fwalk(src, follow_symlinks=False):
        st = os.fstat(dirfd)
        if st.st_uid not in (me, uid):
            _refuse(f"a directory owned by uid {st.st_uid}")
        if st.st_uid != me:
            os.fchown(dirfd, me, me)
        if st.st_mode & _STRIP:
            os.fchmod(dirfd, stat.S_IMODE(st.st_mode) & ~_STRIP)
        size += max(st.st_blocks * 512, ENTRY_COST)
        for name in (*dirs, *files):  # fwalk lists links to directories among `dirs`
            size += _custody_entry(name, dirfd, me, uid)
    os.chmod(src, 0o700, follow_symlinks=False)
    return size


def manifest(src: Path) -> str:
    """A digest of the tree as it stands: every entry's path, type, mode, owner, size,
    inode, change time and link text (never following a link)."""
    h = hashlib.sha256()
    for here, dirs, files, dirfd in os.fwalk(src, follow_symlinks=False):
        dirs.sort()
        st = os.fstat(dirfd)
        h.update(f"{here}\0{st.st_mode}\0{st.st_uid}\0{st.st_ino}\0{st.st_ctime_ns}\n".encode())
        for name in sorted((*dirs, *files)):
            st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            text = os.readlink(name, dir_fd=dirfd) if stat.S_ISLNK(st.st_mode) else ""
            h.update(
                f"{name}\0{st.st_mode}\0{st.st_uid}\0{st.st_size}\0{st.st_ino}\0"
                f"{st.st_mtime_ns}\0{st.st_ctime_ns}\0{text}\n".encode()
            )
    return h.hexdigest()


class WarmStore:
    """One executor's kept checkouts, in `root/<executor_id>` (0700), by run id. Its
    methods touch the disk: call them off the event loop."""

    def __init__(self, root: Path, executor_id: str, *, max_bytes: int) -> None:
        self.root = root
        self.dir = root / executor_id
        self.max_bytes = max_bytes
        self.kept: dict[str, Kept] = {}
        self._lock = -1
        self._guard = threading.Lock()  # `kept`: the loop takes, threads keep and prune

    def open(self) -> None:
        """Remove the stores of executors no longer alive, then make and hold ours."""
        private_dir(self.root, 0o700)
        for other in self.root.iterdir():
            if other != self.dir and _dead(other):
                remove_tree(other)
        remove_tree(self.dir)  # an earlier life of this id's, never trusted
        private_dir(self.dir, 0o700)
        self._lock = os.open(self.dir / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX)

    def close(self) -> None:
        self.kept.clear()
        remove_tree(self.dir)
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1

    def keep(self, facts: Facts, src: Path, uid: int | None) -> bool:
        """Take a finished plan's checkout in (module docstring); False if refused (the
        caller removes what is left of its directory, `src` included)."""
        self.discard(facts.run_id)
        remove_tree(self.dir / facts.run_id)
        try:
            size = custody(src, uid)
            if size > self.max_bytes:
                _refuse(f"{size} bytes, more than the store's {self.max_bytes}")
        except (Refused, OSError) as e:
            log.warning("warm_not_kept", why=str(e))
            return False
        place = self.dir / facts.run_id
        os.mkdir(place, 0o700)
        os.rename(src, place / "src")
        kept = Kept(facts, place, size, manifest(place / "src"), time.time())
        with self._guard:
            self.kept[facts.run_id] = kept
        self._bound()
        return facts.run_id in self.kept

    def take(self, facts: Facts, into: Path) -> bool:
        """Move the kept checkout of the run to `into` if it was planned for exactly
        `facts` and is as it was left; True if it was. Either way nothing of the run is
        kept any longer."""
        with self._guard:
            kept = self.kept.pop(facts.run_id, None)
        if kept is None:
            return False
        src = kept.path / "src"
        try:
            if kept.facts != facts:
                _refuse("planned for another commit, plan or configuration")
            if manifest(src) != kept.manifest:
                _refuse("changed since the plan")
            os.rename(src, into)
            return True
        except (Refused, OSError) as e:
            log.warning("warm_refused", why=str(e))
            return False
        finally:
            remove_tree(kept.path)

    def discard(self, run_id: str) -> None:
        """Remove what is kept of the run, if anything."""
        with self._guard:
            kept = self.kept.pop(run_id, None)
        if kept is not None:
            remove_tree(kept.path)

    def runs(self) -> list[Facts]:
        with self._guard:
            return [k.facts for k in self.kept.values()]

    def _bound(self) -> None:
        """The oldest go first while over MAX_ENTRIES or `max_bytes`."""
        while True:
            with self._guard:
                kept = list(self.kept.values())
            if len(kept) <= MAX_ENTRIES and sum(k.size for k in kept) <= self.max_bytes:
                return
            self.discard(min(kept, key=lambda k: k.at).facts.run_id)


def _dead(store: Path) -> bool:
    """True if no live executor holds `store` (its lock is free, or it has none)."""
    try:
        fd = os.open(store / LOCK, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True
