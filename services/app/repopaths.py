"""Which local paths no repository may be: the kernel's own trees and runplane's directories.

A local repository is refused when git would read it (or a directory it points to) from:

- `/proc`, `/sys` or `/dev`, also on the way there: `/proc/self/cwd` and `/proc/<pid>/cwd`
  are magic links to another process's working directory (an executor's job, the API's
  data directory), so the path is walked component by component, every symlink followed
  as the kernel would, and each place it passes through is checked, not only where
  `realpath` ends;
- a directory of runplane's (`Guarded`): the data directory (its repository mirrors in
  `vcs-git/` included), an executor's work directory, and every executor's jobs directory
  (`<tmp>/runplane-*`, always refused);
- whatever git reads besides the path: the variants git tries (`X/.git`, `X.git`,
  `X.git/.git`), the directory a `.git` file points to (`gitdir:`), its `commondir`, and
  every object directory its `objects/info/alternates` names.

And a local repository is refused (`unsafe-path`) unless no one but root (or runplane's
own user) can change what its path names between the check and git's read: a job's uid
that could swap a symlink, or rename a directory, in the shared `/tmp` would otherwise
have the path name a harmless repository when checked and another organization's
checkout or mirror (`/proc/<pid>/cwd`, `<work>/git/<key>.git`) when root's git reads it.
So every entry the path passes through (each component, each symlink, followed as the
kernel does; the same for every place listed above and the files that point git
elsewhere: `.git`, `commondir`, `alternates`) must be owned by root or runplane's user,
in a directory others cannot write, or can only as in a sticky `/tmp` (where no one
renames or removes an entry of another's); the repository itself, and what git reads,
must not be writable by others; a component that does not exist must be in a directory
others cannot write (they could make it). A repository directly in a directory others
can write must be one when checked (`X/.git` or `X` itself): git would otherwise go on
to look for `X.git` there. What passes is pinned: git is given the resolved path
(`check_local`'s result), which nothing but root can change. (Opening the path with
`O_NOFOLLOW` and handing git `/proc/self/fd/N` would not pin it: git resolves that to
a path string again, and reads `gitdir:` and `alternates` by name.)
"""

from __future__ import annotations

import os
import posixpath
import re
import stat
import tempfile
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from events.errors import RepositoryRefused

RUNPLANE_DIR = "runplane-directory"
SYSTEM_DIR = "system-directory"
MALFORMED = "malformed"
UNSAFE_PATH = "unsafe-path"

SYSTEM_DIRS = ("/proc", "/sys", "/dev")
JOBS_PREFIX = "runplane-"  # every executor's default jobs directory: <tmp>/runplane-<key>
_MAX_INDIRECTIONS = 16  # .git files and alternates followed before refusing
_MAX_LINKS = 40  # symlinks followed on one path (the kernel's own bound)
_GIT_SUFFIXES = ("", "/.git", ".git", ".git/.git")  # what `git clone X` may read as X
_GIT_ORDER = ("/.git", "", ".git/.git", ".git")  # the order git tries them in
_HEAD_SHA = re.compile(rb"[0-9a-f]{40}(?:[0-9a-f]{24})?\s*")


def under(path: str, prefix: str) -> bool:
    """Whether `path` is `prefix` or below it, component by component."""
    prefix = prefix.rstrip("/")
    return path == prefix or path.startswith(prefix + "/") or prefix == ""


@dataclass(frozen=True)
class Guarded:
    """A directory of runplane's that no repository may be in; with `children`, only its
    entries whose name starts so (the system's temporary directory: `runplane-*`)."""

    path: str  # resolved
    what: str
    children: str = ""

    def holds(self, real: str) -> bool:
        if not self.children:
            return under(real, self.path)
        if not under(real, self.path) or real == self.path.rstrip("/"):
            return False
        first = real[len(self.path.rstrip("/")) + 1 :].split("/", 1)[0]
        return first.startswith(self.children)


def jobs_directories() -> Guarded:
    """Every executor's jobs directory (and its uid leases) under the temporary directory."""
    tmp = os.path.realpath(tempfile.gettempdir())
    return Guarded(tmp, "an executor's jobs directory", children=JOBS_PREFIX)


def check_local(
    repository: str,
    path: str,
    guarded: Sequence[Guarded],
    exempt: Iterable[str] = (),
) -> str:
    """The resolved path of a local repository at `path` (absolute), or RepositoryRefused
    if git would read it, or anything it points to, from a place refused (module doc), or
    if what it passes through cannot be read (another's `/proc/<pid>/cwd`)."""
    try:
        return _check_local(repository, path, guarded, tuple(exempt))
    except OSError as e:
        why = f"repository {repository!r} cannot be checked: {e.strerror or e}"
        raise RepositoryRefused(MALFORMED, why) from e


def _check_local(
    repository: str, path: str, guarded: Sequence[Guarded], exempt: tuple[str, ...]
) -> str:
    variants = [v for v in (path + s for s in _GIT_SUFFIXES) if v == path or os.path.lexists(v)]
    for variant in variants:  # git takes only one that is there
        _not_system(repository, variant)
        for where in _git_dirs(repository, os.path.realpath(variant)):
            _not_guarded(repository, where, guarded, exempt)
    # Then (once none leads where no repository may be): can anyone else change it?
    real = _pinned_repository(repository, path)
    for variant in variants:
        _git_dirs(repository, os.path.realpath(variant), pin=True)
    return real


def _not_guarded(
    repository: str, real: str, guarded: Sequence[Guarded], exempt: tuple[str, ...]
) -> None:
    if any(under(real, e) for e in exempt):
        return
    for g in (*guarded, jobs_directories()):
        if g.holds(real):
            raise RepositoryRefused(RUNPLANE_DIR, f"repository {repository!r} is inside {g.what}")


def _not_system(repository: str, path: str) -> None:
    """Refuse a path that is, or passes through, /proc, /sys or /dev."""
    for place in visited(path):
        for system in SYSTEM_DIRS:
            if under(place, system):
                raise RepositoryRefused(
                    SYSTEM_DIR, f"repository {repository!r} leads into {system}"
                )


def visited(path: str) -> list[str]:
    """Every absolute path the kernel passes through resolving `path`, in order: each
    component, and each symlink's target, followed (a missing component ends nothing:
    what follows is taken as written). RepositoryRefused past `_MAX_LINKS` links."""
    seen: list[str] = []
    current = "/"
    parts = deque(p for p in path.split("/") if p)
    links = 0
    while parts:
        part = parts.popleft()
        if part == ".":
            continue
        if part == "..":
            current = posixpath.dirname(current)
            seen.append(current)
            continue
        here = posixpath.join(current, part)
        seen.append(here)
        try:
            target = os.readlink(here)
        except OSError:  # not a link, or not there
            current = here
            continue
        links += 1
        if links > _MAX_LINKS:
            raise RepositoryRefused(MALFORMED, f"{path!r} has more than {_MAX_LINKS} links")
        if target.startswith("/"):
            current = "/"
            seen.append("/")
        parts.extendleft(reversed([p for p in target.split("/") if p]))
    return seen


def _git_dirs(repository: str, real: str, *, pin: bool = False) -> list[str]:
    """The directories git reads a local repository from: the path, the directory a
    `.git` file points to (`gitdir:`), its `commondir`, and every object directory its
    `objects/info/alternates` names. More than a few of them: refused, not half-checked.
    `pin`: each of them, and each file that points git elsewhere, `pinned` too."""
    resolve = (lambda p: pinned(repository, p)) if pin else os.path.realpath
    dotgit = os.path.join(real, ".git")
    found = [real, resolve(dotgit)] if os.path.isdir(dotgit) else [real]
    todo = [*found, dotgit]
    while todo:
        here = todo.pop()
        pin_as = repository if pin else ""
        targets = [_pointer(here, k, pin_as) for k in ("gitdir", "commondir")]
        for raw in [t for t in targets if t] + list(_alternates(here, pin_as)):
            _not_system(repository, raw)
            target = resolve(raw)
            if target in found:
                continue
            found.append(target)
            todo.append(target)
            todo.append(os.path.dirname(target))  # an alternate's repository
        if len(found) > _MAX_INDIRECTIONS:
            raise RepositoryRefused(
                MALFORMED, f"repository {real!r} points to more than {_MAX_INDIRECTIONS} others"
            )
    return found


def _pointer(here: str, kind: str, pin_as: str = "") -> str:
    """Where a `.git` file (`gitdir: X`) or a `commondir` file points, absolute."""
    path = here if kind == "gitdir" else os.path.join(here, "commondir")
    text = _small_text(path, pin_as)
    if kind == "gitdir":
        if not text.startswith("gitdir:"):
            return ""
        text = text[len("gitdir:") :]
    text = text.strip()
    if not text:
        return ""
    return os.path.join(os.path.dirname(path), text)


def _alternates(here: str, pin_as: str = "") -> Sequence[str]:
    objects = os.path.join(here, "objects")
    text = _small_text(os.path.join(objects, "info", "alternates"), pin_as)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    return [os.path.join(objects, ln) for ln in lines]


def _small_text(path: str, pin_as: str = "") -> str:
    """A small regular file's text; "" if there is none (or it is not a regular file).
    `pin_as` (a repository's name): one that points git elsewhere, `pinned` first."""
    if pin_as:
        pinned(pin_as, path)
    try:
        if not os.path.isfile(path):
            return ""
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(64 * 1024)
    except OSError:
        return ""


# ---------------------------------------------------------------- what no one else can change


def _unsafe(repository: str, why: str) -> RepositoryRefused:
    return RepositoryRefused(
        UNSAFE_PATH,
        f"repository {repository!r}: {why}; a local repository must be where only root "
        "(or runplane's user) can change it",
    )


def _others_write(st: os.stat_result) -> bool:
    """Whether others than its owner may add, rename or remove a directory's entries
    (or change a file): group- or world-writable."""
    return bool(st.st_mode & 0o022)


def pinned(repository: str, path: str) -> str:
    """`path` (absolute) resolved, if no one but root or this process's user can change
    what it names (module doc); else RepositoryRefused (`unsafe-path`). A missing
    component ends the walk: what follows is returned as written."""
    owners = (0, os.geteuid())
    current, st = "/", os.lstat("/")
    parts = deque(p for p in path.split("/") if p)
    links = 0
    while parts:
        part = parts.popleft()
        if part in (".", ".."):
            current = current if part == "." else posixpath.dirname(current)
            st = os.lstat(current)  # a directory passed on the way down: checked
            continue
        here = posixpath.join(current, part)
        try:
            entry = os.lstat(here)
        except OSError:  # missing (or not readable: git cannot read it either)
            if _others_write(st):
                why = f"{here} is missing in a directory others can write"
                raise _unsafe(repository, why) from None
            return posixpath.join(here, *parts)  # only root can make it
        if entry.st_uid not in owners:
            raise _unsafe(repository, f"{here} belongs to uid {entry.st_uid}")
        if _others_write(st) and not st.st_mode & stat.S_ISVTX:
            raise _unsafe(repository, f"{current} may be changed by others")
        if not stat.S_ISLNK(entry.st_mode):
            current, st = here, entry
            continue
        links += 1
        if links > _MAX_LINKS:
            raise RepositoryRefused(MALFORMED, f"{path!r} has more than {_MAX_LINKS} links")
        target = os.readlink(here)
        if target.startswith("/"):
            current, st = "/", os.lstat("/")
        parts.extendleft(reversed([p for p in target.split("/") if p]))
    if _others_write(st):
        raise _unsafe(repository, f"{current} may be changed by others")
    return current


def _pinned_repository(repository: str, path: str) -> str:
    """`pinned(path)`, and what git makes of it stays as checked: the variants it tries
    (`X/.git`, `X`, `X.git/.git`, `X.git`, in that order) up to the one that is a
    repository are pinned too, and `X.git` is never looked for in a directory others
    can write (they could make one after the check)."""
    real = pinned(repository, path)
    if not os.path.lexists(real):
        return real  # in a directory no one else writes: git finds nothing, as checked
    for suffix in _GIT_ORDER:
        variant = real + suffix
        if suffix and not os.path.lexists(variant):
            continue
        pinned(repository, variant)
        if _is_repository(variant):
            return real
    parent = posixpath.dirname(real)
    if _others_write(os.lstat(parent)):
        raise _unsafe(
            repository,
            f"{real} is not a repository, and git would look for {real}.git in {parent}, "
            "which others can write",
        )
    return real


def _is_repository(path: str) -> bool:
    """Whether git stops at `path` when it looks for a repository there: a `.git` file
    (`gitdir: ...`: git takes it or fails), or a directory git takes as a repository
    (a valid HEAD, `objects` and `refs`, in its `commondir` if it has one)."""
    if os.path.isfile(path):
        return _small_text(path).startswith("gitdir: ")
    if not os.path.isdir(path) or not _valid_head(os.path.join(path, "HEAD")):
        return False
    common = path
    pointer = _small_text(os.path.join(path, "commondir")).strip()
    if pointer:
        common = os.path.join(path, pointer)
    return all(os.path.isdir(os.path.join(common, d)) for d in ("objects", "refs"))


def _valid_head(head: str) -> bool:
    """git's own test of a repository's HEAD (`validate_headref`)."""
    try:
        if os.path.islink(head):
            return os.readlink(head).startswith("refs/")
        with open(head, "rb") as f:
            text = f.read(256)
    except OSError:
        return False
    if text.startswith(b"ref:"):
        return text[4:].lstrip().startswith(b"refs/")
    return bool(_HEAD_SHA.fullmatch(text))
