"""The executor host's provider cache: each provider package a lock file names, unpacked
once, verified against the lock file's hashes, and read-only to every job.

Terraform's own `plugin_cache_dir` is not shareable between tenants: the job's Terraform
writes it, so one organization's job could leave a package another's run then executes.
This cache is written by the executor only, outside any job, from the operator's mirrors
only (`--provider-mirror` and the bundled one: never a path of a checkout), and it is
root's (0755 directories, 0644/0755 files): under the uid mode no job uid may write it,
under the sandbox it is a read-only bind besides.

An entry is keyed by the package's content (`h1:` of its unpacked files, with the source,
version and platform): `entries/<key>/package/` holds the files, `manifest.json` their
hashes (`h1:`, and the archive's `zh:`) and each file's size, mtime, ctime and inode as
filled. Before each use the files are checked against that record (any write changes
ctime: a changed entry is removed and filled again, never used), and hashed in full once
per executor life.

A phase whose working directory has a `.terraform.lock.hcl` gets, before `terraform
init`, a mirror of its own (in its phase directory, the executor's) that links each
locked provider the operator's mirrors hold to the entry one of the lock file's hashes
names, filled first if absent. A locked provider whose hashes name no package of the
mirrors fails `init` before Terraform starts (`provider_hash_mismatch`).

Terraform 1.0 hashes every package in full on each `init` (twice) and each `plan` and
`apply` (once), at ~400 MB/s: a 200 MB provider costs ~1 s per init however it is
installed. So what Terraform is shown of an entry is a launcher (`launcher/`: a two-line
`sh` script that execs the verified `package/` binary), and the lock file Terraform
reads names the launcher's `h1:` for the providers served so: the executor has checked
the tenant's own hashes against the package (above), and Terraform checks that it runs
the executor's launcher. A lock file without providers, or one this module cannot read,
is left to Terraform as before (its mirrors, its own checks). The launcher names its
binary by a path relative to itself, so its `h1:` is the same on every executor host
(a plan and its apply may run on two).

The lock file is the tenant's: only addresses and versions Terraform would take name a
path under a mirror (executor/provpackages.py). A phase holds its entries (a shared
`flock`, taken before the entry is checked or put in place) until its directory is gone;
past `max_bytes`, the least recently used entries no phase holds are removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from executor import linksafe
from executor.errors import StepFailed
from executor.provpackages import (
    LOCK_FILE,
    Locked,
    h1_of,
    read_lock,
    read_phase_lock,
    rewrite_lock,
    stage_package,
)

log = structlog.get_logger(__name__)

HASH_MISMATCH = "provider_hash_mismatch"
DEFAULT_MAX_BYTES = 10 * 1024**3
MAX_SERVED = 64  # providers one phase is served from the cache (and holds)
_CHUNK = 1024 * 1024
_LAUNCHER = '#!/bin/sh\nexec "${0%/*}/../package/NAME" "$@"\n'


class ProviderMismatch(StepFailed):
    """A locked provider whose lock-file hashes match no package of the mirrors."""

    def __init__(self, message: str) -> None:
        super().__init__("init", message, reason=HASH_MISMATCH)


@dataclass(frozen=True)
class Entry:
    """A filled, checked cache entry."""

    key: str
    path: Path
    h1: str
    zh: str  # "" for a package of an unpacked mirror
    launcher_h1: str
    fresh: bool = False  # unpacked by this call
    origin: str = ""  # the mirror's package it was unpacked from (`_identity`)


def _key(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:40]


@dataclass
class ProviderCache:
    """The cache in `root` (see the module's docstring), filled from `mirrors` (the
    operator's, in either layout), at most `max_bytes` of entries."""

    root: Path
    mirrors: Sequence[Path]
    max_bytes: int = DEFAULT_MAX_BYTES
    platform: str = "linux_amd64"
    fills: int = 0  # entries this process filled (tests, logs)
    unpacks: int = 0  # packages it unpacked, a refused one too
    _verified: set[str] = field(default_factory=set)
    # a zip's hashes by its identity (path, size, mtime, ctime, inode): a lock file naming
    # neither is refused without unpacking it again
    _known: dict[str, tuple[str, str]] = field(default_factory=dict)
    _held: dict[Path, list[int]] = field(default_factory=dict)
    # phases' inits run in threads at once (`asyncio.to_thread`): `_held` is theirs to share
    _holding: threading.Lock = field(default_factory=threading.Lock)

    def open(self) -> ProviderCache:
        """Make the cache's directories: root's, readable by all, writable by it alone
        (and the parents it makes crossable: a job's uid reads the entries). Every
        directory above it must be this user's or root's and writable by no one else
        (or sticky): whoever may rename the cache's directory may put a cache of their
        own in its place, which the stat checks would take for the verified one."""
        root = Path(os.path.abspath(self.root))
        chain = (root, *root.parents)
        missing = [p for p in chain if not os.path.lexists(p)]
        _check_above(chain[len(missing)])
        for path in reversed(missing):
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, 0o700)
            _check_dir(path)  # ours, not a link (another's made in between)
            os.chmod(path, 0o755)
        for sub, mode in (("", 0o755), ("entries", 0o755), ("locks", 0o700), ("tmp", 0o700)):
            path = self.root / sub
            path.mkdir(parents=True, exist_ok=True)
            _check_dir(path)
            os.chmod(path, mode)
        return self

    # ------------------------------------------------------------ a phase

    def serve(self, workdir: Path, phase_root: Path, text: str) -> dict[str, Entry]:
        """Entries for the providers `text` (the phase's lock file) locks that the mirrors
        hold, each held until `release(phase_root)`; their links made in
        `phase_root/providers` (a mirror of the phase's own). ProviderMismatch if a
        locked package's hashes match none of the mirrors' package. At most MAX_SERVED
        providers: the rest are left to Terraform (a lock file naming every provider of a
        large mirror held an entry and a descriptor each, past the bound and the
        executor's descriptor limit)."""
        self._release_dead()
        served: dict[str, Entry] = {}
        for locked in read_lock(text):
            if len(served) >= MAX_SERVED:
                break
            entry = self.entry(locked, phase_root)
            if entry is None:
                continue
            served[locked.source] = entry
            link = phase_root / "providers" / locked.source / locked.version / self.platform
            link.parent.mkdir(parents=True, exist_ok=True)
            for d in _parents(link.parent, phase_root):
                os.chmod(d, 0o755)
            with contextlib.suppress(FileNotFoundError):
                link.unlink()  # this phase's init again
            link.symlink_to(entry.path / "launcher")
        return served

    def entry(self, locked: Locked, phase_root: Path) -> Entry | None:
        """The checked entry of `locked`'s package (filled now if absent or changed), held
        for the phase; None if no mirror holds that provider version. An entry is served
        only while this executor's mirrors hold the very package it came from: a build
        the operator withdrew (or one only another executor's mirrors hold, the cache
        shared) is not served from the cache, and Terraform's own install refuses it."""
        source = self._package(locked)
        origin = _identity(source) if source is not None else None
        if source is None or origin is None:
            return None
        for h in sorted(locked.hashes):
            key = self._alias(locked, h)
            if key and (entry := self._held_entry(locked, key, origin, phase_root)) is not None:
                return entry
        return self._fill(locked, source, origin, phase_root)

    def _held_entry(self, locked: Locked, key: str, origin: str, phase_root: Path) -> Entry | None:
        """The entry `key`, held for the phase (no eviction takes it from under it), if it
        is as filled and one of the lock file's hashes is its package's."""
        fd = self._lock(key)
        entry = self._checked(key)
        if entry is None or entry.origin != origin or not ({entry.h1, entry.zh} & locked.hashes):
            os.close(fd)
            return None
        self._hold(phase_root, fd)
        return entry

    def _hold(self, phase_root: Path, fd: int) -> None:
        with self._holding:
            self._held.setdefault(phase_root, []).append(fd)

    def release(self, phase_root: Path) -> None:
        with self._holding:
            fds = self._held.pop(phase_root, [])
        for fd in fds:
            os.close(fd)

    # ------------------------------------------------------------ entries

    def _alias_path(self, locked: Locked, h: str) -> Path:
        """Where the key of the entry `h` (an `h1:` or `zh:`) names is kept."""
        name = _key(locked.source, locked.version, self.platform, h)
        return self.root / "entries" / f"{name}.key"

    def _alias(self, locked: Locked, h: str) -> str:
        with contextlib.suppress(OSError):
            return self._alias_path(locked, h).read_text().strip()
        return ""

    def _checked(self, key: str) -> Entry | None:
        """The entry `key` if it is as filled (stat of every file; in full once per life),
        else None (and a changed one removed)."""
        path = self.root / "entries" / key
        try:
            manifest = json.loads((path / "manifest.json").read_text())
            same = all(_stat(path / rel) == list(was) for rel, was in manifest["files"].items())
            if same and key not in self._verified:
                files = {n: path / "package" / n for n in manifest["package"]}
                launcher = [path / rel for rel in manifest["files"] if rel.startswith("launcher/")]
                same = h1_of(files) == manifest["h1"] and len(launcher) == 1
                same = same and h1_of({launcher[0].name: launcher[0]}) == manifest["launcher_h1"]
        except (OSError, ValueError, KeyError, TypeError):
            same, manifest = False, {}
        if not same:
            if path.exists():
                log.warning("provider_cache_entry_changed", entry=key, action="removed, refilled")
                self._remove(key)
            return None
        self._verified.add(key)
        os.utime(path / "manifest.json", follow_symlinks=False)  # its use, for eviction
        origin = str(manifest.get("origin", ""))
        return Entry(
            key, path, manifest["h1"], manifest["zh"], manifest["launcher_h1"], origin=origin
        )

    def _package(self, locked: Locked) -> Path | None:
        host_ns_type = Path(locked.source)
        name = host_ns_type.name
        for mirror in self.mirrors:
            base = Path(mirror) / host_ns_type
            packed = base / f"terraform-provider-{name}_{locked.version}_{self.platform}.zip"
            if packed.is_file():
                return packed
            if (base / locked.version / self.platform).is_dir():
                return base / locked.version / self.platform
        return None

    def _fill(self, locked: Locked, source: Path, origin: str, phase_root: Path) -> Entry | None:
        known = self._known.get(origin)
        if known is not None and not (set(known) & locked.hashes):
            raise _mismatch(locked, *known)  # that very zip was unpacked: nothing to learn
        fill_lock = self.root / "locks" / f"fill-{_key(locked.source, locked.version)}"
        with _flock(fill_lock, fcntl.LOCK_EX):
            for h in sorted(locked.hashes):  # a sibling filled it while we waited
                key = self._alias(locked, h)
                if key and (entry := self._held_entry(locked, key, origin, phase_root)):
                    return entry
            staging = Path(tempfile.mkdtemp(dir=self.root / "tmp"))
            try:
                return self._unpack(locked, source, origin, staging, phase_root)
            except OSError as e:  # a package we cannot unpack: Terraform's own install
                log.warning("provider_cache_fill_failed", source=locked.source, error=repr(e))
                return None
            finally:
                shutil.rmtree(staging, ignore_errors=True)

    def _unpack(
        self, locked: Locked, source: Path, origin: str, staging: Path, phase_root: Path
    ) -> Entry:
        """Unpack `source` (whose identity is `origin`) into `staging`, check it against
        the lock, make it an entry (held for the phase before it is in place)."""
        self.unpacks += 1
        package = staging / "package"
        zh = stage_package(source, package)
        files = {p.relative_to(package).as_posix(): p for p in package.rglob("*") if p.is_file()}
        h1 = h1_of(files)
        self._known[origin] = (h1, zh)
        if not ({h1, zh} & locked.hashes):
            raise _mismatch(locked, h1, zh)
        exe, launcher_h1 = _launcher(locked, files, staging)
        key = _key(locked.source, locked.version, self.platform, h1)
        stats = {f"package/{n}": _stat(p) for n, p in files.items()}
        stats[f"launcher/{exe}"] = _stat(staging / "launcher" / exe)
        record: dict[str, object] = {"source": locked.source, "version": locked.version}
        record["platform"] = self.platform
        record |= {"h1": h1, "zh": zh, "launcher_h1": launcher_h1, "package": sorted(files)}
        record["origin"] = origin
        (staging / "manifest.json").write_text(json.dumps({**record, "files": stats}))
        os.chmod(staging / "manifest.json", 0o644)
        target = self.root / "entries" / key
        held = self._lock(key)
        self._hold(phase_root, held)
        if target.exists():
            self._remove(key)  # not as filled (else `entry` had found it)
        os.rename(staging, target)
        for h in filter(None, (h1, zh)):
            alias = self._alias_path(locked, h)
            tmp = alias.with_name(f".{alias.name}.{os.getpid()}")
            tmp.write_text(key)
            os.chmod(tmp, 0o644)
            os.replace(tmp, alias)
        self.fills += 1
        self._verified.add(key)
        log.info("provider_cached", source=locked.source, version=locked.version, h1=h1, entry=key)
        self._evict(keep=key)
        return Entry(key, target, h1, zh, launcher_h1, fresh=True, origin=origin)

    def _remove(self, key: str) -> None:
        path = self.root / "entries" / key
        trash = Path(tempfile.mkdtemp(dir=self.root / "tmp"))
        with contextlib.suppress(OSError):
            os.rename(path, trash / key)
        shutil.rmtree(trash, ignore_errors=True)

    # ------------------------------------------------------------ bound and holds

    def _lock(self, key: str) -> int:
        """A shared lock on entry `key`: no eviction removes it while it is held."""
        fd = os.open(self.root / "locks" / key, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd

    def _release_dead(self) -> None:
        with self._holding:  # another phase's thread adds its holds meanwhile
            roots = list(self._held)
        for root in [r for r in roots if not r.exists()]:
            self.release(root)

    def size(self) -> int:
        return sum(size for _, size, _ in self._entries())

    def _entries(self) -> Iterator[tuple[str, int, float]]:
        for path in (self.root / "entries").iterdir():
            with contextlib.suppress(OSError, ValueError, KeyError):
                if path.is_dir():
                    manifest = json.loads((path / "manifest.json").read_text())
                    used = os.stat(path / "manifest.json").st_mtime
                    yield path.name, sum(v[0] for v in manifest["files"].values()), used

    def _evict(self, keep: str) -> None:
        """Remove the least recently used entries no phase holds while over the bound."""
        self._release_dead()
        entries = sorted(self._entries(), key=lambda e: e[2])
        total = sum(size for _, size, _ in entries)
        for key, size, _ in entries:
            if total <= self.max_bytes:
                return
            if key == keep:
                continue
            lock = self.root / "locks" / key
            with contextlib.suppress(BlockingIOError), _flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB):
                self._remove(key)
                total -= size
                log.info("provider_cache_evicted", entry=key, bytes=size)


def _check_dir(path: Path) -> None:
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise OSError(f"{path} is not a directory of this user's (a link, or another's)")


def _check_above(path: Path) -> None:
    """`path` and each directory above it, as named and as resolved: this user's or
    root's, and writable by no one else unless sticky (no one else renames in it)."""
    real = Path(os.path.realpath(path))
    for here in sorted({path, *path.parents, real, *real.parents}):
        st = os.lstat(here)
        if st.st_uid not in (0, os.geteuid()):
            raise OSError(f"{here} (above the provider cache) is another user's")
        if stat.S_ISDIR(st.st_mode) and st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise OSError(f"{here} (above the provider cache) is writable by others")


def _launcher(locked: Locked, files: dict[str, Path], staging: Path) -> tuple[str, str]:
    """Write the entry's launcher beside its package; (the executable's name, the
    launcher's `h1:`). The entry's directories are opened to all (read, cross)."""
    package = staging / "package"
    prefix = f"terraform-provider-{Path(locked.source).name}"
    exe = next((n for n in sorted(files) if n.startswith(prefix)), "")
    if not exe or "/" in exe:
        raise ProviderMismatch(f"the package of {locked.source} {locked.version} has no executable")
    launcher = staging / "launcher"
    launcher.mkdir()
    (launcher / exe).write_text(_LAUNCHER.replace("NAME", exe))
    os.chmod(launcher / exe, 0o755)
    for d in (staging, package, launcher, *(p for p in package.rglob("*") if p.is_dir())):
        os.chmod(d, 0o755)
    return exe, h1_of({exe: launcher / exe})


def _mismatch(locked: Locked, h1: str, zh: str) -> ProviderMismatch:
    return ProviderMismatch(
        f"the lock file's hashes for {locked.source} {locked.version} match no "
        f"package of the executor's provider mirrors (theirs is {h1}"
        + (f", {zh}" if zh else "")
        + "): refusing to install it. Run `terraform init` against the same "
        "mirror to record the right hashes, or ask the operator which build it holds."
    )


def _identity(source: Path) -> str | None:
    """A digest of a package's path and stat: a zip's, or each file of a directory's (so
    that a lock file naming other hashes is refused without copying and hashing it again
    on every init, the executor's CPU and disk, outside any job's caps; and so that an
    entry is served only while the mirror holds the package it came from). None if it
    cannot be read."""
    try:
        found: list[object] = [str(source)]
        if source.is_file():
            st = os.stat(source)
            found.append((st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
        else:
            for path in sorted(source.rglob("*")):
                if path.is_file():  # as stage_package reads them: through links
                    st = os.stat(path)
                    rel = path.relative_to(source).as_posix()
                    found.append((rel, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
    except OSError:
        return None
    return hashlib.sha256(repr(found).encode()).hexdigest()


def _stat(path: Path) -> list[int]:
    st = os.lstat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_mode, st.st_uid]


def _parents(path: Path, top: Path) -> Iterable[Path]:
    while path != top and path.is_relative_to(top):
        yield path
        path = path.parent


@contextlib.contextmanager
def _flock(path: Path, how: int) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, how)
        yield
    finally:
        os.close(fd)


def use_cache(cache: ProviderCache, workdir: Path, src: Path, phase_root: Path) -> dict[str, Entry]:
    """Serve the phase's locked providers from `cache` (module docstring): the entries
    linked in the phase's own mirror and the lock file Terraform reads rewritten to
    their launchers. {} (nothing changed) when there is no lock file it can read."""
    text = read_phase_lock(workdir, src)
    if not text:
        return {}
    served = cache.serve(workdir, phase_root, text)
    if served:
        launchers = {source: entry.launcher_h1 for source, entry in served.items()}
        data = rewrite_lock(text, launchers).encode()
        linksafe.write_new(workdir / LOCK_FILE, data, within=src, step="init", mode=0o644)
    return served
