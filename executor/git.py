"""Checking out a workspace's repository: a fresh clone per phase, never an interactive prompt.

Every phase gets a fresh working directory at exactly the commit it runs, with nothing in
it from another run. To make that cheap, an executor keeps one bare mirror per repository
under `<work>/git/` (`GitCache`) and builds each phase's clone from it the way `git clone
--shared` would: a new repository whose objects are the mirror's (git's `alternates`), its
HEAD written at the commit, its files checked out by one `git read-tree`. The mirror is
fetched only when it lacks a pinned commit, or to learn an unpinned branch's head. Any
trouble with the cache (unreadable, corrupt, busy, a commit it cannot get) falls back to a
plain `git clone` of the repository, as without a cache.

The mirror is shared by every executor on the work directory and every phase of each:

- it is created in a temporary directory and renamed into place, so it is whole or absent;
- it holds branches and tags, not the repository's URL: each fetch is given it, so
  credentials in it are not kept on disk (a plain clone's `.git/config` has it, and so
  does a phase's clone, removed with the phase's directory);
- it is one organization's: fetched with that organization's credential only (its
  workspace's VCS connection's, infra/gitenv.py), and never read for another's;
- it is only ever fetched into (`gc.auto=0`, no maintenance): an object once in it stays,
  so a clone borrowing its objects never loses one under it. Nothing removes it;
- fetches (and the creation) take an exclusive `flock` on `<key>.lock`, waited for at
  most `LOCK_WAIT_S`; reads need none (git adds objects and refs atomically);
- git commands are bounded by `GIT_TIMEOUT_S` like the plain clone's.

A pinned commit the mirror holds is checked out even if the repository has dropped it
since (a force-push): the run was pinned to it at admission, when the repository had it.
A phase's clone differs from a plain one only in what it leaves out: no remote-tracking
branches (a pinned commit's clone has a detached HEAD and the `origin` remote; an
unpinned one has the branch, tracking `origin`, as `git clone --single-branch` makes it).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import NamedTuple

import structlog

from executor import process
from executor.errors import StepFailed
from executor.gitrepo import copy_borrowed, write_repository
from executor.output import Masker, Output
from executor.process import StepLog
from infra.gitenv import NONE, isolated_env

log = structlog.get_logger(__name__)

_SHA = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
# Branch names the cache writes as ref files itself; anything else takes the plain clone.
_SAFE_BRANCH = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*(?:/[A-Za-z0-9_][A-Za-z0-9._-]*)*")


# A checkout that hangs (a silent git server) must not hold a run forever.
GIT_TIMEOUT_S = 600.0
# How long a phase waits for another's fetch of the same mirror before cloning on its own.
LOCK_WAIT_S = 60.0
_DESCRIBE_FORMAT = "--format=%H%x1f%an <%ae>%x1f%s"  # one line: sha, author, subject


class Commit(NamedTuple):
    """A checked-out commit: its sha, author (`Name <email>`) and subject line."""

    sha: str
    author: str = ""
    message: str = ""


class GitTimeout(StepFailed):
    """A git command ran out of `GIT_TIMEOUT_S`."""


def local_env() -> dict[str, str]:
    """For git commands that reach no repository but ours: no credential, no host config."""
    return isolated_env(NONE, "", key_file="none")


async def _git(
    args: list[str],
    *,
    cwd: Path,
    step_log: StepLog,
    grace: float,
    env: Mapping[str, str] | None = None,
) -> Output:
    """git with `env` (the organization's credential only: infra/gitenv.py), else local."""
    out = Output()
    try:
        code = await asyncio.wait_for(
            process.run(
                ["git", *args],
                cwd=cwd,
                env=dict(env) if env is not None else local_env(),
                step_log=step_log,
                on_line=out.feed,
                grace=grace,
            ),
            GIT_TIMEOUT_S,
        )
    except TimeoutError as e:
        raise GitTimeout("checkout", f"git {args[0]} timed out after {GIT_TIMEOUT_S:g}s") from e
    if code != 0:
        raise StepFailed("checkout", f"git {args[0]} failed (exit {code}): {out.error_text()}")
    return out


async def dissociate(dest: Path, *, step_log: StepLog, grace: float = 5.0) -> None:
    """Copy into the clone in `dest` the objects it borrows from the executor's mirror and
    stop borrowing (`git repack -a -d`, then no `alternates`): a job's own uid cannot
    read the mirrors (executor/isolation.py), and a custom step's command may run git."""
    alternates = dest / ".git" / "objects" / "info" / "alternates"
    if not alternates.exists():
        return  # a plain clone: its objects are its own
    if not await asyncio.to_thread(copy_borrowed, dest / ".git" / "objects", alternates):
        await _git(["repack", "-a", "-d", "-q"], cwd=dest, step_log=step_log, grace=grace)
    alternates.unlink()


def _parse_commit(line: str) -> Commit:
    sha, _, rest = line.strip().partition("\x1f")
    author, _, subject = rest.partition("\x1f")
    return Commit(sha, author.strip(), subject.strip())


async def checkout(
    repository: str,
    dest: Path,
    *,
    branch: str,
    commit: str = "",
    step_log: StepLog,
    grace: float = 5.0,
    env: Mapping[str, str] | None = None,
) -> Commit:
    """Clone `repository` (a path or URL) into `dest` at `branch`, or at `commit` if given,
    git running in `env` (the organization's credential: infra/gitenv.py).

    Returns the checked-out commit. The apply phase passes the plan's commit: a branch
    that moved since the plan must not change what gets applied.
    """
    _check_commit(commit)
    if commit:
        # All branches, not only `branch`: the commit may no longer be its head.
        args = ["clone", "--no-checkout", "--", repository, str(dest)]
    else:
        args = ["clone", "--single-branch", "--branch", branch, "--", repository, str(dest)]
    await _git(args, cwd=dest.parent, step_log=step_log, grace=grace, env=env)
    if commit:
        await _git(["checkout", "--detach", commit], cwd=dest, step_log=step_log, grace=grace)
    head = await _git(
        ["log", "-1", _DESCRIBE_FORMAT, "HEAD"], cwd=dest, step_log=step_log, grace=grace
    )
    found = _parse_commit(head.last_line)
    if commit and found.sha != commit:
        raise StepFailed("checkout", f"checked out {found.sha}, expected {commit}")
    if not _SHA.fullmatch(found.sha):
        raise StepFailed("checkout", f"git log printed no commit: {head.last_line!r}")
    return found


def _check_commit(commit: str) -> None:
    if commit and not _SHA.fullmatch(commit):
        raise StepFailed("checkout", f"not a commit sha: {commit!r}")


# ---------------------------------------------------------------- the cache


class CacheError(Exception):
    """The cache cannot give this checkout; the plain clone will."""


class _Captured(StepLog):
    """Where the cache's own git commands write: kept in memory (masked), not in the step's
    log, so a cache that fails leaves no noise in front of the plain clone's output."""

    def __init__(self, masker: Masker) -> None:  # no file: nothing calls super().__init__
        self.path = Path(os.devnull)
        self.mask = masker

    def write(self, text: str, stream: str = "stdout") -> str:
        return self.mask(text)

    def close(self) -> None:
        pass


class GitCache:
    """Bare mirrors of the repositories an executor checks out, under `root` (module doc)."""

    def __init__(self, root: Path, *, lock_wait: float = LOCK_WAIT_S, remember: int = 4096):
        self.root = Path(os.path.abspath(root))
        self.lock_wait = lock_wait
        self._remember = remember
        self._commits: dict[tuple[str, str], Commit] = {}  # commits never change

    def mirror(self, repository: str, *, org: str) -> Path:
        """The mirror of `repository` for `org`'s workspaces: one per organization, so
        that a commit one organization's credential fetched is never checked out for
        another that could not have fetched it."""
        return self.root / f"{_key(org + chr(10) + repository)}.git"

    async def checkout(
        self,
        repository: str,
        dest: Path,
        *,
        org: str,
        branch: str,
        commit: str = "",
        step_log: StepLog,
        grace: float = 5.0,
        env: Mapping[str, str] | None = None,
    ) -> Commit:
        """`checkout`, from `org`'s mirror when it can; else (any cache trouble) a plain
        clone. What reaches the repository runs in `env` (`checkout`)."""
        _check_commit(commit)
        quiet = _Captured(step_log.mask)
        remote = local_env() if env is None else dict(env)
        try:
            found = await self._from_cache(
                _Origin(repository, org, remote), dest, branch, commit, quiet, grace, loud=step_log
            )
        except _RemoteTimeout as e:
            # The repository itself does not answer: a plain clone would wait as long.
            raise StepFailed("checkout", str(e)) from e
        except Exception as e:  # noqa: BLE001 - every cache trouble has the same remedy
            why = step_log.mask(str(e) or type(e).__name__)
            log.warning("git_cache_unusable", error=why)
            await asyncio.to_thread(shutil.rmtree, dest, ignore_errors=True)
            step_log.note(f"the executor's copy of the repository cannot be used ({why})")
            return await checkout(
                repository,
                dest,
                branch=branch,
                commit=commit,
                step_log=step_log,
                grace=grace,
                env=remote,
            )
        return found

    async def _from_cache(
        self,
        origin: _Origin,
        dest: Path,
        branch: str,
        commit: str,
        quiet: StepLog,
        grace: float,
        *,
        loud: StepLog,
    ) -> Commit:
        """`quiet` takes the output of the local git commands, `loud` (the step's log) what
        git says of its work with the repository itself (filling or fetching the mirror)."""
        if not commit and not _SAFE_BRANCH.fullmatch(branch):
            raise CacheError(f"branch name {branch!r} is not one the cache handles")
        repository = origin.repository
        mirror = self.mirror(repository, org=origin.org)
        fetched = False
        if not mirror.is_dir():
            async with self._locked(mirror):
                if not mirror.is_dir():
                    await self._fill(origin, mirror, loud, grace)
                    fetched = True
        if commit:
            sha = commit
        else:
            async with self._locked(mirror):  # the ref is as we fetched it until read
                await self._fetch(origin, mirror, loud, grace, branch=branch)
                sha = _branch_head(mirror, branch)
            fetched = True
        found = await self._clone(repository, mirror, dest, sha, branch, commit, quiet, grace)
        if found is None and not fetched:  # a pinned commit newer than the mirror
            async with self._locked(mirror):
                await self._fetch(origin, mirror, loud, grace)
            await asyncio.to_thread(shutil.rmtree, dest, ignore_errors=True)
            found = await self._clone(repository, mirror, dest, sha, branch, commit, quiet, grace)
        if found is None:
            raise CacheError(f"commit {sha} cannot be checked out from the mirror")
        return found

    async def _clone(
        self,
        repository: str,
        mirror: Path,
        dest: Path,
        sha: str,
        branch: str,
        commit: str,
        quiet: StepLog,
        grace: float,
    ) -> Commit | None:
        """The phase's clone in `dest` at `sha`; None if the mirror lacks the commit."""
        await asyncio.to_thread(
            write_repository, dest, mirror, repository, sha, "" if commit else branch
        )
        known = self._commits.get((repository, sha))
        read = _git(["read-tree", "--reset", "-u", "HEAD"], cwd=dest, step_log=quiet, grace=grace)
        describe = self._describe(mirror, sha, quiet, grace) if known is None else _known(known)
        # Both to their end, also when one fails: nothing may still write into `dest`.
        results = await asyncio.gather(read, describe, return_exceptions=True)
        for r in results:
            if isinstance(r, GitTimeout):
                raise CacheError(r.message)
            if isinstance(r, StepFailed):
                return None  # the mirror lacks the commit (or is broken: said later)
            if isinstance(r, BaseException):
                raise r
        found = results[1]
        assert isinstance(found, Commit)
        if found.sha != sha:
            raise CacheError(f"the mirror's {sha} describes itself as {found.sha!r}")
        self._remember_commit(repository, found)
        return found

    async def _describe(self, mirror: Path, sha: str, quiet: StepLog, grace: float) -> Commit:
        # `sha^{commit}`: a tree or blob id is not something to check out.
        out = await _git(
            ["--git-dir", str(mirror), "log", "-1", _DESCRIBE_FORMAT, f"{sha}^{{commit}}"],
            cwd=self.root,
            step_log=quiet,
            grace=grace,
        )
        return _parse_commit(out.last_line)

    def _remember_commit(self, repository: str, found: Commit) -> None:
        key = (repository, found.sha)
        if key in self._commits:
            return
        if len(self._commits) >= self._remember:
            self._commits.pop(next(iter(self._commits)))
        self._commits[key] = found

    async def _fill(self, origin: _Origin, mirror: Path, quiet: StepLog, grace: float) -> None:
        """Create the mirror (under its lock), renamed into place once whole."""
        for stale in self.root.glob(f"{mirror.stem}.tmp-*"):  # a killed executor's
            await asyncio.to_thread(shutil.rmtree, stale, ignore_errors=True)
        tmp = self.root / f"{mirror.stem}.tmp-{os.getpid()}-{time.monotonic_ns()}"
        try:
            await _git(
                ["init", "--bare", "--quiet", "--template=", str(tmp)],
                cwd=self.root,
                step_log=quiet,
                grace=grace,
            )
            for key, value in (
                ("gc.auto", "0"),  # never drop an object a clone may borrow
                ("maintenance.auto", "false"),
                ("core.logAllRefUpdates", "false"),
            ):
                await _git(
                    ["--git-dir", str(tmp), "config", key, value],
                    cwd=self.root,
                    step_log=quiet,
                    grace=grace,
                )
            await self._fetch(origin, tmp, quiet, grace)
            os.rename(tmp, mirror)
        finally:
            await asyncio.to_thread(shutil.rmtree, tmp, ignore_errors=True)
        log.info("git_cache_filled", mirror=str(mirror))

    async def _fetch(
        self, origin: _Origin, mirror: Path, quiet: StepLog, grace: float, *, branch: str = ""
    ) -> None:
        """Fetch every branch and tag, or only `branch`. The repository's URL is given
        each time, never stored: credentials in it stay off the disk. What git says of it
        (`From <repository>`, the refs it moved: stderr) goes to the step's log."""
        args = ["--git-dir", str(mirror), "fetch", "--no-progress", "--no-write-fetch-head"]
        if branch:
            refspecs = [f"+refs/heads/{branch}:refs/heads/{branch}"]
        else:
            args.append("--prune")
            refspecs = ["+refs/heads/*:refs/heads/*", "+refs/tags/*:refs/tags/*"]
        _clear_stale_locks(mirror)
        # `--`: a repository spelled like an option is still taken as a repository.
        await self._remote([*args, "--", origin.repository, *refspecs], quiet, grace, origin.env)

    async def _remote(
        self, args: list[str], quiet: StepLog, grace: float, env: Mapping[str, str]
    ) -> None:
        try:
            await _git(args, cwd=self.root, step_log=quiet, grace=grace, env=env)
        except GitTimeout as e:
            raise _RemoteTimeout(e.message) from e

    @contextlib.asynccontextmanager
    async def _locked(self, mirror: Path) -> AsyncIterator[None]:
        """Hold the mirror's exclusive flock (every executor on this work directory)."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / f"{mirror.stem}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            deadline = time.monotonic() + self.lock_wait
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise CacheError(
                            f"the mirror stayed locked for {self.lock_wait:g}s"
                        ) from None
                    await asyncio.sleep(0.02)
            yield
        finally:
            os.close(fd)  # releases the lock


class _Origin(NamedTuple):
    """Where a mirror is fetched from: the repository, for which organization, and the
    environment (that organization's credential) git reaches it with."""

    repository: str
    org: str
    env: Mapping[str, str]


class _RemoteTimeout(Exception):
    """Fetching from the repository timed out."""


async def _known(found: Commit) -> Commit:
    return found


def _key(repository: str) -> str:
    return hashlib.sha256(repository.encode()).hexdigest()[:32]


def _clear_stale_locks(mirror: Path) -> None:
    """Remove git's lock files a fetch killed mid-way left (a power cut: git removes its
    own on a signal). Called under the mirror's flock: no git of ours is writing to it."""
    refs = mirror / "refs"
    stale = [*(refs.rglob("*.lock") if refs.is_dir() else []), *mirror.glob("*.lock")]
    for lock in stale:
        lock.unlink(missing_ok=True)
        log.warning("git_cache_stale_lock_removed", lock=str(lock))


def _branch_head(mirror: Path, branch: str) -> str:
    """The commit the mirror's `refs/heads/<branch>` names: its loose ref, else its line
    in packed-refs (read under the mirror's lock, right after the fetch)."""
    ref = f"refs/heads/{branch}"
    loose = mirror / ref
    if loose.is_file():
        sha = loose.read_text().strip()
    else:
        packed = mirror / "packed-refs"
        lines = packed.read_text().splitlines() if packed.is_file() else []
        sha = next((ln.split(" ", 1)[0] for ln in lines if ln.endswith(f" {ref}")), "")
    if not _SHA.fullmatch(sha):
        raise CacheError(f"the mirror has no commit for {ref}")
    return sha
