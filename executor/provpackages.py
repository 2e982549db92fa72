"""Provider packages and lock files as Terraform has them (executor/providers.py's
inputs): a lock file's provider blocks read and their hashes replaced, a package's `h1:`
(Go's dirhash Hash1), a package unpacked from the operator's zip or directory."""

from __future__ import annotations

import base64
import bisect
import hashlib
import os
import re
import shutil
import stat
import zipfile
from dataclasses import dataclass
from pathlib import Path

from executor import linksafe

LOCK_FILE = ".terraform.lock.hcl"
MAX_LOCK_BYTES = 1024 * 1024  # a lock file larger than this is left to Terraform
_CHUNK = 1024 * 1024
# Each pattern reads within one line (a blank is a space or a tab): the lock file is the
# tenant's, and `\s*`/`.*?` reaching across lines to a close that never comes made a
# megabyte of it hours of the executor's CPU with the GIL held (every phase stalled).
_OPEN = re.compile(r'(?m)^provider[ \t]+"([^"\n]+)"[ \t]*\{')
_CLOSE = re.compile(r"(?m)^\}")
_VERSION = re.compile(r'(?m)^[ \t]*version[ \t]*=[ \t]*"([^"\n]+)"')
_HASHES = re.compile(r"(?m)^[ \t]*hashes[ \t]*=[ \t]*\[")
_HASH = re.compile(r'"((?:h1|zh):[A-Za-z0-9+/=]+)"')
# What Terraform takes for a provider's address and version: nothing else names a path
# under a mirror (a tenant's `../..` would lead the fill out of the operator's mirrors).
_SOURCE = re.compile(r"[a-z0-9](?:[a-z0-9.-]*[a-z0-9])?(?::[0-9]+)?/[A-Za-z0-9_-]+/[a-z0-9_-]+")
_SEMVER = re.compile(r"[0-9]+\.[0-9]+\.[0-9]+(?:-[0-9A-Za-z.-]+)?")


@dataclass(frozen=True)
class Locked:
    """One `provider` block of a lock file."""

    source: str
    version: str
    hashes: frozenset[str]


def _blocks(text: str) -> list[tuple[str, int, int]]:
    """(source, start, end) of each `provider "..." {` block's body (to the first line
    that starts with `}`), in one pass over `text`."""
    closes = [m.start() for m in _CLOSE.finditer(text)]
    found: list[tuple[str, int, int]] = []
    at = 0
    for m in _OPEN.finditer(text):
        if m.start() < at:
            continue  # inside the block before
        i = bisect.bisect_left(closes, m.end())
        if i == len(closes):
            break
        found.append((m.group(1), m.end(), closes[i]))
        at = closes[i] + 1
    return found


def _hash_list(body: str) -> tuple[int, int] | None:
    """(start, end) of the text between `hashes = [` and the first `]` after it."""
    m = _HASHES.search(body)
    if m is None:
        return None
    end = body.find("]", m.end())
    return None if end < 0 else (m.end(), end)


def read_lock(text: str) -> list[Locked]:
    """The provider blocks of a lock file's text (those it can read). None at all if a
    provider is locked twice: Terraform refuses such a file, and each block would hold
    an entry (and a descriptor) of its own."""
    found: list[Locked] = []
    for source, start, end in _blocks(text):
        body = text[start:end]
        version = _VERSION.search(body)
        hashes = _hash_list(body)
        valid = version and _SEMVER.fullmatch(version.group(1)) and _SOURCE.fullmatch(source)
        if valid and version and hashes:
            listed = frozenset(_HASH.findall(body[hashes[0] : hashes[1]]))
            found.append(Locked(source, version.group(1), listed))
    if len({locked.source for locked in found}) < len(found):
        return []
    return found


def rewrite_lock(text: str, served: dict[str, str]) -> str:
    """`text` with the hashes of each provider in `served` (source -> h1) replaced."""
    out: list[str] = []
    at = 0
    for source, start, end in _blocks(text):
        h1 = served.get(source)
        span = _hash_list(text[start:end]) if h1 is not None else None
        if span is None:
            continue
        out += [text[at : start + span[0]], f'\n    "{h1}",\n  ']
        at = start + span[1]
    return "".join([*out, text[at:]])


def h1_of(files: dict[str, Path]) -> str:
    """Terraform's `h1:` (Go's dirhash Hash1) of files by their names in the package."""
    summary = "".join(f"{_sha256(files[n])}  {n}\n" for n in sorted(files))
    return "h1:" + base64.b64encode(hashlib.sha256(summary.encode()).digest()).decode()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def stage_package(source: Path, package: Path) -> str:
    """The package's files from `source` (a zip, or a directory of the unpacked layout)
    into `package`; the zip's `zh:` ("" for a directory)."""
    package.mkdir()
    if source.is_file():
        zh = "zh:" + _sha256(source)
        _extract(source, package)
        return zh
    for src in sorted(source.rglob("*")):
        if src.is_file():
            dest = package / src.relative_to(source)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dest)
            os.chmod(dest, 0o755 if os.access(src, os.X_OK) else 0o644)
    return ""


def _extract(archive: Path, into: Path) -> None:
    """The regular files of a zip (the operator's), never a name leading out of `into`."""
    with zipfile.ZipFile(archive) as zf:
        for info in zf.infolist():
            name = info.filename
            parts = Path(name).parts
            if info.is_dir():
                continue
            if name.startswith("/") or ".." in parts or not parts:
                raise OSError(f"{archive}: entry {name!r} leads out of the package")
            if stat.S_ISLNK(info.external_attr >> 16):
                raise OSError(f"{archive}: entry {name!r} is a link")
            dest = into.joinpath(*parts)
            dest.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(dest, "xb") as out:
                shutil.copyfileobj(src, out, _CHUNK)
            executable = (info.external_attr >> 16) & 0o111 or parts[-1].startswith(
                "terraform-provider-"
            )
            os.chmod(dest, 0o755 if executable else 0o644)


def read_phase_lock(workdir: Path, within: Path) -> str:
    """The working directory's lock file (a regular file, not through a link, at most
    MAX_LOCK_BYTES), or "" (none, too large, not text, a link: left to Terraform, which
    follows a link that stays in the checkout, as it did before the cache)."""
    try:
        with linksafe.open_regular(workdir / LOCK_FILE, within=within, step="init") as f:
            data = f.read(MAX_LOCK_BYTES + 1)
    except (FileNotFoundError, linksafe.UnsafePath):
        return ""
    if len(data) > MAX_LOCK_BYTES:
        return ""
    try:
        return data.decode()
    except UnicodeDecodeError:
        return ""
