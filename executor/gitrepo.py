"""A phase's clone made by hand from an executor's mirror (executor/git.py): a new
repository whose objects are the mirror's (`alternates`), HEAD at the pinned commit."""

from __future__ import annotations

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
