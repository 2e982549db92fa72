"""Caps per job: memory, processes, CPU time and cores, disk and files of its
directory, and its tmpfs.

Each is a deployment setting (`--job-memory`, `--job-processes`, `--job-cpu-seconds`,
`--job-cpus`, `--job-disk`, `--job-files`, `--job-tmpfs`), the most any phase of this
executor gets. How each is held (said at start, `job_caps`):

- memory and processes: the phase's control group (executor/cgroups.py) where the host
  has one, the kernel's own caps on the whole phase; else rlimits, per process
  (RLIMIT_DATA) and per uid (RLIMIT_NPROC: a uid is the phase's alone). On cgroup v1
  without `memory.memsw` swap is not counted (said at start).
- CPU time: the phase's group counts it (v1 cpuacct, v2 cpu.stat) and the watch kills the
  phase past the cap; RLIMIT_CPU caps each process besides (SIGXCPU). Cores at once: the
  group's CFS quota (v1 cpu, v2 cpu.max), so that one job cannot take every core.
- disk of the job's directory (its checkout, home, logs and TMPDIR): a watch walks them
  every `WATCH_S` and at each step's end and kills the phase past the cap; RLIMIT_FSIZE
  holds each file to the cap meanwhile. Files the job's processes hold open after
  unlinking them count too (executor/diskuse.py: no walk finds them). Why a watch and
  not a quota: it works on every host and file system, costs no mount per phase and no
  memory (a tmpfs job directory would spend the host's RAM on checkouts and providers,
  and be charged to the job's memory cap); a loop device or project quota per phase
  needs a file system set up for it. What it gives up: a job may write past the cap for
  up to `WATCH_S` (at disk speed) before it is killed.
- files: the inodes (files, directories, links) the walk finds. Empty files take no
  blocks, but inodes, and each walk's time: the walk stops past the cap, and the phase is
  killed. RLIMIT_NOFILE (`NOFILE`) bounds the descriptors each process has, which the
  watch reads for unlinked files.
- tmpfs (the sandbox's `/tmp`, `/var/tmp`, `/run`, `/dev/shm`): each mount's own size;
  the sandbox's init tells whether one was full when the job ended (a write refused).

A job over a cap has its processes killed and its step fails with
`resource_limit_exceeded: <cap> <value>`; the executor, the host and other jobs go on.
"""

from __future__ import annotations

import resource
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from executor.cgroups import Hierarchy, PhaseGroup
from executor.cgroups import find as find_cgroups
from executor.cgroups import sweep as sweep_cgroups
from executor.diskuse import devices, open_deleted, pids_of_uid, walk
from infra.sizes import say_size

REASON = "resource_limit_exceeded"
# Descriptors per process of a job: the kernel's default soft limit, which Terraform and
# its providers run with on most hosts. It bounds what the watch reads for unlinked files
# (processes x NOFILE links, each second): 512 x 1024 take ~2 s of a loaded core; with
# Go's raise of its soft limit to a systemd host's hard one (524288) a job could make
# each look cost minutes.
NOFILE = 1024
MEMSW = "memory.memsw.limit_in_bytes"  # cgroup v1's memory and swap cap
WATCH_S = 1.0  # how often a running phase's disk and CPU time are looked at
SIGXCPU, SIGXFSZ = 24, 25
_EXIT = {-SIGXCPU: "cpu", 128 + SIGXCPU: "cpu", -SIGXFSZ: "disk", 128 + SIGXFSZ: "disk"}


@dataclass(frozen=True, kw_only=True)
class JobCaps:
    """The most one phase's processes may use (module docstring)."""

    memory: int = 2 * 1024**3
    processes: int = 512  # tasks: a thread counts, as the kernel counts them
    cpu_seconds: int = 3600
    disk: int = 10 * 1024**3
    tmpfs: int = 256 * 1024**2  # each of the sandbox's four
    files: int = 200_000  # inodes under the job's directories
    cpus: float = 2.0  # cores at once (0: no quota)

    def said(self, cap: str) -> str:
        """`memory 2 GiB`, `processes 512`, `cpu 3600 s`, `files 200000`."""
        if cap in ("processes", "files"):
            return f"{cap} {getattr(self, cap)}"
        if cap == "cpus":
            return f"cpus {self.cpus:g}"
        if cap == "cpu":
            return f"cpu {self.cpu_seconds} s"
        return f"{cap} {say_size(getattr(self, cap))}"


@dataclass(frozen=True)
class Exceeded:
    """A cap a phase went over."""

    cap: str
    caps: JobCaps
    detail: str = ""

    @property
    def message(self) -> str:
        extra = f" ({self.detail})" if self.detail else ""
        return f"{REASON}: {self.caps.said(self.cap)}{extra}"


@dataclass(frozen=True)
class Enforcement:
    """How this executor holds its jobs' caps: the control groups it found, rlimits for
    the rest."""

    caps: JobCaps = JobCaps()
    cgroups: dict[str, Hierarchy] = field(default_factory=dict)

    @classmethod
    def find(cls, caps: JobCaps, *, cgroups: bool = True) -> Enforcement:
        """`cgroups=False`: rlimits only (the fallback, also for its tests)."""
        return cls(caps, find_cgroups() if cgroups else {})

    def mechanisms(self, *, sandbox: bool) -> dict[str, str]:
        """Which mechanism holds each cap (logged at start)."""

        def group(c: str) -> str:
            h = self.cgroups.get(c)
            return f"cgroup v{h.version} {h.base}" if h else ""

        caps, memory = self.caps, self.cgroups.get("memory")
        if memory and memory.version == 1 and not (memory.base / MEMSW).exists():
            swap = " (not swap: no memory.memsw, the kernel's swapaccount is off)"
        else:
            swap = ""
        return {
            caps.said("memory"): (group("memory") + swap) or "RLIMIT_DATA per process",
            caps.said("cpus"): group("cpus") if caps.cpus > 0 and group("cpus") else "no quota",
            caps.said("processes"): group("pids") or "RLIMIT_NPROC of the job's uid",
            caps.said("cpu"): " + ".join(
                x for x in (group("cpu") and f"{group('cpu')} (watched)", "RLIMIT_CPU") if x
            ),
            caps.said("disk"): f"a watch of the job's directory every {WATCH_S:g} s (files held "
            "open after their unlink too) + RLIMIT_FSIZE",
            caps.said("files"): f"the same watch (it stops past the cap) + RLIMIT_NOFILE {NOFILE}",
            caps.said("tmpfs"): "tmpfs size (each of /tmp, /var/tmp, /run, /dev/shm)"
            if sandbox
            else "not held: the uid mode has no private tmpfs (the host's /tmp is swept)",
        }

    def unheld(self, why: str) -> dict[str, str]:
        """Each cap said not held for `why`, but the sandbox's tmpfs size (the bwrap mode)."""
        kinds = ("memory", "processes", "cpu", "cpus", "disk", "files")
        out = {self.caps.said(c): why for c in kinds}
        return out | {
            self.caps.said("tmpfs"): "tmpfs size (each of /tmp, /var/tmp, /run, /dev/shm)"
        }

    def phase(
        self, scope: str, name: str, paths: Iterable[Path], *, uid: int | None = None
    ) -> PhaseLimits:
        """The caps of one phase: its group made and capped (before the job starts).
        `uid`: the job's, whose processes are the phase's where there is no group."""
        group = PhaseGroup(self.cgroups, scope, name) if self.cgroups else None
        if group is not None:
            try:
                caps = self.caps
                group.cap(memory=caps.memory, processes=caps.processes, cpus=caps.cpus)
            except BaseException:
                group.remove()
                raise
        return PhaseLimits(self.caps, group, tuple(paths), uid=uid)

    def sweep(self, scope: str) -> int:
        """Remove the groups a killed executor of `scope` left, killing what is in them."""
        return sweep_cgroups(self.cgroups, scope) if self.cgroups else 0


# dash's `ulimit` flag and unit of each rlimit the phase takes (`PhaseLimits.ulimit`)
_ULIMIT = {
    resource.RLIMIT_CPU: ("t", 1),
    resource.RLIMIT_FSIZE: ("f", 512),
    resource.RLIMIT_CORE: ("c", 512),
    resource.RLIMIT_NOFILE: ("n", 1),
    resource.RLIMIT_DATA: ("d", 1024),
    resource.RLIMIT_NPROC: ("p", 1),
}


class PhaseLimits:
    """One phase's caps: how its processes start (`preexec`), whether it went over one
    (`check`), and its end (`close`)."""

    def __init__(
        self,
        caps: JobCaps,
        group: PhaseGroup | None,
        paths: tuple[Path, ...],
        *,
        uid: int | None = None,
    ) -> None:
        self.caps = caps
        self.group = group
        self.paths = paths  # what counts as the job's disk
        self.uid = uid
        self._devs = devices(paths)  # their file systems: where an unlinked file counts
        self.exceeded: Exceeded | None = None
        self._rlimits = self._limits()
        self._delegated: bool | None = None  # the group's files the uid's (`by_path`)

    def _limits(self) -> list[tuple[int, tuple[int, int]]]:
        caps, group = self.caps, self.group
        out = [
            (resource.RLIMIT_CPU, (caps.cpu_seconds, caps.cpu_seconds + 5)),
            (resource.RLIMIT_FSIZE, (caps.disk, caps.disk)),
            (resource.RLIMIT_CORE, (0, 0)),  # a core dump is disk too, and may hold secrets
            (resource.RLIMIT_NOFILE, (NOFILE, NOFILE)),
        ]
        if group is None or "memory" not in group.dirs:
            out.append((resource.RLIMIT_DATA, (caps.memory, caps.memory)))
        if group is None or "pids" not in group.dirs:
            out.append((resource.RLIMIT_NPROC, (caps.processes, caps.processes)))
        return out

    def preexec(self, then: Callable[[], None]) -> Callable[[], None]:
        """The child's steps before exec (after its uid switch): join the phase's group,
        take the rlimits, then `then` (the death signal)."""
        limits, group = self._rlimits, self.group

        def setup() -> None:
            if group is not None:
                group.join()
            for which, value in limits:
                resource.setrlimit(which, value)
            then()

        return setup

    def by_path(self) -> list[Path] | None:
        """The `cgroup.procs` files a process of the phase joins its group through by
        itself, as the phase's uid (delegated to it at the first call: executor/spawn.py
        `chain`), [] without a group; None where that cannot be (a v2 group, or no uid):
        then `preexec`."""
        if self.group is None:
            return []
        if self.uid is None:
            return None
        if self._delegated is None:
            self._delegated = self.group.delegate(self.uid)
        return self.group.procs_files() if self._delegated else None

    def ulimit(self) -> str:
        """The rlimits of `preexec` as the shell's `ulimit` commands (soft before hard,
        each in the shell's unit: a size rounded down)."""
        out = []
        for which, values in self._rlimits:
            flag, unit = _ULIMIT[which]
            for side, value in zip(("-S", "-H"), values, strict=True):
                said = "unlimited" if value == resource.RLIM_INFINITY else str(value // unit)
                out.append(f"command ulimit {side} -{flag} {said} || exit 125")
        return "\n".join(out) + "\n"

    def limit_words(self) -> list[str]:
        """The rlimits of `preexec` as the spawn helper takes them (executor/spawnhelper.c):
        `LETTER=SOFT:HARD`, the letter `ulimit`'s, in bytes and seconds, `-` unlimited."""

        def said(value: int) -> str:
            return "-" if value == resource.RLIM_INFINITY else str(value)

        return [f"{_ULIMIT[w][0]}={said(s)}:{said(h)}" for w, (s, h) in self._rlimits]

    def saw_exit(self, code: int) -> None:
        """A job's process ended with `code`: killed by SIGXCPU or SIGXFSZ (its rlimit),
        directly or as its init reports it, is that cap."""
        cap = _EXIT.get(code)
        if cap and self.exceeded is None:
            self.exceeded = Exceeded(cap, self.caps, "a process was killed at its rlimit")

    def check(
        self, tmpfs_full: Iterable[str] = (), *, stop: Callable[[], bool] = lambda: False
    ) -> Exceeded | None:
        """The cap the phase went over, if any (cheap but for the disk's look: off the
        event loop). `tmpfs_full`: the sandbox's mounts its init found full; `stop()`
        True: the phase ended meanwhile, the look is cut short."""
        if self.exceeded is not None:
            return self.exceeded
        caps, group, found = self.caps, self.group, None
        if group is not None and group.memory_killed():
            found = Exceeded("memory", caps, "the kernel killed a process at the cap")
        elif group is not None and group.forks_refused():
            found = Exceeded("processes", caps, "a new process was refused")
        elif group is not None and group.cpu_seconds() > caps.cpu_seconds:
            found = Exceeded("cpu", caps)
        elif full := sorted(set(tmpfs_full)):
            found = Exceeded("tmpfs", caps, f"{', '.join(full)} full")
        else:
            found = self._disk(stop)
        self.exceeded = self.exceeded or found  # the watch may be checking meanwhile
        return self.exceeded

    def _disk(self, stop: Callable[[], bool]) -> Exceeded | None:
        """Over the files or the disk cap: the walk, then files held open unlinked."""
        caps = self.caps
        used = walk(self.paths, most_files=caps.files, stop=stop)
        if stop():
            return None
        if used.files > caps.files:
            return Exceeded("files", caps, f"more than {caps.files} in the job's directories")
        if used.bytes > caps.disk:
            return Exceeded("disk", caps, f"{say_size(used.bytes)} used")
        hidden = open_deleted(self.pids(), self._devs, stop)
        if not stop() and used.bytes + hidden.bytes > caps.disk:
            said = f"{say_size(used.bytes + hidden.bytes)} used, {say_size(hidden.bytes)} of it"
            return Exceeded("disk", caps, f"{said} in {hidden.files} unlinked files held open")
        return None

    def pids(self) -> list[int]:
        """The phase's processes now: its group's, else its uid's."""
        if self.group is not None:
            return self.group.pids()
        return pids_of_uid(self.uid) if self.uid is not None else []

    def kill(self) -> None:
        """SIGKILL every process of the phase (its group's)."""
        if self.group is not None:
            self.group.kill()

    def close(self) -> bool:
        """Kill what is left in the phase's group and remove it; True if there was a
        group and it is gone: no process of the phase is left anywhere (each joined it
        before it ran anything, and none can leave it)."""
        return self.group.remove() if self.group is not None else False


def disk_usage(paths: Iterable[Path]) -> int:
    """Bytes allocated on disk under `paths` (each inode once), never following a link."""
    return walk(paths).bytes
