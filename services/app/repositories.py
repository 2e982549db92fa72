"""Where a workspace's repository may come from: the sources the deployment allows each
organization, and never runplane's own directories nor the kernel's.

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
- `*`: anything git clones natively;
- any of these after `org=` or `org1+org2=` (`acme+beta=https://github.com/acme/`): for
  the workspaces of those organizations only.

A rule naming no organization is for every organization (what a list without any named
ones always meant) unless the deployment says `--unscoped-repos none`
(`RUNPLANE_UNSCOPED_REPOS`): then it is for none, and each organization has only the rules
naming it. Every process logs at start the unscoped rules every organization may use
(`repository_rules_unscoped`).

Whatever the list says, a local repository in `/proc`, `/sys`, `/dev` or one of runplane's
own directories (the data directory with its mirrors, an executor's work directory, every
executor's jobs directory) is refused, also when it reaches there through a symlink, `..`,
a `.git` file (`gitdir:`) or git's `alternates` (services/app/repopaths.py), and so is
one whose path someone other than root (or runplane's user) could change between the
check and git's read (`unsafe-path`: a symlink or a directory a job's uid owns, a
directory others can write, such as the shared `/tmp` itself), and git is given the
checked path resolved, never the string again. A relative
path is refused (git would resolve it against whatever directory it runs in), and so is
git's `transport::address` form (it runs a remote helper: `ext::` runs any command). The
API checks at workspace creation and change (422 `repository-not-allowed`, naming the
rule); the executor checks again, for the run's organization, before each checkout.

Defaults: `runplane up` allows `https://,ssh://,file://` (its demo and local trials use
local repositories: its single operator's); a standalone `api` allows `https://,ssh://`;
a standalone `executor` or `scheduler` allows `*` (the API is the gate for sources; they
still refuse the directories above, unsafe local paths, relative paths and remote
helpers). Give them the API's list to have the organizations checked at admission and
checkout too.

Which credentials a checkout uses (`host_credentials`): the organization's own (its VCS
connection's token, executor/gitaccess.py), never the host's, unless the deployment names
the organization in `--host-git-credentials` (`RUNPLANE_HOST_GIT_CREDENTIALS`, `*`: all).
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

from events.errors import RepositoryRefused
from events.workspace import repository_problem
from services.app.repopaths import RUNPLANE_DIR as RUNPLANE_DIR  # a rule refusals name
from services.app.repopaths import SYSTEM_DIR as SYSTEM_DIR
from services.app.repopaths import UNSAFE_PATH as UNSAFE_PATH
from services.app.repopaths import Guarded, check_local, under

UP_DEFAULT = "https://,ssh://,file://"
API_DEFAULT = "https://,ssh://"
EXECUTOR_DEFAULT = "*"
# The scheduler checks a repository again at admission (its `ls-remote`): like the
# executor, it leaves the sources to the API unless given the API's list.
DEFAULTS = {
    "up": UP_DEFAULT,
    "api": API_DEFAULT,
    "executor": EXECUTOR_DEFAULT,
    "scheduler": EXECUTOR_DEFAULT,
}

# Rules a refusal names (the `rule` member of the 422 and the checkout's message).
NOT_ALLOWED = "allowed-repos"
RELATIVE = "relative-path"
HELPER = "remote-helper"
MALFORMED = "malformed"

_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://(.*)", re.S)
_SCP = re.compile(r"(?:([^@/:\[\]]+)@)?(\[[^\]]+\]|[^@/:\[\]]+):(.*)", re.S)
# `acme+beta=https://github.com/acme/`: a rule for those organizations only.
_SCOPED = re.compile(r"([a-z0-9-]+(?:\+[a-z0-9-]+)*)=(.+)", re.S)
UNSCOPED_CHOICES = ("all", "none")


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


@dataclass(frozen=True)
class Pattern:
    """One entry of the allowed list (module docstring); `orgs` empty: unscoped."""

    text: str
    scheme: str = ""  # "" any remote scheme (a bare host); "*" anything
    host: str = ""
    user: str = ""
    path: str = ""  # a prefix; for a local one, absolute and resolved
    orgs: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, text: str) -> Pattern:
        t = text.strip()
        scoped = _SCOPED.fullmatch(t)
        if scoped:
            orgs = frozenset(scoped.group(1).split("+"))
            return replace(cls._source(scoped.group(2).strip(), text), text=t, orgs=orgs)
        if re.match(r"[^:/@]*=", t):
            raise ValueError(
                f"{text!r}: the organizations before `=` are names of lowercase letters, "
                "digits and dashes joined by `+`"
            )
        return cls._source(t, text)

    @classmethod
    def _source(cls, t: str, text: str) -> Pattern:
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
        raise ValueError(
            f"{text!r} is not a repository source pattern (scheme://, host, path, "
            "optionally after `org+org=`)"
        )

    def matches(self, src: Source, real: str) -> bool:
        """Whether the source is allowed; `real` is a local source's resolved path."""
        if self.scheme == "*":
            return True
        if src.local or self.scheme == "file":
            return src.local and self.scheme == "file" and under(real, self.path)
        if self.scheme and self.scheme != src.scheme:
            return False
        if self.host and self.host != src.host:
            return False
        if self.user and self.user != src.user:
            return False
        return under(src.path, _clean(self.path) if self.path else "")


@dataclass(frozen=True)
class Sources:
    """The deployment's allowed sources, the directories always refused, and the
    organizations whose checkouts may use the host's git credentials."""

    allowed: tuple[Pattern, ...] = (Pattern("*", scheme="*"),)
    guarded: tuple[Guarded, ...] = ()
    exempt: tuple[str, ...] = ()  # resolved paths inside a guarded one that are fine
    unscoped_for_all: bool = True  # a rule naming no organization: for every one
    host_git: frozenset[str] = frozenset()  # "*": every organization

    @classmethod
    def parse(cls, spec: str, *, unscoped: str = "all", host_git: str = "") -> Sources:
        """A comma-separated list of patterns; ValueError names a bad one. `unscoped`
        (`all` or `none`): whom the rules naming no organization are for. `host_git`:
        the comma-separated organizations (or `*`) that may use the host's credentials."""
        patterns = tuple(Pattern.parse(p) for p in spec.split(",") if p.strip())
        if not patterns:
            raise ValueError("the list of allowed repository sources is empty")
        if unscoped not in UNSCOPED_CHOICES:
            raise ValueError(f"unscoped rules are for `all` or `none`, not {unscoped!r}")
        orgs = frozenset(o.strip() for o in host_git.split(",") if o.strip())
        for org in orgs - {"*"}:
            if not re.fullmatch(r"[a-z0-9-]+", org):
                raise ValueError(f"{org!r} is not an organization name")
        return cls(allowed=patterns, unscoped_for_all=unscoped == "all", host_git=orgs)

    def guarding(self, path: Path, what: str, *, exempt: Iterable[Path] = ()) -> Sources:
        """These sources, also refusing anything inside `path` (but `exempt`)."""
        guard = Guarded(os.path.realpath(path), what)
        more = tuple(os.path.realpath(p) for p in exempt)
        return replace(self, guarded=(*self.guarded, guard), exempt=(*self.exempt, *more))

    def rules_for(self, org: str) -> tuple[Pattern, ...]:
        """The rules a workspace of `org` may match."""
        return tuple(
            p for p in self.allowed if (org in p.orgs if p.orgs else self.unscoped_for_all)
        )

    def unscoped(self) -> tuple[Pattern, ...]:
        """The rules naming no organization, which every organization may use (to be
        said at start), or () when unscoped rules are for no one."""
        return tuple(p for p in self.allowed if not p.orgs) if self.unscoped_for_all else ()

    def host_credentials(self, org: str) -> bool:
        """Whether `org`'s checkouts may use the host's git credentials."""
        return "*" in self.host_git or org in self.host_git

    def check(self, repository: str, *, org: str) -> str:
        """What git is to be given for `repository`, a workspace of `org`'s: itself, or a
        local one's path resolved and pinned (services/app/repopaths.py; a `file://` URL
        stays one); RepositoryRefused unless the deployment takes it."""
        src = parse_source(repository)
        real = check_local(repository, src.path, self.guarded, self.exempt) if src.local else ""
        rules = self.rules_for(org)
        if not any(p.matches(src, real) for p in rules):
            listed = ",".join(p.text for p in rules) or "none"
            raise RepositoryRefused(
                NOT_ALLOWED,
                f"repository {repository!r} is not among the sources this deployment allows "
                f"organization {org!r} ({listed})",
            )
        if not src.local:
            return repository
        return "file://" + quote(real) if _URL.fullmatch(repository) else real


def deployment_sources(
    spec: str, data_dir: Path, *, unscoped: str = "all", host_git: str = ""
) -> Sources:
    """The sources a process of this deployment takes: `spec`, never the data directory
    (whose demo repository, made by `runplane up`, is the one exception)."""
    return Sources.parse(spec, unscoped=unscoped, host_git=host_git).guarding(
        data_dir, "runplane's data directory", exempt=[data_dir / "demo-repo"]
    )
