"""Where a workspace's repository may come from: the sources the deployment allows, and
never runplane's own directories.

A repository is spelled as git takes it: a URL (`https://host/path`, `ssh://user@host/path`,
`file:///srv/git/x`), an scp-like `user@host:path` (ssh), or a local path. The deployment
lists what it allows (`--allowed-repos` / `RUNPLANE_ALLOWED_REPOS`, comma-separated):

- `https://`, `ssh://`, `file://` ...: any repository of that scheme. `ssh://` covers the
  scp-like form; `file://` covers every local path;
- `https://github.com/acme/`: that scheme, host and path prefix;
- `git@github.com:` or `github.com:acme/`: ssh to that host (and user), under that path;
- `github.com`: that host, by any scheme;
- `/srv/git/` or `file:///srv/git/`: local paths under that directory (symlinks and `..`
  resolved before comparing);
- `*`: anything git clones natively.

Whatever the list says, a local repository inside one of runplane's own directories (the
data directory, an executor's work directory with its repository mirrors) is refused,
also when it reaches there through a symlink, a `.git` file (`gitdir:`) or git's
`alternates`. A relative path is refused (git would resolve it against whatever directory
it runs in), and so is git's `transport::address` form (it runs a remote helper: `ext::`
runs a command). The API checks at workspace creation (422 `repository-not-allowed`,
naming the rule); the executor checks again before each checkout.

Defaults: `runplane up` allows `https://,ssh://,file://` (its demo and local trials use
local repositories); a standalone `api` allows `https://,ssh://`; a standalone `executor`
allows `*` (the API is the gate for sources; the executor still refuses its own
directories, relative paths and remote helpers).
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from events.errors import RepositoryRefused
from events.workspace import repository_problem

UP_DEFAULT = "https://,ssh://,file://"
API_DEFAULT = "https://,ssh://"
EXECUTOR_DEFAULT = "*"
DEFAULTS = {"up": UP_DEFAULT, "api": API_DEFAULT, "executor": EXECUTOR_DEFAULT}

# Rules a refusal names (the `rule` member of the 422 and the checkout's message).
NOT_ALLOWED = "allowed-repos"
RUNPLANE_DIR = "runplane-directory"
RELATIVE = "relative-path"
HELPER = "remote-helper"
MALFORMED = "malformed"

_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://(.*)", re.S)
_SCP = re.compile(r"(?:([^@/:\[\]]+)@)?(\[[^\]]+\]|[^@/:\[\]]+):(.*)", re.S)
_MAX_INDIRECTIONS = 16  # .git files and alternates followed before refusing


@dataclass(frozen=True)
class Source:
    """A repository as git reads it. `scheme` is `ssh` for the scp-like form and `file`
    for a local path; `path` of a local one is absolute and normalized, not resolved."""

    scheme: str
    host: str = ""
    user: str = ""
    path: str = ""

    @property
    def local(self) -> bool:
        return self.scheme == "file"


def parse_source(repository: str) -> Source:
    """Read `repository` the way git does (URL, scp-like, local path); refuse the forms
    no deployment takes (control characters, a leading `-`, a remote helper, a relative
    path) with RepositoryRefused."""
    rule, why = repository_problem(repository)
    if rule:
        raise RepositoryRefused(rule, why)
    url = _URL.fullmatch(repository)
    if url:
        return _from_url(repository, url.group(1).lower())
    scp = _SCP.fullmatch(repository)
    if scp and "/" not in repository.split(":", 1)[0]:
        user, host, path = scp.groups()
        return Source("ssh", host.strip("[]").lower(), user or "", _clean(path))
    if not repository.startswith("/"):
        raise RepositoryRefused(
            RELATIVE, f"repository {repository!r} is a relative path: give an absolute one"
        )
    return Source("file", path=posixpath.normpath(repository))


def _from_url(repository: str, scheme: str) -> Source:
    try:
        parts = urlsplit(repository)
        host = (parts.hostname or "").lower()
        user = unquote(parts.username or "")
    except ValueError as e:
        raise RepositoryRefused(MALFORMED, f"repository {repository!r}: {e}") from e
    path = unquote(parts.path)
    if scheme == "file":
        if host not in ("", "localhost"):
            raise RepositoryRefused(MALFORMED, f"repository {repository!r}: a file URL has no host")
        if not path.startswith("/"):
            raise RepositoryRefused(RELATIVE, f"repository {repository!r} is a relative path")
        return Source("file", path=posixpath.normpath(path))
    return Source(scheme, host, user, _clean(path))


def _clean(path: str) -> str:
    """A remote path for prefix comparison: `..` and doubled slashes folded, no leading `/`
    (`ssh://h/a` and `h:a` name the same path for our purpose)."""
    return posixpath.normpath("/" + path).lstrip("/")


def _under(path: str, prefix: str) -> bool:
    """Whether `path` is `prefix` or below it, component by component."""
    prefix = prefix.rstrip("/")
    return path == prefix or path.startswith(prefix + "/") or prefix == ""


@dataclass(frozen=True)
class Pattern:
    """One entry of the allowed list (module docstring)."""

    text: str
    scheme: str = ""  # "" any remote scheme (a bare host); "*" anything
    host: str = ""
    user: str = ""
    path: str = ""  # a prefix; for a local one, absolute and resolved

    @classmethod
    def parse(cls, text: str) -> Pattern:
        t = text.strip()
        if t == "*":
            return cls(t, scheme="*")
        if t.startswith("/"):
            return cls(t, scheme="file", path=os.path.realpath(t))
        url = _URL.fullmatch(t)
        if url:
            scheme, rest = url.group(1).lower(), url.group(2)
            if scheme == "file":
                return cls(t, scheme="file", path=os.path.realpath(unquote(rest) or "/"))
            if not rest:
                return cls(t, scheme=scheme)
            src = _from_url(t, scheme)
            return cls(t, scheme=scheme, host=src.host, user=src.user, path=src.path)
        scp = _SCP.fullmatch(t)
        if scp:
            user, host, path = scp.groups()
            return cls(t, scheme="ssh", host=host.strip("[]").lower(), user=user or "", path=path)
        if t and re.fullmatch(r"[A-Za-z0-9.-]+", t):
            return cls(t, host=t.lower())
        raise ValueError(f"{text!r} is not a repository source pattern (scheme://, host, path)")

    def matches(self, src: Source, real: str) -> bool:
        """Whether the source is allowed; `real` is a local source's resolved path."""
        if self.scheme == "*":
            return True
        if src.local or self.scheme == "file":
            return src.local and self.scheme == "file" and _under(real, self.path)
        if self.scheme and self.scheme != src.scheme:
            return False
        if self.host and self.host != src.host:
            return False
        if self.user and self.user != src.user:
            return False
        return _under(src.path, _clean(self.path) if self.path else "")


@dataclass(frozen=True)
class Guarded:
    """A directory of runplane's that no repository may be in."""

    path: str  # resolved
    what: str


@dataclass(frozen=True)
class Sources:
    """The deployment's allowed sources and the directories always refused."""

    allowed: tuple[Pattern, ...] = (Pattern("*", scheme="*"),)
    guarded: tuple[Guarded, ...] = ()
    exempt: tuple[str, ...] = ()  # resolved paths inside a guarded one that are fine

    @classmethod
    def parse(cls, spec: str) -> Sources:
        """A comma-separated list of patterns; ValueError names a bad one."""
        patterns = tuple(Pattern.parse(p) for p in spec.split(",") if p.strip())
        if not patterns:
            raise ValueError("the list of allowed repository sources is empty")
        return cls(allowed=patterns)

    def guarding(self, path: Path, what: str, *, exempt: Iterable[Path] = ()) -> Sources:
        """These sources, also refusing anything inside `path` (but `exempt`)."""
        guard = Guarded(os.path.realpath(path), what)
        more = tuple(os.path.realpath(p) for p in exempt)
        return Sources(self.allowed, (*self.guarded, guard), (*self.exempt, *more))

    def check(self, repository: str) -> None:
        """Raise RepositoryRefused unless the deployment takes `repository`."""
        src = parse_source(repository)
        real = os.path.realpath(src.path) if src.local else ""
        if src.local:
            for where in _git_dirs(real):
                self._outside_guarded(repository, where)
        if not any(p.matches(src, real) for p in self.allowed):
            listed = ",".join(p.text for p in self.allowed)
            raise RepositoryRefused(
                NOT_ALLOWED,
                f"repository {repository!r} is not among this deployment's allowed "
                f"sources ({listed})",
            )

    def _outside_guarded(self, repository: str, real: str) -> None:
        if any(_under(real, e) for e in self.exempt):
            return
        for g in self.guarded:
            if _under(real, g.path):
                raise RepositoryRefused(
                    RUNPLANE_DIR, f"repository {repository!r} is inside {g.what}"
                )


def _git_dirs(real: str) -> list[str]:
    """The directories git reads a local repository from: the path, the directory a
    `.git` file points to (`gitdir:`), its `commondir`, and every object directory its
    `objects/info/alternates` names. More than a few of them: refused, not half-checked."""
    dotgit = os.path.join(real, ".git")
    found = [real, os.path.realpath(dotgit)] if os.path.isdir(dotgit) else [real]
    todo = [*found, dotgit]
    while todo:
        here = todo.pop()
        targets = [_pointer(here, "gitdir"), _pointer(here, "commondir")]
        for target in [t for t in targets if t] + list(_alternates(here)):
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
    """Where a `.git` file (`gitdir: X`) or a `commondir` file points, resolved."""
    path = here if kind == "gitdir" else os.path.join(here, "commondir")
    text = _small_text(path)
    if kind == "gitdir":
        if not text.startswith("gitdir:"):
            return ""
        text = text[len("gitdir:") :]
    text = text.strip()
    if not text:
        return ""
    return os.path.realpath(os.path.join(os.path.dirname(path), text))


def _alternates(here: str) -> Sequence[str]:
    objects = os.path.join(here, "objects")
    text = _small_text(os.path.join(objects, "info", "alternates"))
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    return [os.path.realpath(os.path.join(objects, ln)) for ln in lines]


def _small_text(path: str) -> str:
    """A small regular file's text; "" if there is none (or it is not a regular file)."""
    try:
        if not os.path.isfile(path):
            return ""
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(64 * 1024)
    except OSError:
        return ""


def deployment_sources(spec: str, data_dir: Path) -> Sources:
    """The sources a process of this deployment takes: `spec`, never the data directory
    (whose demo repository, made by `runplane up`, is the one exception)."""
    return Sources.parse(spec).guarding(
        data_dir, "runplane's data directory", exempt=[data_dir / "demo-repo"]
    )
