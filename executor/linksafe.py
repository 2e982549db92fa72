"""The checkout is a jail: nothing in a repository makes runplane read or write outside it.

A repository is the tenant's: any of its files may be a symbolic link. Terraform follows
links when it reads the configuration (`main.tf` -> `/etc/passwd` would print it), and a
plain `open()` of ours follows them when we write (`runplane_backend_override.tf` or
`plan.tfplan` -> the encryption key would overwrite it). So:

- after every checkout, `check_checkout` walks it: a link that resolves outside the
  checkout (absolute, climbing out with `..`, or through a chain of links) fails the run
  before Terraform starts (reason `unsafe_symlink`, naming the path). Links that stay
  inside are fine;
- every file runplane writes into the checkout is written by `write_new`: the name is
  unlinked, then created with `O_CREAT | O_EXCL | O_NOFOLLOW` in a directory whose real
  path (read from the opened descriptor, so a directory swapped for a link is seen) is
  inside the checkout;
- every file runplane reads back that Terraform wrote (the plan to seal, a state it
  could not store) is opened by `open_regular`: `O_NOFOLLOW`, and a regular file;
- files runplane only passes through (a plan being sealed or opened) live in a private
  directory beside the job's (`scratch_dir`), never in the checkout, and are moved in
  with a rename, which replaces a link rather than writing through it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from executor.errors import StepFailed

UNSAFE_SYMLINK = "unsafe_symlink"
UNSAFE_FILE = "unsafe_file"

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NEW_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO: no hang


class UnsafePath(StepFailed):
    """A file runplane would write or read is a link, not a regular file, or not where
    it should be."""

    def __init__(self, step: str, message: str) -> None:
        super().__init__(step, message, reason=UNSAFE_FILE)


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def escaping_links(root: Path) -> Iterator[tuple[str, str]]:
    """`(path relative to root, link text)` of every symlink under `root` that resolves
    outside it. `.git` at the top is git's own (it writes no links) and is skipped."""
    real_root = os.path.realpath(root)
    for here, dirs, files in os.walk(root):  # never follows a link to a directory
        if here == str(root) and ".git" in dirs and not os.path.islink(root / ".git"):
            dirs.remove(".git")
        for name in (*dirs, *files):
            path = os.path.join(here, name)
            if os.path.islink(path) and not _inside(os.path.realpath(path), real_root):
                yield os.path.relpath(path, root), os.readlink(path)


def check_checkout(root: Path, step: str = "checkout") -> None:
    """Fail the step (`unsafe_symlink`) if a link in the checkout leads outside it."""
    for rel, target in escaping_links(root):
        raise StepFailed(
            step,
            f"{rel} is a symbolic link to {target!r}, outside the repository's checkout: "
            "refusing to run",
            reason=UNSAFE_SYMLINK,
        )


@contextlib.contextmanager
def _directory(path: Path, within: Path, step: str) -> Iterator[int]:
    """An open descriptor of directory `path`, checked to really be inside `within`
    (whose parent, the job's directory, is trusted; `within` itself is not resolved)."""
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as e:
        raise UnsafePath(step, f"{path.name or path}: not a directory ({e.strerror})") from e
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")
        # `within` itself unresolved: a checkout swapped for a link is not the checkout.
        anchor = os.path.join(os.path.realpath(within.parent), within.name)
        if not _inside(real, anchor):
            raise UnsafePath(step, f"{path} leads outside the job's directory")
        yield fd
    finally:
        os.close(fd)


def write_new(path: Path, data: bytes, *, within: Path, step: str, mode: int = 0o600) -> Path:
    """Write `path` afresh (whatever was there, a link included, is replaced, never
    written through), with `mode`; its directory must really be inside `within`."""
    with _directory(path.parent, within, step) as dir_fd:
        with contextlib.suppress(FileNotFoundError):
            try:
                os.unlink(path.name, dir_fd=dir_fd)
            except IsADirectoryError as e:
                raise UnsafePath(step, f"{path.name} is a directory") from e
        try:
            fd = os.open(path.name, _NEW_FLAGS, mode, dir_fd=dir_fd)
        except OSError as e:  # someone made it again in between
            raise UnsafePath(step, f"{path.name} cannot be created: {e.strerror}") from e
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    return path


def open_regular(path: Path, *, within: Path, step: str) -> BinaryIO:
    """Open `path` for reading only if it is a regular file, not through a link, in a
    directory really inside `within`. FileNotFoundError if there is none."""
    with _directory(path.parent, within, step) as dir_fd:
        try:
            fd = os.open(path.name, _READ_FLAGS, dir_fd=dir_fd)
        except OSError as e:
            if isinstance(e, FileNotFoundError):
                raise
            raise UnsafePath(step, f"{path.name} is not a regular file ({e.strerror})") from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafePath(step, f"{path.name} is not a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def copy_out(path: Path, dest: Path, *, within: Path, step: str) -> None:
    """Copy a file Terraform wrote (`open_regular`) to `dest` (a new private file)."""
    with open_regular(path, within=within, step=step) as src:
        fd = os.open(dest, _NEW_FLAGS, 0o600)
        with os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(src, out, 1024 * 1024)


def move_in(src: Path, path: Path, *, within: Path, step: str) -> None:
    """Rename private file `src` to `path`: a link at `path` is replaced, not followed."""
    with _directory(path.parent, within, step) as dir_fd:
        try:
            os.rename(src, path.name, dst_dir_fd=dir_fd)
        except IsADirectoryError as e:
            raise UnsafePath(step, f"{path.name} is a directory") from e


@contextlib.contextmanager
def scratch_dir(job_root: Path) -> Iterator[Path]:
    """A directory only the executor writes, beside the job's (not in it: the job's
    processes may write there), removed at the end. A killed executor's leftovers are
    swept with the job directories (executor/sweep.py)."""
    path = Path(tempfile.mkdtemp(prefix=f".{job_root.name}.private-", dir=job_root.parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
