"""Hostile configuration uploads: a tar.gz from the CLI unpacks inside the run's checkout,
or not at all (executor/upload.py).

Each attack is checked twice: against a naive extractor (`tarfile.extractall` trusting
the archive, as a hurried implementation would call it), where it must do its harm, so
the attack is real; and against `extract`, which must refuse it with `unsafe_archive`
and leave nothing outside the destination.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from executor.errors import StepFailed
from executor.linksafe import UNSAFE_SYMLINK
from executor.objects import sha256_file
from executor.upload import (
    DIGEST_MISMATCH,
    UNSAFE_ARCHIVE,
    Limits,
    UnsafeArchive,
    check_digest,
    extract,
)

Member = tuple[tarfile.TarInfo, bytes | None]


def _file(name: str, data: bytes = b"x", mode: int = 0o644) -> Member:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    return info, data


def _dir(name: str) -> Member:
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.DIRTYPE, 0o755
    return info, None


def _link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> Member:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, None


def _device(name: str) -> Member:
    info = tarfile.TarInfo(name)
    info.type, info.devmajor, info.devminor, info.mode = tarfile.CHRTYPE, 1, 3, 0o666
    return info, None


def _archive(path: Path, members: list[Member]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _naive(archive: Path, dest: Path) -> None:
    dest.mkdir()
    with tarfile.open(archive, "r:gz") as tar:
        tar.extractall(dest, filter="fully_trusted")


class Case:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.outside = tmp / "outside"
        self.outside.mkdir(parents=True)
        self.secret = self.outside / "secret"
        self.secret.write_text("the executor's own")


Attack = tuple[Callable[[Case], list[Member]], Callable[[Case, Path], bool], Limits]

# name -> (members, "did the harm happen" after a naive extraction into dest, limits)
ATTACKS: dict[str, Attack] = {
    "absolute path": (
        lambda c: [_file(str(c.outside / "planted"), b"pwned")],
        lambda c, dest: (c.outside / "planted").exists(),
        Limits(),
    ),
    "dot-dot": (
        lambda c: [_file("../outside/planted", b"pwned")],
        lambda c, dest: (c.outside / "planted").exists(),
        Limits(),
    ),
    "symlink out, then a file through it": (
        lambda c: [_link("evil", str(c.outside)), _file("evil/planted", b"pwned")],
        lambda c, dest: (c.outside / "planted").exists(),
        Limits(),
    ),
    "relative symlink out": (
        lambda c: [_link("main.tf", "../outside/secret")],
        lambda c, dest: (dest / "main.tf").read_text() == "the executor's own",
        Limits(),
    ),
    "symlink chain out": (
        # d/up -> .. is the root (inside); esc -> d/up/.. reads as `d` lexically, but
        # through the link it is the root's parent
        lambda c: [_dir("d"), _link("d/up", ".."), _link("esc", "d/up/../outside/secret")],
        lambda c, dest: (dest / "esc").read_text() == "the executor's own",
        Limits(),
    ),
    "hard link out": (
        lambda c: [_link("main.tf", str(c.secret), tarfile.LNKTYPE)],
        lambda c, dest: os.stat(dest / "main.tf").st_ino == os.stat(c.secret).st_ino,
        Limits(),
    ),
    "device file": (
        lambda c: [_device("null")],
        lambda c, dest: stat.S_ISCHR(os.lstat(dest / "null").st_mode),
        Limits(),
    ),
    "setuid bit": (
        lambda c: [_file("tool", b"#!/bin/sh\n", mode=0o4755)],
        lambda c, dest: bool(os.stat(dest / "tool").st_mode & stat.S_ISUID),
        Limits(),  # kept as a file, its special bits dropped: checked apart below
    ),
    "decompression bomb": (
        lambda c: [_file("zeros", bytes(8 * 1024 * 1024))],
        lambda c, dest: (dest / "zeros").stat().st_size > 1024 * 1024,
        Limits(unpacked=1024 * 1024),
    ),
    "too many files": (
        lambda c: [_file(f"f{i}.tf") for i in range(101)],
        lambda c, dest: len(list(dest.iterdir())) > 100,
        Limits(files=100),
    ),
}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_attack_harms_a_naive_extractor_and_is_refused(tmp_path: Path, name: str) -> None:
    members, harmed, limits = ATTACKS[name]
    if name == "device file" and os.geteuid() != 0:
        pytest.skip("making a device needs root")
    naive_case = Case(tmp_path / "naive")
    archive = _archive(tmp_path / "naive.tar.gz", members(naive_case))
    _naive(archive, naive_case.tmp / "dest")
    assert harmed(naive_case, naive_case.tmp / "dest"), "the attack is not one"

    case = Case(tmp_path / "ours")
    archive = _archive(tmp_path / "ours.tar.gz", members(case))
    before = sorted(p.name for p in case.outside.iterdir())
    dest = case.tmp / "dest"
    if name == "setuid bit":
        extract(archive, dest, limits)
        mode = os.stat(dest / "tool").st_mode
        assert stat.S_IMODE(mode) == 0o755, oct(mode)
        return
    with pytest.raises(StepFailed) as raised:
        extract(archive, dest, limits)
    assert raised.value.reason in (UNSAFE_ARCHIVE, UNSAFE_SYMLINK), raised.value
    assert sorted(p.name for p in case.outside.iterdir()) == before
    assert case.secret.read_text() == "the executor's own"


def test_a_plain_configuration_unpacks(tmp_path: Path) -> None:
    members = [
        _dir("./"),
        _file("./main.tf", b'resource "null_resource" "a" {}\n'),
        _dir("./modules/net"),
        _file("./modules/net/main.tf", b"# module\n"),
        _file("./run.sh", b"#!/bin/sh\n", mode=0o775),
        _link("./modules/current", "net"),
        _link("./modules/net/root.tf", "../../main.tf"),
    ]
    archive = _archive(tmp_path / "c.tar.gz", members)
    done = extract(archive, tmp_path / "src")
    src = tmp_path / "src"
    assert (src / "main.tf").read_bytes().startswith(b"resource")
    assert (src / "modules/current/main.tf").read_text() == "# module\n"
    assert (src / "modules/net/root.tf").read_bytes() == (src / "main.tf").read_bytes()
    assert stat.S_IMODE(os.stat(src / "run.sh").st_mode) == 0o755
    assert stat.S_IMODE(os.stat(src / "main.tf").st_mode) == 0o644
    assert (done.files, done.directories, done.links) == (3, 1, 2)  # modules/ made on the way


def test_a_name_given_twice_is_refused(tmp_path: Path) -> None:
    # the second copy could replace a file after it was checked, or a dir by a link
    archive = _archive(tmp_path / "c.tar.gz", [_dir("sub"), _file("a"), _link("sub", "x")])
    with pytest.raises(UnsafeArchive, match="twice"):
        extract(archive, tmp_path / "src")


def test_a_file_under_a_link_is_refused(tmp_path: Path) -> None:
    # a link inside made first, then a file written "through" it: links come last
    archive = _archive(tmp_path / "c.tar.gz", [_dir("real"), _link("l", "real"), _file("l/f")])
    with pytest.raises(UnsafeArchive):
        extract(archive, tmp_path / "src")
    assert not (tmp_path / "src/real/f").exists()


def test_not_an_archive_is_a_clear_refusal(tmp_path: Path) -> None:
    path = tmp_path / "c.tar.gz"
    path.write_bytes(b"not gzip at all")
    with pytest.raises(UnsafeArchive, match="not a readable tar"):
        extract(path, tmp_path / "src")


def test_a_changed_archive_fails_its_digest(tmp_path: Path) -> None:
    archive = _archive(tmp_path / "c.tar.gz", [_file("main.tf")])
    digest = sha256_file(archive)
    check_digest(archive, digest)
    archive.write_bytes(archive.read_bytes() + b"\0")
    with pytest.raises(StepFailed) as raised:
        check_digest(archive, digest)
    assert raised.value.reason == DIGEST_MISMATCH
