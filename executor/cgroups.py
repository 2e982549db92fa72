"""A control group per phase: the kernel's caps on a job's memory and processes, its CPU
time counted, and everything in it killed when the phase ends.

Where the host has them: cgroup v1's `memory`, `pids`, `cpuacct` and `cpu` (the cores
a phase may use at once, its CFS quota) hierarchies (each used if mounted and writable),
else cgroup v2 where the executor's cgroup was delegated (its parent enables `memory`
and `pids` for its children, as systemd's `Delegate=yes` with the executor in a leaf of
its own). A phase's group is
`<the executor's own cgroup>/runplane/<scope>/<phase>` in each hierarchy (v2: beside the
executor's), made before the job starts; each process of the job joins it before it
executes anything (`join`, in the child: a write of "0" to `cgroup.procs` through a file
the executor opened, which the kernel judges by the opener's credentials, root's), so
everything the job starts is in it. When the phase ends, every process in it is killed
and the group removed; a killed executor's groups are removed by the next start on its
work directory (`sweep`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

TOP = "runplane"  # under the executor's own cgroup
# cpu: the CPU time counted (v1's cpuacct, v2's cpu.stat); cpus: the cores a phase may
# use at once (v1's cpu controller, v2's cpu.max), its CFS quota
CONTROLLERS = ("memory", "pids", "cpu", "cpus")
_V1_NAMES = {"memory": "memory", "pids": "pids", "cpu": "cpuacct", "cpus": "cpu"}
CFS_PERIOD_US = 100_000


@dataclass(frozen=True)
class Hierarchy:
    """Where one controller's phase groups go: `base` (the executor's cgroup, or v2's
    delegated parent) in a hierarchy of `version` 1 or 2."""

    controller: str
    version: int
    base: Path


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(mount root, mount point, fs type, super options) of each cgroup mount."""
    out: list[tuple[str, str, str, set[str]]] = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        head, _, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if len(fields) >= 5 and len(rest) >= 3 and rest[0] in ("cgroup", "cgroup2"):
            out.append((fields[3], fields[4], rest[0], set(rest[2].split(","))))
    return out


def _own() -> dict[str, str]:
    """The executor's cgroup per v1 controller name, and "" for v2 (/proc/self/cgroup)."""
    own: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, names, path = line.split(":", 2)
            for name in names.split(",") if names else [""]:
                own[name] = path
    return own


def _under(root: str, point: str, path: str) -> Path:
    rel = path[len(root) :] if root != "/" and path.startswith(root) else path
    return Path(point) / rel.lstrip("/")


def find() -> dict[str, Hierarchy]:
    """The hierarchies this executor can make phase groups in, per controller; those the
    host lacks (or does not let it write) are left out: rlimits stand in for them."""
    own, found = _own(), {}
    for root, point, fstype, opts in _mounts():
        for controller in CONTROLLERS:
            name = _V1_NAMES[controller]
            if fstype == "cgroup" and name in opts and name in own and controller not in found:
                base = _under(root, point, own[name])
                if os.access(base, os.W_OK) and (base / "cgroup.procs").exists():
                    found[controller] = Hierarchy(controller, 1, base)
    for root, point, fstype, _ in _mounts():
        if fstype != "cgroup2" or "" not in own:
            continue
        parent = _under(root, point, own[""]).parent
        try:
            enabled = set((parent / "cgroup.subtree_control").read_text().split())
        except OSError:
            continue
        if {"memory", "pids"} <= enabled and os.access(parent, os.W_OK):
            for controller in CONTROLLERS:
                name = "cpu" if controller == "cpus" else controller  # cpu.stat: always
                if controller not in found and (controller == "cpu" or name in enabled):
                    found[controller] = Hierarchy(controller, 2, parent)
    return found


class PhaseGroup:
    """One phase's groups (one per v1 hierarchy, or one v2 group): its caps set, the
    files its processes join through, and what they used."""

    def __init__(self, hierarchies: dict[str, Hierarchy], scope: str, phase: str) -> None:
        self.dirs: dict[str, Path] = {}
        self._fds: list[int] = []
        for controller, h in hierarchies.items():
            self.dirs[controller] = _make(h, scope) / phase
        try:
            for path in dict.fromkeys(self.dirs.values()):
                path.mkdir(mode=0o755)
        except BaseException:
            self.remove()
            raise
        self.version = {c: h.version for c, h in hierarchies.items()}

    def cap(self, *, memory: int, processes: int, cpus: float = 0.0) -> None:
        """Set the kernel's caps (before any process joins); `cpus` 0: no quota."""
        if "memory" in self.dirs:
            d = self.dirs["memory"]
            if self.version["memory"] == 1:
                _write(d / "memory.limit_in_bytes", memory)
                _write(d / "memory.memsw.limit_in_bytes", memory, missing_ok=True)
            else:
                _write(d / "memory.max", memory)
                _write(d / "memory.swap.max", 0, missing_ok=True)
        if "pids" in self.dirs:
            _write(self.dirs["pids"] / "pids.max", processes)
        if "cpus" in self.dirs and cpus > 0:
            d, quota = self.dirs["cpus"], max(1000, int(cpus * CFS_PERIOD_US))
            if self.version["cpus"] == 1:
                _write(d / "cpu.cfs_period_us", CFS_PERIOD_US)
                _write(d / "cpu.cfs_quota_us", quota)
            else:
                (d / "cpu.max").write_text(f"{quota} {CFS_PERIOD_US}")
        for path in dict.fromkeys(self.dirs.values()):
            self._fds.append(os.open(path / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC))

    def procs_files(self) -> list[Path]:
        """The `cgroup.procs` of each of its groups (a process joins by writing 0 there)."""
        return [path / "cgroup.procs" for path in dict.fromkeys(self.dirs.values())]

    def delegate(self, uid: int) -> bool:
        """Let the phase's own uid join its groups by their paths (executor/spawn.py's
        exec chain, which has no `preexec_fn`): each `cgroup.procs` becomes `uid`'s.
        v1 only (True if done): there a write of 0 moves the writer itself, checked
        against its own uid, and the uid may write into no other group (all root's); v2
        would ask for write access to the groups above too, which stay root's. Its
        directory becomes crossable by the uid's group alone (0710), those of runplane
        and of the executor's scope by anyone (0711: no listing)."""
        if any(version != 1 for version in self.version.values()):
            return False
        for path in dict.fromkeys(self.dirs.values()):
            for above in (path.parent, path.parent.parent):  # <scope>, runplane: crossed
                mode = stat.S_IMODE(os.stat(above).st_mode)  # (0700 under umask 077)
                if mode & 0o011 != 0o011:
                    os.chmod(above, mode | 0o011)
            if any(not os.stat(above).st_mode & 0o001 for above in path.parents):
                return False  # the host's groups above ours: not ours to open
            os.chown(path, 0, uid, follow_symlinks=False)  # its own group's only:
            os.chmod(path, 0o710)  # crossed by the uid, listed and written by none
            os.chown(path / "cgroup.procs", uid, uid, follow_symlinks=False)
        return True

    def join(self) -> None:
        """Put the calling process in the phase's groups: in a child, before exec."""
        for fd in self._fds:
            os.write(fd, b"0")

    def memory_killed(self) -> bool:
        """The kernel killed a process of the phase for its memory cap."""
        d = self.dirs.get("memory")
        if d is None:
            return False
        name = "memory.oom_control" if self.version["memory"] == 1 else "memory.events"
        return _field(d / name, "oom_kill") > 0

    def forks_refused(self) -> bool:
        """A fork of the phase was refused for its processes cap."""
        d = self.dirs.get("pids")
        return d is not None and _field(d / "pids.events", "max") > 0

    def cpu_seconds(self) -> float:
        """The CPU time the phase's processes used (0.0 where it is not counted)."""
        d = self.dirs.get("cpu")
        if d is None:
            return 0.0
        if self.version["cpu"] == 1:
            with contextlib.suppress(OSError, ValueError):
                return int((d / "cpuacct.usage").read_text()) / 1e9
            return 0.0
        return _field(d / "cpu.stat", "usage_usec") / 1e6

    def peak_memory(self) -> int | None:
        """The most memory the phase's processes had in use at once since the last
        `reset_peak` (v1 `memory.max_usage_in_bytes`; v2 `memory.peak`, the phase's
        whole, on kernels that have it); None where it is not counted."""
        d = self.dirs.get("memory")
        if d is None:
            return None
        name = "memory.max_usage_in_bytes" if self.version["memory"] == 1 else "memory.peak"
        with contextlib.suppress(OSError, ValueError):
            return int((d / name).read_text())
        return None

    def reset_peak(self) -> None:
        """Start the peak afresh (a step's own, v1). v2's `memory.peak` is not reset (a
        write resets it only for the writer's descriptor, on 6.12 and later): there a
        step's peak is the phase's so far."""
        d = self.dirs.get("memory")
        if d is not None and self.version["memory"] == 1:
            with contextlib.suppress(OSError):
                (d / "memory.max_usage_in_bytes").write_text("0")

    def pids(self) -> list[int]:
        """The processes in the phase's groups now (each group holds all of them)."""
        for path in self.dirs.values():
            return list(_procs(path))
        return []

    def kill(self) -> int:
        """SIGKILL every process in the groups until none is left; how many were seen."""
        return sum(kill_group(d) for d in dict.fromkeys(self.dirs.values()))

    def remove(self) -> bool:
        """Kill what is left, close the files, remove the groups; True if every group
        was emptied and removed (nothing of the phase runs any more)."""
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        gone = True
        for path in dict.fromkeys(self.dirs.values()):
            kill_group(path)
            gone = _rmdir(path) and gone
        return gone


def _make(h: Hierarchy, scope: str) -> Path:
    """`<base>/runplane/<scope>`, made as needed (v2: each level lets its children have
    the memory, pids and cpu controllers)."""
    path = h.base
    for part in (TOP, scope):
        path = path / part
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o755)
        if part == TOP and h.controller == "cpus":
            _weigh(path, h.version)
        if h.version == 2:
            enabled = (path.parent / "cgroup.subtree_control").read_text().split()
            wanted = [f"+{c}" for c in ("memory", "pids", "cpu") if c in enabled]
            with contextlib.suppress(OSError):
                (path / "cgroup.subtree_control").write_text(" ".join(wanted))
    return path


def job_weight(version: int, cores: int | None = None) -> int:
    """The CPU weight of the group all jobs of the host share (`runplane/`): that of one
    busy process per core. A group weighs as one process against those outside it (by
    default), so every phase of every executor would share one process's turn on a busy
    host: a Terraform run by hand, outside, got twice as much CPU as the same one
    sandboxed at a load of 5 (bench/README.md, overhead). No phase gets more than its
    quota (`--job-cpus`) either way."""
    n = max(1, cores or os.cpu_count() or 1)
    return 1024 * n if version == 1 else min(10_000, 100 * n)


def _weigh(top: Path, version: int) -> None:
    name = "cpu.shares" if version == 1 else "cpu.weight"
    with contextlib.suppress(OSError):  # not ours to weigh (a delegated v2 parent): as is
        (top / name).write_text(str(job_weight(version)))


def kill_group(path: Path) -> int:
    """SIGKILL what is in the group at `path` (v2's `cgroup.kill` where there is one), in
    rounds until it is empty: a fork in flight joins the group, and is killed next."""
    seen = 0
    with contextlib.suppress(OSError):
        (path / "cgroup.kill").write_text("1")
    for _ in range(200):
        pids = list(_procs(path))
        if not pids:
            return seen
        seen += len(pids)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.005)
    log.warning("cgroup_not_emptied", path=str(path))
    return seen


def _procs(path: Path) -> Iterator[int]:
    try:
        text = (path / "cgroup.procs").read_text()
    except OSError:
        return
    for line in text.split():
        if line.isdigit():
            yield int(line)


def _rmdir(path: Path) -> bool:
    """Remove the (emptied) group at `path`; False if it would not go."""
    for _ in range(100):  # an exiting process leaves its group a moment after its SIGKILL
        try:
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            time.sleep(0.01)
    log.warning("cgroup_not_removed", path=str(path))
    return False


def sweep(hierarchies: dict[str, Hierarchy], scope: str) -> int:
    """Kill and remove what a killed executor of `scope` left (its phases' groups); how
    many groups were removed. Only when no other executor lives on the scope."""
    removed = 0
    for h in {h.base: h for h in hierarchies.values()}.values():
        top = h.base / TOP / scope
        if not top.is_dir():
            continue
        for group in [p for p in top.iterdir() if p.is_dir()]:
            kill_group(group)
            _rmdir(group)
            removed += 1
        with contextlib.suppress(OSError):
            top.rmdir()  # a sibling's phase may have made a group in it meanwhile: kept
    return removed


def _write(path: Path, value: int, *, missing_ok: bool = False) -> None:
    try:
        path.write_text(str(value))
    except FileNotFoundError:
        if not missing_ok:
            raise


def _field(path: Path, name: str) -> int:
    """The number after `name` in a flat keyed file (`memory.events`, `pids.events`)."""
    with contextlib.suppress(OSError, ValueError):
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return int(value)
    return 0
