"""A phase's clone made by hand from an executor's mirror (executor/git.py): a new
repository whose objects are the mirror's (`alternates`), HEAD at the pinned commit,
and those objects made its own (`copy_borrowed`) for a job that runs git itself."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path


def _config_value(value: str) -> str:
    """A git config value, quoted: backslashes, quotes and control characters escaped."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    escaped = escaped.replace("\n", "\\n").replace("\t", "\\t")
    return f'"{escaped}"'


def write_repository(dest: Path, mirror: Path, repository: str, sha: str, branch: str) -> None:
    """A new repository in `dest` borrowing the mirror's objects, HEAD at `sha` (on
    `branch` if given, else detached), its remote `origin` the workspace's repository."""
    git = dest / ".git"
    (git / "objects" / "info").mkdir(parents=True)
    (git / "refs").mkdir()  # git makes heads/ and tags/ when it needs them
    (git / "objects" / "info" / "alternates").write_text(f"{mirror / 'objects'}\n")
    config = [
        "[core]",
        "\trepositoryformatversion = 0",
        "\tfilemode = true",
        "\tbare = false",
        "\tlogallrefupdates = true",
        '[remote "origin"]',
        f"\turl = {_config_value(repository)}",
    ]
    if branch:
        refspec = f"+refs/heads/{branch}:refs/remotes/origin/{branch}"
        config += [
            f"\tfetch = {refspec}",
            f'[branch "{branch}"]',
            "\tremote = origin",
            f"\tmerge = refs/heads/{branch}",
        ]
        for ref in (git / "refs" / "heads" / branch, git / "refs" / "remotes" / "origin" / branch):
            ref.parent.mkdir(parents=True, exist_ok=True)
            ref.write_text(f"{sha}\n")
        (git / "HEAD").write_text(f"ref: refs/heads/{branch}\n")
    else:
        config.append("\tfetch = +refs/heads/*:refs/remotes/origin/*")
        (git / "HEAD").write_text(f"{sha}\n")
    (git / "config").write_text("\n".join(config) + "\n")


_LOOSE_DIR = re.compile(r"[0-9a-f]{2}")
_LOOSE = re.compile(r"[0-9a-f]{38}")
_PACK = re.compile(r"pack-[0-9a-f]{40,64}\.pack")


def copy_borrowed(objects: Path, alternates: Path) -> bool:
    """Copy into `objects` every object of the mirror it borrows from (`alternates`): its
    packs whole and its loose objects, as files (no `git repack`: a process and its
    delta search, most of a short custom step's cost). False (the caller repacks) if
    the mirror is not one plain object store or changed under the copy."""
    try:
        sources = [line.strip() for line in alternates.read_text().splitlines() if line.strip()]
        for source in map(Path, sources):
            if (source / "info" / "alternates").exists():
                return False  # borrowing in turn: git knows the chain, we do not
            for name in os.listdir(source / "pack"):
                if _PACK.fullmatch(name):
                    idx = name[:-5] + ".idx"
                    if os.path.exists(source / "pack" / idx):  # a pack whole: its index too
                        _copy_new(source / "pack" / name, objects / "pack" / name)
                        _copy_new(source / "pack" / idx, objects / "pack" / idx)
            for fan in os.listdir(source):
                if _LOOSE_DIR.fullmatch(fan):
                    for name in os.listdir(source / fan):
                        if _LOOSE.fullmatch(name):
                            _copy_new(source / fan / name, objects / fan / name)
    except OSError:
        return False
    return True


def _copy_new(source: Path, target: Path) -> None:
    """`source` copied to `target` unless it is there (git's objects never change)."""
    if target.exists():
        return
    if source.is_symlink():
        raise OSError(f"{source} is a link")  # not an object of git's making: repack
    target.parent.mkdir(exist_ok=True)
    part = target.with_name(f"tmp_{target.name}")
    shutil.copyfile(source, part, follow_symlinks=False)
    os.replace(part, target)
