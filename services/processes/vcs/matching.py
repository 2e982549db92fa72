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
import itertools
import posixpath
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from services.processes.vcs.payloads import PULL_REQUEST, PUSH, TAG, Change


@dataclass(frozen=True)
class Target:
    workspace: str
    run_type: str
    speculative: bool


_ONE, _STAR, _ANY, _DIRS = range(4)  # a character; `*`; `**`; `**/` (none or dirs)
_Token = tuple[int, "re.Pattern[str] | None", str]  # kind, one character's, literal


@lru_cache(maxsize=4096)
def _tokens(pattern: str) -> tuple[_Token, ...]:
    out: list[_Token] = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append((_DIRS, None, ""))
            i += 3
        elif pattern.startswith("**", i):
            out.append((_ANY, None, ""))
            i += 2
        elif pattern[i] == "*":
            out.append((_STAR, None, ""))
            i += 1
        elif pattern[i] == "?":
            out.append((_ONE, re.compile("[^/]"), ""))
            i += 1
        elif (one := _class(pattern, i)) is not None:
            out.append((_ONE, one[0], ""))
            i = one[1]
        else:
            out.append((_ONE, re.compile(re.escape(pattern[i]), re.S), pattern[i]))
            i += 1
    return tuple(out)


def _class(pattern: str, i: int) -> tuple[re.Pattern[str], int] | None:
    """The character class `[...]` at `i` and the index after it; None if there is none
    (a `[` is then itself)."""
    if pattern[i] != "[" or "]" not in pattern[i + 2 :]:
        return None
    end = pattern.index("]", i + 1 + (pattern[i + 1 : i + 2] == "]"))
    body = pattern[i + 1 : end].replace("\\", "\\\\")
    try:
        one = re.compile("[^" + body[1:] + "]" if body.startswith("!") else "[" + body + "]", re.S)
    except re.error:  # `[z-a]`, `[!]`: no class
        return None
    return one, end + 1


def _closure(tokens: tuple[_Token, ...], states: set[tuple[int, bool]]) -> set[tuple[int, bool]]:
    """The states reachable without reading a character (a wildcard matching none)."""
    todo = list(states)
    while todo:
        i, inside = todo.pop()
        if inside or i == len(tokens) or tokens[i][0] == _ONE:
            continue
        more = [(i + 1, False)] + ([(i, True)] if tokens[i][0] == _DIRS else [])
        for s in more:
            if s not in states:
                states.add(s)
                todo.append(s)
    return states


def _step(tokens: tuple[_Token, ...], state: tuple[int, bool], ch: str) -> list[tuple[int, bool]]:
    i, inside = state
    if inside:  # within `**/`'s directories: any character, a `/` may end them
        return [(i, True), (i + 1, False)] if ch == "/" else [(i, True)]
    if i == len(tokens):
        return []
    kind, one, _ = tokens[i]
    if kind == _ONE:
        return [(i + 1, False)] if one is not None and one.fullmatch(ch) else []
    if kind == _DIRS:  # it reads through its `inside` state only
        return []
    return [(i, False)] if kind == _ANY or ch != "/" else []


def _literals(tokens: tuple[_Token, ...]) -> tuple[str, str]:
    """The plain text the pattern starts and ends with: every path it matches has them."""
    plain = [t[2] for t in tokens]
    head = "".join(itertools.takewhile(bool, plain))
    tail = "".join(reversed(list(itertools.takewhile(bool, reversed(plain)))))
    return head, tail if len(head) < len(plain) else ""


MATCH_STEPS = 1_000_000  # of one delivery's glob matching (under a second), then: changed


class Budget:
    """The steps one delivery's glob matching may take: the globs and the paths are both
    the tenant's (50 globs of 256 characters on each of 1,000 workspaces, 2,999 paths of
    2,800), and all of it runs on the API's event loop. Past it, a workspace still to
    be matched counts as changed: a run too many rather than every request waiting."""

    def __init__(self, steps: int = MATCH_STEPS) -> None:
        self.left = steps

    def spend(self, steps: int) -> None:
        self.left -= steps
        if self.left < 0:
            raise _Spent


class _Spent(Exception):
    pass


def _free(steps: int) -> None:
    return None


def glob_match(pattern: str, path: str, budget: Budget | None = None) -> bool:
    """Whether a repository path matches a trigger glob (`**` spans directories).

    Matched by stepping every position of the pattern at once over the path (time
    linear in both): a backtracking regex of a tenant's `**a**a**a**a**a` would hold
    the API's event loop for hours on a path of a few hundred characters.
    """
    spend = budget.spend if budget is not None else _free
    spend(1)
    tokens = _tokens(pattern.lstrip("/"))
    head, tail = _literals(tokens)
    if not (path.startswith(head) and path.endswith(tail)) or len(path) < len(head + tail):
        return False  # most paths are told apart here, before stepping
    states = _closure(tokens, {(0, False)})
    for ch in path:
        spend(len(states))
        states = _closure(tokens, {n for s in states for n in _step(tokens, s, ch)})
        if not states:
            return False
    return (len(tokens), False) in states


def changed(
    binding: dict[str, Any],
    files: Sequence[str],
    *,
    everything: bool,
    budget: Budget | None = None,
) -> bool:
    """Whether a push that changed `files` concerns the workspace (True once `budget` is
    spent: a file list too costly to match counts as changing everything)."""
    if everything or binding["trigger_any_change"]:
        return True
    patterns = binding["trigger_paths"]
    if not patterns:  # its directory: a prefix, no pattern to match (the common case)
        d = posixpath.normpath(binding["directory"] or ".").strip("/")
        return bool(files) if d in (".", "") else any(f.startswith(d + "/") for f in files)
    budget = budget or Budget()
    try:
        return any(glob_match(p, f, budget) for f in files for p in patterns)
    except _Spent:
        return True


def targets(change: Change, bindings: Sequence[dict[str, Any]]) -> list[Target]:
    """The runs `change` starts among the bound workspaces of its repository."""
    if change.deleted:
        return []
    match change.kind:
        case "push":
            budget = Budget()  # one for the whole delivery
            return [
                Target(b["workspace"], b["run_type"], speculative=False)
                for b in bindings
                if b["branch"] == change.branch
                and changed(b, change.files, everything=change.everything, budget=budget)
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
