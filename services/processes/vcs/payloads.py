"""The payloads of GitHub and GitLab, read into one shape (`Change`), checked.

Only the fields runplane acts on are decoded, each with its type (a payload of the wrong
shape is refused, never half-read); every name that will reach a run (branch, tag,
repository, changed paths, commit) is checked: a branch with control characters or a
path with `..` is refused (BadPayload), so nothing hostile is recorded.

Truncated lists: GitHub puts at most 20 commits in a push (and cuts long file lists);
GitLab at most 20 (`total_commits_count` says how many there were). When a push may have
more than its payload lists, or creates a branch (whose commits may not be listed), the
change counts as "anything changed" (`everything`): a run too many rather than one missed.
"""

from __future__ import annotations

import posixpath
import re
from typing import TypeVar

import msgspec

from events import vcs
from infra import jsonbody
from services.processes.vcs import BadPayload

ZERO = "0" * 40
MAX_COMMITS_LISTED = 20  # both providers cut `commits` here
MAX_FILES_LISTED = 3000  # GitHub's cut of a push's file lists
MAX_FILES = 20_000  # more paths than this in one signed payload is not a real push
MAX_REF = 255
MAX_PATH = 4096
_SHA = re.compile(r"^[0-9a-f]{40}(?:[0-9a-f]{24})?$")
_REPO = re.compile(r"^[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+){1,20}$")
_REF_BAD = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]|\.\.|@\{|//")

T = TypeVar("T")
PUSH, TAG, PULL_REQUEST, PING, IGNORED = "push", "tag", "pull_request", "ping", "ignored"


class Change(msgspec.Struct, frozen=True, kw_only=True):
    """What a webhook said, whichever VCS sent it."""

    kind: str  # push | tag | pull_request | ping | ignored
    reason: str = ""  # why an `ignored` one is
    repository: str = ""  # the VCS's full name (acme/net)
    repo_keys: list[str] = []  # events.vcs.repo_key of each URL the payload names
    ref: str = ""
    branch: str = ""  # push: the branch pushed; pull_request: the base branch
    tag: str = ""
    commit: str = ""
    deleted: bool = False
    files: list[str] = []
    everything: bool = False  # the file list may be incomplete: count any path as changed
    pull_request: int = 0


# ---------------------------------------------------------------- GitHub's shapes


class _GhRepo(msgspec.Struct, frozen=True):
    full_name: str
    clone_url: str = ""
    ssh_url: str = ""
    html_url: str = ""


class _Commit(msgspec.Struct, frozen=True):
    added: list[str] = []
    modified: list[str] = []
    removed: list[str] = []


class _Id(msgspec.Struct, frozen=True):
    id: str


class _GhPush(msgspec.Struct, frozen=True):
    ref: str
    after: str
    repository: _GhRepo
    deleted: bool = False
    created: bool = False
    commits: list[_Commit] = []
    head_commit: _Id | None = None


class _Branch(msgspec.Struct, frozen=True):
    ref: str
    sha: str
    repo: _GhRepo | None = None


class _GhPull(msgspec.Struct, frozen=True):
    number: int
    head: _Branch
    base: _Branch


class _GhPullEvent(msgspec.Struct, frozen=True):
    action: str
    number: int
    pull_request: _GhPull
    repository: _GhRepo


# ---------------------------------------------------------------- GitLab's shapes


class _GlProject(msgspec.Struct, frozen=True):
    path_with_namespace: str
    git_http_url: str = ""
    git_ssh_url: str = ""
    web_url: str = ""
    id: int = 0


class _GlPush(msgspec.Struct, frozen=True):
    ref: str
    after: str
    project: _GlProject
    checkout_sha: str | None = None
    commits: list[_Commit] = []
    total_commits_count: int = 0
    before: str = ""


class _GlMrAttrs(msgspec.Struct, frozen=True):
    iid: int
    target_branch: str
    action: str = ""
    source_project_id: int = 0
    target_project_id: int = 0
    last_commit: _Id | None = None
    oldrev: str | None = None


class _GlMr(msgspec.Struct, frozen=True):
    project: _GlProject
    object_attributes: _GlMrAttrs


def _decode(body: bytes, kind: type[T], what: str) -> T:
    try:  # `parse` read it through infra/jsonbody.py first: its depth and keys are sound
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        raise BadPayload(f"the payload is not a {what}: {e}") from e


def parse(provider: str, event: str, body: bytes) -> Change:
    """The change a signed payload describes; BadPayload if it is not one (not JSON,
    nested too deep or a key repeated: infra/jsonbody.py; or not the event's shape)."""
    try:
        jsonbody.decode(body)  # malformed JSON is told apart from a wrong shape
    except msgspec.DecodeError as e:
        raise BadPayload(f"the payload is not JSON: {e}") from e
    except jsonbody.BodyError as e:
        raise BadPayload(f"the payload is refused: {e}") from e
    if provider == "github":
        return _github(event, body)
    return _gitlab(event, body)


def _github(event: str, body: bytes) -> Change:
    match event:
        case "ping":
            return Change(kind=PING)
        case "push":
            return _gh_push(_decode(body, _GhPush, "GitHub push"))
        case "pull_request":
            return _gh_pull(_decode(body, _GhPullEvent, "GitHub pull_request event"))
        case _:
            return Change(kind=IGNORED, reason=f"event {_shown(event)} starts nothing")


def _gh_keys(repo: _GhRepo) -> list[str]:
    urls = (repo.clone_url, repo.ssh_url, repo.html_url, repo.full_name)
    return sorted({vcs.repo_key(u) for u in urls if u})


def _gh_push(p: _GhPush) -> Change:
    repository = _repository(p.repository.full_name)
    commit = p.head_commit.id if p.head_commit is not None else p.after
    deleted = p.deleted or p.after == ZERO
    files = [] if deleted else _files(p.commits)
    truncated = len(p.commits) >= MAX_COMMITS_LISTED or len(files) >= MAX_FILES_LISTED
    return _push(
        p.ref,
        commit,
        deleted,
        repository,
        _gh_keys(p.repository),
        files,
        everything=truncated or p.created,
    )


def _gh_pull(e: _GhPullEvent) -> Change:
    repository = _repository(e.repository.full_name)
    if e.action not in ("opened", "synchronize", "reopened"):
        return Change(kind=IGNORED, reason=f"pull_request {_shown(e.action)} starts nothing")
    pr = e.pull_request
    head_repo = pr.head.repo.full_name if pr.head.repo is not None else ""
    if head_repo.lower() != e.repository.full_name.lower():
        return Change(kind=IGNORED, reason="a pull request from a fork starts nothing")
    return Change(
        kind=PULL_REQUEST,
        repository=repository,
        repo_keys=_gh_keys(e.repository),
        branch=_ref_name(pr.base.ref, "base branch"),
        commit=_sha(pr.head.sha),
        pull_request=_number(e.number),
    )


def _gitlab(event: str, body: bytes) -> Change:
    match event:
        case "Push Hook" | "Tag Push Hook":
            return _gl_push(_decode(body, _GlPush, f"GitLab {event}"))
        case "Merge Request Hook":
            return _gl_mr(_decode(body, _GlMr, "GitLab merge request event"))
        case _:
            return Change(kind=IGNORED, reason=f"event {_shown(event)} starts nothing")


def _gl_keys(p: _GlProject) -> list[str]:
    urls = (p.git_http_url, p.git_ssh_url, p.web_url, p.path_with_namespace)
    return sorted({vcs.repo_key(u) for u in urls if u})


def _gl_push(p: _GlPush) -> Change:
    repository = _repository(p.project.path_with_namespace)
    deleted = p.after == ZERO
    files = [] if deleted else _files(p.commits)
    truncated = (
        p.total_commits_count > len(p.commits)
        or len(p.commits) >= MAX_COMMITS_LISTED
        or p.before == ZERO  # a new branch
    )
    commit = p.checkout_sha or p.after
    return _push(
        p.ref, commit, deleted, repository, _gl_keys(p.project), files, everything=truncated
    )


def _gl_mr(e: _GlMr) -> Change:
    a = e.object_attributes
    repository = _repository(e.project.path_with_namespace)
    if a.action not in ("open", "reopen", "update"):
        return Change(kind=IGNORED, reason=f"merge request {_shown(a.action)} starts nothing")
    if a.action == "update" and not a.oldrev:
        return Change(kind=IGNORED, reason="a merge request update without new commits")
    if a.source_project_id and a.target_project_id and a.source_project_id != a.target_project_id:
        return Change(kind=IGNORED, reason="a merge request from a fork starts nothing")
    if a.last_commit is None:
        raise BadPayload("the merge request event names no last commit")
    return Change(
        kind=PULL_REQUEST,
        repository=repository,
        repo_keys=_gl_keys(e.project),
        branch=_ref_name(a.target_branch, "target branch"),
        commit=_sha(a.last_commit.id),
        pull_request=_number(a.iid),
    )


# ---------------------------------------------------------------- shared


def _push(
    ref: str,
    commit: str,
    deleted: bool,
    repository: str,
    keys: list[str],
    files: list[str],
    *,
    everything: bool,
) -> Change:
    if ref.startswith("refs/heads/"):
        kind, branch, tag = PUSH, _ref_name(ref[len("refs/heads/") :], "branch"), ""
    elif ref.startswith("refs/tags/"):
        kind, branch, tag = TAG, "", _ref_name(ref[len("refs/tags/") :], "tag")
    else:
        return Change(kind=IGNORED, reason="a push to a ref that is no branch or tag")
    return Change(
        kind=kind,
        repository=repository,
        repo_keys=keys,
        ref=ref,
        branch=branch,
        tag=tag,
        commit="" if deleted else _sha(commit),
        deleted=deleted,
        files=files,
        everything=everything and not deleted,
    )


def _files(commits: list[_Commit]) -> list[str]:
    seen: set[str] = set()
    for c in commits:
        for path in (*c.added, *c.modified, *c.removed):
            seen.add(_path(path))
            if len(seen) > MAX_FILES:
                raise BadPayload(f"a push names more than {MAX_FILES} changed paths")
    return sorted(seen)


def _path(path: str) -> str:
    if not path or len(path) > MAX_PATH or any(ord(c) < 32 or ord(c) == 127 for c in path):
        raise BadPayload(f"changed path {_shown(path)} is not a repository path")
    parts = path.split("/")
    if path.startswith("/") or ".." in parts or posixpath.normpath(path) != path:
        raise BadPayload(f"changed path {_shown(path)} is not a plain repository path")
    return path


def valid_ref_name(name: str) -> bool:
    """Whether `name` is a branch or tag name as git allows them (check-ref-format)."""
    return not (
        not name
        or len(name) > MAX_REF
        or _REF_BAD.search(name)
        or name.startswith(("/", ".", "-"))
        or name.endswith(("/", ".", ".lock"))
        or not name.isprintable()
    )


def _ref_name(name: str, what: str) -> str:
    """A branch or tag name as git allows them, or BadPayload."""
    if not valid_ref_name(name):
        raise BadPayload(f"{what} {_shown(name)} is not a valid git ref name")
    return name


def _sha(value: str) -> str:
    if not _SHA.fullmatch(value):
        raise BadPayload(f"commit {_shown(value)} is not a git object id")
    return value


def _repository(name: str) -> str:
    if not _REPO.fullmatch(name) or len(name) > MAX_REF or ".." in name.split("/"):
        raise BadPayload(f"repository {_shown(name)} is not a repository's full name")
    return name


def _number(n: int) -> int:
    if not 0 < n < 2**31:
        raise BadPayload(f"pull request number {n} is out of range")
    return n


def _shown(value: str) -> str:
    """A tenant's string in a message: bounded, control characters escaped."""
    return repr(value[:80])
