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
"""

from __future__ import annotations

import os
import posixpath
import tempfile
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from events.errors import RepositoryRefused

RUNPLANE_DIR = "runplane-directory"
SYSTEM_DIR = "system-directory"
MALFORMED = "malformed"

SYSTEM_DIRS = ("/proc", "/sys", "/dev")
JOBS_PREFIX = "runplane-"  # every executor's default jobs directory: <tmp>/runplane-<key>
_MAX_INDIRECTIONS = 16  # .git files and alternates followed before refusing
_MAX_LINKS = 40  # symlinks followed on one path (the kernel's own bound)
_GIT_SUFFIXES = ("", "/.git", ".git", ".git/.git")  # what `git clone X` may read as X


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
    if git would read it, or anything it points to, from a place refused (module doc)."""
    exempt = tuple(exempt)
    for variant in (path + s for s in _GIT_SUFFIXES):
        if variant != path and not os.path.lexists(variant):
            continue  # git takes only one that is there
        _not_system(repository, variant)
        for where in _git_dirs(repository, os.path.realpath(variant)):
            _not_guarded(repository, where, guarded, exempt)
    return os.path.realpath(path)


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


def _git_dirs(repository: str, real: str) -> list[str]:
    """The directories git reads a local repository from: the path, the directory a
    `.git` file points to (`gitdir:`), its `commondir`, and every object directory its
    `objects/info/alternates` names. More than a few of them: refused, not half-checked."""
    dotgit = os.path.join(real, ".git")
    found = [real, os.path.realpath(dotgit)] if os.path.isdir(dotgit) else [real]
    todo = [*found, dotgit]
    while todo:
        here = todo.pop()
        targets = [_pointer(here, "gitdir"), _pointer(here, "commondir")]
        for raw in [t for t in targets if t] + list(_alternates(here)):
            _not_system(repository, raw)
            target = os.path.realpath(raw)
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


def _pointer(here: str, kind: str) -> str:
    """Where a `.git` file (`gitdir: X`) or a `commondir` file points, absolute."""
    path = here if kind == "gitdir" else os.path.join(here, "commondir")
    text = _small_text(path)
    if kind == "gitdir":
        if not text.startswith("gitdir:"):
            return ""
        text = text[len("gitdir:") :]
    text = text.strip()
    if not text:
        return ""
    return os.path.join(os.path.dirname(path), text)


def _alternates(here: str) -> Sequence[str]:
    objects = os.path.join(here, "objects")
    text = _small_text(os.path.join(objects, "info", "alternates"))
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    return [os.path.join(objects, ln) for ln in lines]


def _small_text(path: str) -> str:
    """A small regular file's text; "" if there is none (or it is not a regular file)."""
    try:
        if not os.path.isfile(path):
            return ""
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(64 * 1024)
    except OSError:
        return ""
