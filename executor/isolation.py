"""Running a job's processes as an identity that can reach nothing of runplane's.

Every process the executor starts for a run (Terraform and its providers, a custom step's
`/bin/sh -c`, and whatever those start) runs tenant code. Trusted work (the checkout from
the repository mirrors, reading plan files, the state backend) stays in the executor
process; what runs tenant code is spawned through a `Jail`, one per phase:

- `sandbox` (the executor runs as root and bubblewrap works; asked for): `user`'s
  uid, inside namespaces of its own, which bubblewrap (Debian's `bubblewrap`, a
  well-kept setuid-free tool that does exactly this, rather than our own unshare and
  mount code) makes as that uid: mount (the system read-only; `/tmp`, `/var/tmp`, `/run`
  and `/dev/shm` empty size-capped tmpfs; runplane's directories hidden; only the job's
  own directory writable), IPC, PID (it sees its own processes only, and they all die
  with the namespace's init, which dies with the executor) and UTS. Whatever a job
  leaves there (a file in `/run/lock`, a SysV shared memory segment, a daemon) dies with
  its namespaces. The network is the host's (providers need it). Its init
  (`SANDBOX_INIT`) outlives the executor just long enough to stop the job's process as
  on Ctrl-C (Terraform writes `errored.tfstate` for the next executor to recover); then
  the namespace and all in it are gone. Not yet what `auto` picks.
- `user` (the executor runs as root, no bubblewrap: the fallback, said loudly at start):
  an unprivileged numeric uid/gid of its own per phase, from a range (`RUNPLANE_JOB_UIDS`,
  default `DEFAULT_UIDS`; no passwd entry is needed). A uid is allocated by an exclusive
  `flock` on `<lock dir>/<uid>`, held for the phase's life, so two executors of one
  machine never share one; whatever still runs as that uid is killed when it is taken and
  when it is given back (`kill(-1)` from a child of that uid: escaped daemons included, no
  process list race). The job uid owns only its checkout (`src/`, handed over after the
  checkout, never following a link) and its `home/` (HOME and TMPDIR), both 0700; it
  cannot read the data or work directory (0700), the key, the mirrors, another phase's
  directories, nor any runplane process's `/proc/<pid>/environ` or memory (another uid).
  `no_new_privs` is set: no setuid binary gives it root back.
- `bwrap` (not root, bubblewrap works): the same uid, but in namespaces of its own (pid,
  ipc, uts; the network is shared, providers need it) with the data, work and jobs
  directories hidden under empty tmpfs mounts, its own phase's directory bound back.
- `none`: as before, the executor's own identity. Only when asked for.

How each process is started (its own process group, and a death with the executor that
Terraform feels as one interrupt) is `executor/spawn.py`; the job uids are
`executor/uids.py`, and the job's files handed to its uid and back `executor/jobfiles.py`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import structlog

from executor.errors import IsolationError
from executor.jobfiles import adopt, remove_files_of, remove_ipc_of, remove_tree, seal
from executor.spawn import Spawn, death_signal, graceful
from executor.uids import (
    DEFAULT_UIDS,
    allocate,
    default_lock_dir,
    kill_uid,
    reclaim_uid,
    uid_range,
)

log = structlog.get_logger(__name__)

MODES = ("auto", "sandbox", "user", "bwrap", "none")
UID_MODES = ("sandbox", "user")  # a job uid of its own per phase
TMPFS_BYTES = 256 * 1024 * 1024  # each of a sandbox's /tmp, /var/tmp, /run, /dev/shm
# What the uid fallback does not cover, said at start (`runplane up`, `executor`).
USER_ONLY = (
    "jobs share the host's IPC, PID and mount namespaces: a job sees other jobs' command "
    "lines, and what it leaves in world-writable directories or SysV IPC is swept only "
    "when its phase ends"
)

_DANGER = "every run's code can read this machine's runplane data, keys and other runs"


@dataclass(frozen=True, kw_only=True)
class Isolation:
    """The executor's isolation mode and what it needs (see the module's docstring)."""

    mode: str
    uids: range = DEFAULT_UIDS
    lock_dir: Path | None = None
    hidden: tuple[Path, ...] = ()  # bwrap: directories the job must not see
    shown: tuple[Path, ...] = ()  # bwrap: and those it reads although /tmp is its own
    bwrap: str = "bwrap"

    @classmethod
    def choose(cls, wanted: str, *, fallback_to_none: bool = False) -> Isolation:
        """The isolation `wanted` names ("auto": root -> user, else bwrap if it works).

        Nothing available: IsolationError, or `none` with a loud warning if
        `fallback_to_none` (`runplane up` on a laptop)."""
        if wanted not in MODES:
            raise IsolationError(f"unknown isolation {wanted!r}: one of {', '.join(MODES)}")
        uids = uid_range()
        if wanted == "none":
            log.warning("isolation_none", why="asked for", danger=_DANGER)
            return cls(mode="none")
        if wanted in ("auto", "sandbox", "user") and os.geteuid() == 0:
            # `auto` is the uid mode until the sandbox has run the chaos and cluster
            # suites and its overhead is measured (issue 23)
            why = "asked for" if wanted != "sandbox" else sandbox_problem(uids[-1])
            if not why:
                return cls(mode="sandbox", uids=uids, lock_dir=default_lock_dir())
            if wanted == "sandbox":
                raise IsolationError(f"--isolation sandbox: bubblewrap cannot be used ({why})")
            log.warning("isolation_uid_only", why=why, not_covered=USER_ONLY)
            return cls(mode="user", uids=uids, lock_dir=default_lock_dir())
        if wanted in ("sandbox", "user"):
            raise IsolationError(f"--isolation {wanted} needs the executor to run as root")
        why = bwrap_problem()
        if not why:
            return cls(mode="bwrap")
        if wanted == "auto" and fallback_to_none:
            log.warning(
                "isolation_none",
                why=f"not root, and bubblewrap cannot be used: {why}",
                danger=_DANGER,
            )
            return cls(mode="none")
        raise IsolationError(
            f"no job isolation: not root, and bubblewrap cannot be used ({why}); run as "
            "root, install bubblewrap, or pass --isolation none to run jobs unisolated"
        )

    def hiding(self, *paths: Path, shown: Sequence[Path] = ()) -> Isolation:
        """The same isolation, with `paths` hidden from jobs too and `shown` read-only
        (bwrap; the others ignore both: file modes do the same)."""
        return replace(
            self,
            hidden=self.hidden + tuple(Path(p).resolve() for p in paths),
            shown=self.shown + tuple(Path(p).resolve() for p in shown),
        )

    def enter(self, root: Path, tmp: Path) -> Jail:
        """The identity of the phase whose directory is `root` (made by the caller, empty).

        `root` stays the executor's (0711: the job crosses it to its own directories);
        `home/` is the job's; `src/`, the checkout, is handed over before it runs. Its
        TMPDIR is a new directory in `tmp`, short: a provider's socket path must fit in
        108 bytes."""
        os.chmod(root, 0o711 if self.mode in UID_MODES else 0o700)
        (root / "logs").mkdir(mode=0o700, exist_ok=True)
        home = root / "home"
        home.mkdir(mode=0o700)
        temp = Path(tempfile.mkdtemp(dir=tmp))
        if self.mode not in UID_MODES:
            return Jail(self, root, temp, None, -1)
        assert self.lock_dir is not None
        uid, fd = allocate(self.uids, self.lock_dir)
        try:
            kill_uid(uid)  # a daemon an earlier holder left (its executor was killed)
            remove_files_of(uid)  # and what it left where anyone may write
            remove_ipc_of(uid)  # and its SysV IPC objects
            for path in (home, temp):
                os.chown(path, uid, uid, follow_symlinks=False)
        except BaseException:
            os.close(fd)
            shutil.rmtree(temp, ignore_errors=True)
            raise
        return Jail(self, root, temp, uid, fd)

    def reclaim(self, uid: int) -> bool:
        """Kill what runs as job uid `uid` if no live phase holds it (executor/sweep.py);
        False if it is not a job uid or is held."""
        if self.mode not in UID_MODES or uid not in self.uids or self.lock_dir is None:
            return False
        return reclaim_uid(self.lock_dir, uid)


class Jail:
    """One phase's identity: spawns its processes, kills them all at the end."""

    def __init__(
        self, isolation: Isolation, root: Path, tmp: Path, uid: int | None, lock: int
    ) -> None:
        self.isolation = isolation
        self.root = root
        self.tmp = tmp
        self.uid = uid
        self._lock = lock

    @property
    def mode(self) -> str:
        return self.isolation.mode

    @property
    def home(self) -> Path:
        return self.root / "home"

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path) -> Spawn:
        """How to start `argv` in `cwd` with `env` as this job. Hands the checkout to the
        job first (again each time: files the executor wrote since become the job's)."""
        env = {**env, "HOME": str(self.home), "TMPDIR": str(self.tmp)}
        options: dict[str, Any] = {
            "start_new_session": True,  # its own process group
            "preexec_fn": death_signal(os.getpid()),
            "close_fds": True,
        }
        if self.mode == "bwrap":  # --die-with-parent: it dies with the executor
            return Spawn(self._bwrap_argv(argv, cwd), env, cwd, options)
        if self.mode == "sandbox":  # its init stops it gracefully when the executor dies
            assert self.uid is not None
            adopt(self.root / "src", self.uid)
            options.update(user=self.uid, group=self.uid, extra_groups=[], umask=0o077)
            options["preexec_fn"] = death_signal(os.getpid(), signal.SIGKILL)
            inner = [init_python(), "-I", "-S", "-c", SANDBOX_INIT, *argv]
            return Spawn(self._bwrap_argv(inner, cwd, init=True), env, cwd, options)
        wrapped, death = graceful(argv)
        options["preexec_fn"] = death_signal(os.getpid(), death)
        if self.mode == "user":
            assert self.uid is not None
            adopt(self.root / "src", self.uid)
            options.update(user=self.uid, group=self.uid, extra_groups=[], umask=0o077)
        return Spawn(wrapped, env, cwd, options)

    def _bwrap_argv(self, argv: Sequence[str], cwd: Path, *, init: bool = False) -> list[str]:
        """bubblewrap around `argv`: the root file system read-only, runplane's
        directories hidden, this job's directory bound back writable. `init`: `argv` is
        the namespace's init (SANDBOX_INIT), which outlives bwrap to stop the job."""
        death = ["--as-pid-1"] if init else ["--die-with-parent"]
        out = [self.isolation.bwrap, *death, "--unshare-pid", "--unshare-ipc"]
        out += ["--unshare-uts", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
        for scratch in ("/tmp", "/var/tmp", "/run", "/dev/shm"):
            out += ["--size", str(TMPFS_BYTES), "--tmpfs", scratch]
        out += _run_files()
        for hidden in self.isolation.hidden:
            out += ["--tmpfs", str(hidden)]
        for shown in self.isolation.shown:
            out += ["--ro-bind", str(shown), str(shown)]
        out += ["--bind", str(self.root), str(self.root), "--bind", str(self.tmp), str(self.tmp)]
        out += ["--chdir", str(cwd), "--"]
        return out + list(argv)

    def close(self) -> None:
        """Kill every process of the job (all of its uid), remove its TMPDIR, give the
        uid back. (Its directory is the caller's to remove.)"""
        try:
            if self._lock >= 0:
                assert self.uid is not None
                kill_uid(self.uid)
                seal(self.root)  # before the uid may serve another phase: see `seal`
                remove_files_of(self.uid)
                remove_ipc_of(self.uid)
        finally:
            remove_tree(self.tmp)
            if self._lock >= 0:
                os.close(self._lock)
                self._lock = -1


# The init of a sandbox's PID namespace (the sandbox mode): it starts the job's process,
# then ignores the interrupts the executor sends the job's process group (the job's
# process gets them and stops as on Ctrl-C), and when its parent (bwrap, killed with the
# executor) dies it sends the job's process exactly one SIGTERM (a second would make
# Terraform exit at once, writing no errored.tfstate) and waits for it. Whatever else
# still runs in the namespace dies with this init, when it exits as the job exited.
SANDBOX_INIT = """
import ctypes, os, signal, subprocess, sys
job = subprocess.Popen(sys.argv[1:])
signal.signal(signal.SIGINT, signal.SIG_IGN)
told = []
def stop(*_):
    if not told:
        told.append(1)
        job.send_signal(signal.SIGTERM)
signal.signal(signal.SIGTERM, stop)
ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)
code = job.wait()
sys.exit(128 - code if code < 0 else code)
"""


def init_python() -> str:
    """A python3 any uid may run (the sandbox's init; the executor's own may be in a
    directory jobs cannot cross), or ""."""
    for path in ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3"):
        real = os.path.realpath(path)
        if os.path.isfile(real) and os.stat(real).st_mode & 0o001:
            return real
    return ""


def sandbox_problem(as_uid: int) -> str:
    """Why the sandbox mode cannot run here ("" if it can)."""
    if not init_python():
        return "no python3 every uid may run (/usr/bin/python3), the sandbox's init"
    return bwrap_problem(as_uid=as_uid)


def _run_files() -> list[str]:
    """Binds of what the system's configuration reaches under `/run` (which a sandbox
    mounts empty): `/etc/resolv.conf` is often systemd-resolved's file there."""
    out: list[str] = []
    for path in ("/etc/resolv.conf",):
        real = os.path.realpath(path)
        if real.startswith("/run/") and os.path.exists(real):
            out += ["--ro-bind", real, real]
    return out


def bwrap_problem(binary: str = "bwrap", *, as_uid: int | None = None) -> str:
    """Why bubblewrap cannot isolate jobs here ("" if it can): absent, or its namespaces
    refused (a container without user namespaces). `as_uid`: tried as that uid (a job's:
    the sandbox starts it as the job, whose user namespace the kernel may refuse)."""
    found = shutil.which(binary)
    if found is None:
        return "bwrap is not installed (Debian package bubblewrap)"
    true = shutil.which("true") or "/bin/true"
    argv = [found, "--die-with-parent", "--unshare-pid", "--ro-bind", "/", "/"]
    argv += ["--dev", "/dev", "--proc", "/proc", "--", true]
    try:
        ids: dict[str, Any] = {} if as_uid is None else {"user": as_uid, "group": as_uid}
        done = subprocess.run(argv, capture_output=True, timeout=10, check=False, **ids)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{found}: {e}"
    if done.returncode != 0:
        return f"{found}: {done.stderr.decode(errors='replace').strip()[:300]}"
    return ""
