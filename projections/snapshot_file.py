"""A snapshot's stored form: the SQLite file in blocks compressed one by one, so that a
restore inflates them on every core at once (zlib lets go of the GIL).

Each block is `>II` (compressed length, plain length) then that many bytes of zlib
(level 1: fast, and a read model shrinks several times). The manifest's sha256 is of this
stored form, checked as it downloads (cheaper than hashing the larger SQLite file).
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

from projections.replay import _retire

BLOCK = 8 * 1024 * 1024  # plain bytes per block
_HEAD = struct.Struct(">II")


class FileError(ValueError):
    """The stored form is not one (cut short, a length that does not add up, bad zlib)."""


def _compress(block: bytes) -> bytes:
    packed = zlib.compress(block, 1)
    return _HEAD.pack(len(packed), len(block)) + packed


def pack(copy: Path, packed: Path) -> tuple[str, int]:
    """Compress `copy` into `packed` block by block (in parallel); the stored form's
    sha256 and the plain size."""
    h = hashlib.sha256()
    size = 0

    def blocks(f: BinaryIO) -> list[bytes]:
        out = []
        while block := f.read(BLOCK):
            out.append(block)
            if len(out) == 4:
                break
        return out

    with copy.open("rb") as fin, packed.open("wb") as fout, _pool() as pool:
        while batch := blocks(fin):
            for stored in pool.map(_compress, batch):
                h.update(stored)
                fout.write(stored)
            size += sum(len(b) for b in batch)
    return h.hexdigest(), size


def stored_bound(size: int) -> int:
    """The most bytes the stored form of a `size`-byte file can take: zlib's worst case
    (incompressible data grows by a few bytes per 16 KiB, deflateBound) and each block's
    header, with room to spare."""
    blocks = max(1, -(-size // BLOCK))
    return size + (size >> 10) + blocks * (_HEAD.size + 64) + 1024


class HashingSink:
    """A file-like sink for nats-py's `get(writeinto=)`: writes and hashes each chunk,
    and refuses (FileError) to write more than `most` bytes in all (None: no bound)."""

    def __init__(self, out: BinaryIO, most: int | None = None) -> None:
        self.out = out
        self.h = hashlib.sha256()
        self.size = 0
        self.most = most

    def write(self, data: bytes) -> int:
        if self.most is not None and self.size + len(data) > self.most:
            raise FileError(f"the stored object holds more than the {self.most} bytes its file can")
        self.h.update(data)
        self.size += len(data)
        return self.out.write(data)


def unpack(packed: Path, dest: Path, size: int) -> None:
    """Inflate `packed` into `dest` (`size` plain bytes), blocks on every core.

    Whole blocks go to the disk with O_DIRECT where the file system takes it: a new
    file's pages filled through the page cache cost the kernel several times the
    inflating itself (768 MiB: about 4 s of system time against 0.4 s direct, on ext4
    here), and the api reads only the pages it needs afterwards."""
    jobs = _index(packed, size)
    fd_in = os.open(packed, os.O_RDONLY)
    fd_out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    fd_direct = _open_direct(dest)
    local = threading.local()
    try:
        os.ftruncate(fd_out, size)

        def one(job: tuple[int, int, int, int]) -> None:
            at, clen, plen, out_at = job
            try:
                # never more than the block says plus one byte: a block that inflates
                # past its stated length is refused without being inflated whole
                plain = zlib.decompressobj().decompress(os.pread(fd_in, clen, at), plen + 1)
            except zlib.error as e:
                raise FileError(f"block at {at}: {e}") from e
            if len(plain) != plen:
                raise FileError(f"block at {at} is {len(plain)} bytes, not {plen}")
            if fd_direct is not None and _aligned(plen, out_at):
                if not hasattr(local, "buf"):  # page-aligned, as O_DIRECT wants
                    local.buf = mmap.mmap(-1, BLOCK)
                local.buf[:plen] = plain
                with contextlib.suppress(OSError):  # refused after all: the page cache
                    if os.pwrite(fd_direct, memoryview(local.buf)[:plen], out_at) == plen:
                        return
            os.pwrite(fd_out, plain, out_at)

        with _pool() as pool:
            list(pool.map(one, jobs))
    finally:
        os.close(fd_in)
        os.close(fd_out)
        if fd_direct is not None:
            os.close(fd_direct)


_ALIGN = 4096


def _aligned(length: int, offset: int) -> bool:
    return length % _ALIGN == 0 and offset % _ALIGN == 0


def _open_direct(dest: Path) -> int | None:
    """`dest` opened again for O_DIRECT writes, or None where there is no such thing
    (tmpfs, another OS)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(dest, os.O_WRONLY | flag)
    except OSError:
        return None


def _index(packed: Path, size: int) -> list[tuple[int, int, int, int]]:
    """Each block's (offset, compressed length, plain length, offset in the file)."""
    jobs = []
    at = out_at = 0
    end = packed.stat().st_size
    with packed.open("rb") as f:
        while at < end:
            head = f.read(_HEAD.size)
            if len(head) != _HEAD.size:
                raise FileError("cut short in a block's header")
            clen, plen = _HEAD.unpack(head)
            if plen > BLOCK or at + _HEAD.size + clen > end:
                raise FileError(f"block at {at} does not fit")
            jobs.append((at + _HEAD.size, clen, plen, out_at))
            at += _HEAD.size + clen
            out_at += plen
            f.seek(at)
    if out_at != size:
        raise FileError(f"the blocks hold {out_at} bytes, not {size}")
    return jobs


def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2))


# ---------------------------------------------------------------- in place, synced later


def unsynced(db: Path) -> Path:
    """The marker of a restored read model not yet known to be on disk."""
    return db.with_name(f"{db.name}.unsynced")


def put_in_place(scratch: Path, db: Path) -> None:
    """Rename the restored file over `db` without waiting for its hundreds of megabytes
    to reach the disk: the marker, durable first, says it may not have (`settle` takes it
    away once they have; `discard_unsynced` at the next start removes a file an OS crash
    may have left half written)."""
    unsynced(db).touch()
    _fsync_dir(db.parent)
    if db.exists():
        _retire(db)
    os.replace(scratch, db)
    for suffix in ("-wal", "-shm"):  # leftovers of the old file must not pair with the new
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    _fsync_dir(db.parent)


def settle(db: Path) -> None:
    """The restored file is on disk: its marker goes."""
    fd = os.open(db, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    unsynced(db).unlink(missing_ok=True)
    _fsync_dir(db.parent)


def discard_unsynced(db: Path) -> bool:
    """Remove a restored read model whose `settle` never ran (the process or the machine
    died first); True if there was one."""
    if not unsynced(db).exists():
        return False
    for path in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
        path.unlink(missing_ok=True)
    unsynced(db).unlink()
    _fsync_dir(db.parent)
    return True


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
