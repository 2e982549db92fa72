"""Which workspaces a change starts, and what. Pure.

A workspace bound to the connection and the repository (the read model's `vcs_bindings`
row) is started by:
- a push to its branch that changed a path its trigger paths match (globs: `*` and `?`
  within one path segment, `**` any depth, `[...]` a character class); with no trigger
  paths, any path under its `directory` (anything, for the repository's root); with
  `trigger_any_change`, any push; a push whose file list may be incomplete counts as
  changing everything. It runs the workspace's `vcs_run_type` (plan or apply);
- a tag push whose tag matches one of its `trigger_tags` (fnmatch; none: tags start
  nothing), its `vcs_run_type` too;
- a pull request opened, synchronized or reopened against its branch: a speculative
  plan. (A pull request's payload lists no files: each workspace of the base branch
  plans it.)
A deleted branch or tag starts nothing.
"""

from __future__ import annotations

import fnmatch
import posixpath
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from services.vcs.payloads import PULL_REQUEST, PUSH, TAG, Change


@dataclass(frozen=True)
class Target:
    workspace: str
    run_type: str
    speculative: bool


@lru_cache(maxsize=4096)
def _compiled(pattern: str) -> re.Pattern[str]:
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 1 :]:
            end = pattern.index("]", i + 1 + (pattern[i + 1 : i + 2] == "]"))
            body = pattern[i + 1 : end].replace("\\", "\\\\")
            out.append("[^" + body[1:] + "]" if body.startswith("!") else "[" + body + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out), re.S)


def glob_match(pattern: str, path: str) -> bool:
    """Whether a repository path matches a trigger glob (`**` spans directories)."""
    return _compiled(pattern.lstrip("/")).fullmatch(path) is not None


def changed(binding: dict[str, Any], files: Sequence[str], *, everything: bool) -> bool:
    """Whether a push that changed `files` concerns the workspace."""
    if everything or binding["trigger_any_change"]:
        return True
    patterns = binding["trigger_paths"]
    if not patterns:  # its directory: a prefix, no pattern to match (the common case)
        d = posixpath.normpath(binding["directory"] or ".").strip("/")
        return bool(files) if d in (".", "") else any(f.startswith(d + "/") for f in files)
    return any(glob_match(p, f) for f in files for p in patterns)


def targets(change: Change, bindings: Sequence[dict[str, Any]]) -> list[Target]:
    """The runs `change` starts among the bound workspaces of its repository."""
    if change.deleted:
        return []
    match change.kind:
        case "push":
            return [
                Target(b["workspace"], b["run_type"], speculative=False)
                for b in bindings
                if b["branch"] == change.branch
                and changed(b, change.files, everything=change.everything)
            ]
        case "tag":
            return [
                Target(b["workspace"], b["run_type"], speculative=False)
                for b in bindings
                if any(fnmatch.fnmatchcase(change.tag, t) for t in b["trigger_tags"])
            ]
        case "pull_request":
            return [
                Target(b["workspace"], "plan", speculative=True)
                for b in bindings
                if b["branch"] == change.branch
            ]
        case _:
            return []


assert (PUSH, TAG, PULL_REQUEST) == ("push", "tag", "pull_request")  # the cases above
