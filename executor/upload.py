"""A configuration the Terraform CLI uploaded, unpacked as a run's checkout.

A CLI run's configuration is not a repository but a tar.gz of the user's working
directory (a TFE configuration version, services/surfaces/tfe/configs.py), sealed in the object
store with its sha256 recorded in `run.created` (`events.values.ConfigSource`). The
archive is the tenant's, made by anyone with a token, so it is hostile input, and the
extraction here is written as the checkout's jail is (executor/linksafe.py):

- the archive is checked against the digest recorded at upload before it is read;
- a member's name is relative, with no `..`, no NUL, no control character, seen once;
- only regular files, directories and symbolic links are made: hard links, devices,
  FIFOs and anything else refuse the archive;
- a file is created `O_CREAT | O_EXCL | O_NOFOLLOW` in a directory opened without
  following links, so nothing is ever written through a link; symbolic links are made
  last (no later member can pass through one), their targets relative and lexically
  inside, then the whole tree is checked by `linksafe.check_checkout`, which resolves
  chains of links;
- modes keep the owner's execute bit only: no setuid, setgid, sticky or world-write bit
  survives (the job's uid owns the files once the jail adopts them);
- at most `limits.files` members and `limits.unpacked` bytes read from the gzip stream
  (headers included), so a decompression bomb stops at the limit, not at the disk's end.

Every refusal is `StepFailed("checkout", ..., reason="unsafe_archive")`, naming the member.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import os
import posixpath
import stat
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from executor import linksafe
from executor.errors import StepFailed
from executor.git import Commit
from executor.job import Job
from executor.objects import sha256_file
from executor.process import StepLog
from infra.crypto import CryptoError, Tampered

UNSAFE_ARCHIVE = "unsafe_archive"
DIGEST_MISMATCH = "config_digest_mismatch"
MAX_UPLOAD = 32 * 1024 * 1024  # the compressed archive (services/surfaces/tfe/configs.py caps it)
MAX_UNPACKED = 128 * 1024 * 1024  # bytes read out of the gzip stream, tar headers included
MAX_FILES = 10_000
MAX_NAME = 4096

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 256 * 1024


@dataclass(frozen=True)
class Limits:
    files: int = MAX_FILES
    unpacked: int = MAX_UNPACKED


@dataclass(frozen=True)
class Unpacked:
    files: int
    directories: int
    links: int
    size: int  # bytes of file content written


class UnsafeArchive(StepFailed):
    def __init__(self, message: str) -> None:
        super().__init__("checkout", message, reason=UNSAFE_ARCHIVE)


class _Bounded:
    """A read-only stream that refuses to give more than `limit` bytes: what tarfile
    reads of the decompressed archive (member data and headers, pax headers too, which
    it would otherwise read whole into memory) stops at the limit."""

    def __init__(self, raw: gzip.GzipFile, limit: int) -> None:
        self.raw = raw
        self.limit = limit
        self.read_so_far = 0

    def read(self, size: int = -1) -> bytes:
        want = self.limit + 1 - self.read_so_far if size < 0 else size
        data = self.raw.read(max(0, min(want, self.limit + 1 - self.read_so_far)))
        self.read_so_far += len(data)
        if self.read_so_far > self.limit:
            raise UnsafeArchive(f"the archive unpacks to more than {self.limit} bytes")
        return data


def check_digest(path: Path, expected: str) -> None:
    """The archive is the one uploaded (its sha256 as `run.created` records it)."""
    found = sha256_file(path)
    if found != expected:
        raise StepFailed(
            "checkout",
            f"the uploaded configuration's sha256 {found} differs from the recorded "
            f"{expected}: refusing to run it",
            reason=DIGEST_MISMATCH,
        )


def extract(archive: Path, dest: Path, limits: Limits = Limits()) -> Unpacked:
    """Unpack the tar.gz `archive` into `dest` (created, must not exist), or refuse it."""
    dest.mkdir(mode=0o700)
    try:
        with gzip.open(archive, "rb") as raw:
            stream = _Bounded(raw, limits.unpacked)
            with tarfile.open(fileobj=stream, mode="r|") as tar:  # type: ignore[call-overload]
                done = _extract_members(tar, dest, limits)
    except UnsafeArchive:
        raise
    except (tarfile.TarError, gzip.BadGzipFile, zlib.error, EOFError, OSError) as e:
        raise UnsafeArchive(f"the configuration is not a readable tar.gz: {e}") from e
    linksafe.check_checkout(dest)  # chains of links resolved: none may lead out
    return done


def _extract_members(tar: tarfile.TarFile, dest: Path, limits: Limits) -> Unpacked:
    seen: set[str] = set()
    links: list[tuple[str, str]] = []
    files = dirs = size = 0
    for member in tar:
        if len(seen) >= limits.files:
            raise UnsafeArchive(f"the archive has more than {limits.files} entries")
        name = _member_name(member.name)
        if name == "":  # the archive's root (`./`): dest itself
            continue
        if name in seen:
            raise UnsafeArchive(f"{name!r} appears twice in the archive")
        seen.add(name)
        if member.isdir():
            with _parent(dest, name) as dir_fd:
                _mkdir(dir_fd, posixpath.basename(name), name)
            dirs += 1
        elif member.isreg():
            source = tar.extractfile(member)
            assert source is not None  # a regular member always has data
            with _parent(dest, name) as dir_fd:
                size += _write(dir_fd, posixpath.basename(name), name, source, member.mode)
            files += 1
        elif member.issym():
            links.append((name, _link_target(name, member.linkname)))
        elif member.islnk():
            raise UnsafeArchive(f"{name!r} is a hard link: the archive may hold none")
        else:
            raise UnsafeArchive(f"{name!r} is not a file, directory or symbolic link")
    for name, target in links:  # last: no member was written through one
        with _parent(dest, name) as dir_fd:
            try:
                os.symlink(target, posixpath.basename(name), dir_fd=dir_fd)
            except FileExistsError as e:
                raise UnsafeArchive(f"{name!r} appears twice in the archive") from e
    return Unpacked(files=files, directories=dirs, links=len(links), size=size)


def _member_name(raw: str) -> str:
    """A member's path, relative and normalized; refused if it could leave `dest`."""
    if len(raw) > MAX_NAME or any(ord(c) < 0x20 or c == "\x7f" for c in raw):
        raise UnsafeArchive(f"member name {raw[:80]!r} holds control characters or is too long")
    if raw.startswith("/") or "\\" in raw:
        raise UnsafeArchive(f"{raw[:200]!r} is an absolute path (or a Windows one)")
    parts = [p for p in raw.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafeArchive(f"{raw[:200]!r} climbs out with '..'")
    return "/".join(parts)


def _link_target(name: str, target: str) -> str:
    """A symbolic link's target: relative, and lexically inside the archive's root."""
    if not target or "\x00" in target or target.startswith("/"):
        raise UnsafeArchive(f"{name!r} links to {target!r}: only relative links inside")
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(name), target))
    if joined == ".." or joined.startswith("../") or joined.startswith("/"):
        raise UnsafeArchive(f"{name!r} links to {target!r}, outside the configuration")
    return target


@contextlib.contextmanager
def _parent(dest: Path, name: str) -> Iterator[int]:
    """An open descriptor of `name`'s directory, walked down from `dest` component by
    component without following a link (missing ones made, 0755)."""
    fd = os.open(dest, _DIR_FLAGS)
    try:
        for part in name.split("/")[:-1]:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o755, dir_fd=fd)
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                raise UnsafeArchive(f"{name!r}: {part!r} is not a directory") from e
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def _mkdir(dir_fd: int, base: str, name: str) -> None:
    try:
        os.mkdir(base, 0o755, dir_fd=dir_fd)
    except FileExistsError:
        st = os.stat(base, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafeArchive(f"{name!r} appears twice in the archive") from None


def _write(dir_fd: int, base: str, name: str, source: IO[bytes], mode: int) -> int:
    """Copy one member's data into a new file; its mode without special bits."""
    safe_mode = 0o755 if mode & stat.S_IXUSR else 0o644
    try:
        fd = os.open(base, _NEW_FLAGS, safe_mode, dir_fd=dir_fd)
    except FileExistsError as e:
        raise UnsafeArchive(f"{name!r} appears twice in the archive") from e
    except OSError as e:
        raise UnsafeArchive(f"{name!r} cannot be created: {e.strerror}") from e
    written = 0
    with os.fdopen(fd, "wb") as out:
        while chunk := source.read(_CHUNK):
            out.write(chunk)
            written += len(chunk)
        os.fchmod(out.fileno(), safe_mode)  # the umask aside: exactly this mode
    return written


async def unpack_source(job: Job, step_log: StepLog) -> Commit:
    """The run's uploaded configuration as its checkout (`job.ctx.src`): fetched, opened
    (sealed bound to its bucket and name), checked against its recorded digest, then
    extracted. The commit it answers has no sha: the digest stands for it."""
    ctx = job.ctx
    source = ctx.run.source
    assert source is not None, "only a run with an uploaded configuration unpacks one"
    with linksafe.scratch_dir(ctx.root) as scratch:
        archive = scratch / "configuration.tar.gz"
        try:
            found = await job.tools.custody.vault.download_sealed(
                source.bucket, source.object, archive
            )
        except Tampered as e:
            raise StepFailed(
                "checkout",
                f"the uploaded configuration {source.id} failed authentication ({e})",
                reason=DIGEST_MISMATCH,
            ) from e
        except CryptoError as e:
            raise StepFailed("checkout", f"the uploaded configuration {source.id}: {e}") from e
        if not found:
            raise StepFailed("checkout", f"the uploaded configuration {source.id} is missing")
        await asyncio.to_thread(check_digest, archive, source.digest)
        done = await asyncio.to_thread(extract, archive, ctx.src)
    step_log.note(
        f"unpacked configuration {source.id} (sha256 {source.digest}): {done.files} files, "
        f"{done.directories} directories, {done.links} links, {done.size} bytes"
    )
    return Commit(sha="", author=ctx.run.created_by, message=f"configuration {source.id}")
