"""What a repository says now of a ref: its head, and whether a commit is in its history
after others. Asked by runplane itself (git, never a tenant's code) when a push is
handled (services/processes/vcs/deliveries.py), of the repository the workspace names: the
one its runs check out.

- `head` is `git ls-remote` of the ref (a tag's peeled commit when it is annotated),
  bounded by `timeout`;
- `follows` fetches the ref into a bare mirror of the repository kept under `mirrors`
  (`<sha256 of the organization and URL>.git`: one per organization, like an executor's,
  executor/git.py: created whole by a rename, only ever fetched into, the URL given to
  each fetch and never stored), then asks `git merge-base --is-ancestor`. Without
  `mirrors` nothing follows: only a head starts runs.

The ref and the commits come from a signed payload or the read model; whatever their
source, a ref must be a branch or a tag git accepts and a commit a full object id, and
the repository passes the deployment's sources (services/app/repositories.py) before git
touches it: a local path that now leads into runplane's directories is refused.
git reaches the repository with the credential of the delivery's VCS connection only
(`access`, services/app/gitcreds.py), never the API host's (infra/gitenv.py) unless the
deployment names the organization in `--host-git-credentials`.
A repository that does not answer, or answers something else than git's listing, is a
`HeadsError` (retryable: the delivery is refused and may be delivered again).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

from events.errors import RepositoryRefused
from infra.childenv import run_quietly
from infra.gitenv import NONE, GitCredential, git_access
from services.app.gitcreds import GitAccess
from services.app.repositories import Sources
from services.processes.vcs import VcsError
from services.processes.vcs.payloads import valid_ref_name

DEFAULT_TIMEOUT = 20.0  # per git command (ls-remote, fetch): as the admission snapshot's
_SHA = re.compile(r"[0-9a-f]{40}(?:[0-9a-f]{24})?")
_MAX_ERROR = 500


class HeadsError(VcsError):
    """The repository could not tell; `retryable` unless it may not be asked at all."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


class Heads(Protocol):
    """What the webhook asks of a workspace's repository before it starts a push."""

    async def head(self, repository: str, ref: str, *, org: str = "", connection: str = "") -> str:
        """The commit `ref` names in `repository` now ("" when it names none), asked for
        a workspace of `org` bound to its VCS connection `connection` (whose credential
        git uses)."""
        ...

    async def follows(
        self,
        repository: str,
        ref: str,
        commit: str,
        lines: Sequence[Sequence[str]],
        *,
        org: str = "",
        connection: str = "",
    ) -> list[bool]:
        """For each of `lines`: whether `commit` is in `ref`'s history now and descends
        from every commit of that line (a commit it is equal to included)."""
        ...


def check_ref(ref: str) -> str:
    """`ref` if it is a branch or a tag with a name git takes (check-ref-format: no
    pattern, refspec or revision syntax in it), so git reads it as that ref only."""
    kind, _, name = ref.partition("/")[2].partition("/")
    if ref[:5] != "refs/" or kind not in ("heads", "tags") or not valid_ref_name(name):
        raise HeadsError(f"not a branch or tag runplane asks about: {ref[:80]!r}", retryable=False)
    return ref


def check_sha(commit: str) -> str:
    if not _SHA.fullmatch(commit):
        raise HeadsError(f"not a commit id: {commit[:80]!r}", retryable=False)
    return commit


class GitHeads:
    """`Heads` by git: ls-remote for a head, a mirror's history for `follows`."""

    def __init__(
        self,
        mirrors: Path | None,
        *,
        sources: Sources | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        access: GitAccess | None = None,
    ) -> None:
        self.mirrors = Path(os.path.abspath(mirrors)) if mirrors is not None else None
        self.sources = sources
        self.access = access  # whose credential git uses (None: none, anonymously)
        self.timeout = timeout
        self._locks: dict[Path, asyncio.Lock] = {}  # one fetch per mirror at a time

    async def head(self, repository: str, ref: str, *, org: str = "", connection: str = "") -> str:
        repository = self._allowed(repository, org)
        check_ref(ref)
        peeled = f"{ref}^{{}}"
        code, out, err = await self._git(
            ["ls-remote", "--exit-code", "--", repository, ref, peeled],
            cwd=None,
            remote=await self._remote(org, connection, repository),
        )
        if code == 2:  # no such ref (any more)
            return ""
        if code != 0:
            raise HeadsError(f"git ls-remote {repository} failed (exit {code}): {err}")
        listed = dict(_listing(out))
        found = listed.get(peeled) or listed.get(ref, "")
        if not found:
            raise HeadsError(f"git ls-remote {repository} did not list {ref}")
        return found

    async def follows(
        self,
        repository: str,
        ref: str,
        commit: str,
        lines: Sequence[Sequence[str]],
        *,
        org: str = "",
        connection: str = "",
    ) -> list[bool]:
        repository = self._allowed(repository, org)
        check_ref(ref)
        check_sha(commit)
        for a in {a for line in lines for a in line}:
            check_sha(a)
        remote = await self._remote(org, connection, repository)
        if self.mirrors is None or not await self._on_ref(remote, ref, commit):
            return [False] * len(lines)
        mirror = self._mirror(remote)
        known: dict[str, bool] = {}  # a commit of the lines: whether `commit` descends from it
        for a in {a for line in lines for a in line}:
            # one not in this history is not an ancestor of anything on it
            known[a] = bool(await self._rev(mirror, f"{a}^{{commit}}")) and await self._ancestor(
                mirror, a, commit
            )
        return [all(known[a] for a in line) for line in lines]

    async def _remote(self, org: str, connection: str, repository: str) -> _Remote:
        """The repository, for whom, and with whose credential git reaches it."""
        cred = NONE
        if self.access is not None and org:
            cred = await self.access.of_connection(org, connection)
        return _Remote(repository, org, cred)

    def _mirror(self, remote: _Remote) -> Path:
        """One mirror per organization: what one's credential fetched is not another's."""
        assert self.mirrors is not None
        key = f"{remote.org}\n{remote.repository}".encode()
        return self.mirrors / f"{hashlib.sha256(key).hexdigest()[:32]}.git"

    async def _on_ref(self, remote: _Remote, ref: str, commit: str) -> bool:
        """Fetch `ref` into the mirror; whether `commit` is in its history now (a commit
        a force-push left behind is not)."""
        repository = remote.repository
        mirror = self._mirror(remote)
        async with self._locks.setdefault(mirror, asyncio.Lock()):
            if not mirror.is_dir():
                await self._fill(mirror)
            refspec = f"+{ref}:{ref}"
            fetch = ["fetch", "--no-progress", "--no-write-fetch-head", "--no-tags"]
            await self._ok([*fetch, "--", repository, refspec], mirror, "fetch", remote)
            head = await self._rev(mirror, f"{ref}^{{commit}}")
        if not head or not await self._rev(mirror, f"{commit}^{{commit}}"):
            return False
        return await self._ancestor(mirror, commit, head)

    def _allowed(self, repository: str, org: str) -> str:
        """What git is given: `repository`, a local one resolved and pinned (what the
        deployment's sources check, services/app/repositories.py)."""
        if self.sources is None:
            return repository
        try:
            return self.sources.check(repository, org=org)
        except RepositoryRefused as e:
            raise HeadsError(str(e), retryable=False) from e

    async def _fill(self, mirror: Path) -> None:
        """A new bare mirror, renamed into place once configured (whole or absent)."""
        mirror.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = mirror.parent / f"{mirror.stem}.tmp-{os.getpid()}-{time.monotonic_ns()}"
        try:
            await self._ok(["init", "--bare", "--quiet", "--template=", str(tmp)], None, "init")
            for key, value in (("gc.auto", "0"), ("maintenance.auto", "false")):
                await self._ok(["config", key, value], tmp, "config")
            os.rename(tmp, mirror)
        finally:
            await asyncio.to_thread(shutil.rmtree, tmp, ignore_errors=True)

    async def _rev(self, mirror: Path, spec: str) -> str:
        code, out, _ = await self._git(["rev-parse", "--verify", "--quiet", spec], mirror)
        sha = out.strip()
        return sha if code == 0 and _SHA.fullmatch(sha) else ""

    async def _ancestor(self, mirror: Path, older: str, newer: str) -> bool:
        code, _, err = await self._git(["merge-base", "--is-ancestor", older, newer], mirror)
        if code not in (0, 1):
            raise HeadsError(f"git merge-base failed (exit {code}): {err}")
        return code == 0

    async def _ok(
        self, args: list[str], mirror: Path | None, what: str, remote: _Remote | None = None
    ) -> None:
        code, _, err = await self._git(args, mirror, remote=remote)
        if code != 0:
            raise HeadsError(f"git {what} failed (exit {code}): {err}")

    async def _git(
        self, args: list[str], cwd: Path | None, *, remote: _Remote | None = None
    ) -> tuple[int, str, str]:
        """git's exit code, output and the end of its error output; a command that runs
        out of `timeout` is killed with what it started (ssh) and is a HeadsError. It
        reaches `remote` with that organization's credential only (infra/gitenv.py)."""
        where = ["--git-dir", str(cwd)] if cwd is not None else []
        cred = remote.credential if remote is not None else NONE
        with git_access(cred, remote.repository if remote is not None else "") as env:
            try:
                code, out, err = await run_quietly(("git", *where, *args), env, self.timeout)
            except TimeoutError as e:
                raise HeadsError(f"git {args[0]} timed out after {self.timeout:g}s") from e
        text = err.decode(errors="replace").strip()[-_MAX_ERROR:]
        for secret in cred.secrets():
            text = text.replace(secret, "***")
        return code, out.decode(errors="replace"), text


class _Remote(NamedTuple):
    repository: str
    org: str
    credential: GitCredential


def _listing(out: str) -> list[tuple[str, str]]:
    """`git ls-remote`'s lines as (ref, sha), the malformed ones left out."""
    pairs = []
    for line in out.splitlines():
        sha, _, name = line.partition("\t")
        if _SHA.fullmatch(sha):
            pairs.append((name, sha))
    return pairs
