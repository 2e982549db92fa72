"""Running a job's processes as an identity that can reach nothing of runplane's.

Every process the executor starts for a run (Terraform and its providers, a custom step's
`/bin/sh -c`, and whatever those start) runs tenant code. Trusted work (the checkout from
the repository mirrors, reading plan files, the state backend) stays in the executor
process; what runs tenant code is spawned through a `Jail`, one per phase:

- `sandbox` (the executor runs as root and bubblewrap works: what `auto` picks): `user`'s
  uid, inside namespaces of its own, which bubblewrap (Debian's `bubblewrap`, a
  well-kept setuid-free tool that does exactly this, rather than our own unshare and
  mount code) makes as that uid: mount (the system read-only; `/tmp`, `/var/tmp`, `/run`
  and `/dev/shm` empty size-capped tmpfs; runplane's directories hidden; only the job's
  own directory writable), IPC, PID (it sees its own processes only, and they all die
  with the namespace's init, which dies with the executor) and UTS. Whatever a job
  leaves there (a file in `/run/lock`, a SysV shared memory segment, a daemon) dies with
  its namespaces. The network is the host's (providers need it), or none at all
  (`--job-network none`: a network namespace with only loopback). Its init (a shell,
  executor/shellinit.py, or `JOB_INIT`, executor/jobinit.py) outlives the executor
  just long enough to stop the job's process as on Ctrl-C (Terraform writes
  `errored.tfstate` for the next executor to recover); then the namespace and all in it
  are gone.
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
  `no_new_privs` is set: no setuid binary gives it root back. Each process starts under
  the same init as in the sandbox, which, when the executor dies, stops the job
  gracefully and then kills every process of the uid: nothing waits for the next start.

In both, the phase's caps (executor/caps.py: memory, processes, CPU time, disk, tmpfs)
hold every process of the job, in a control group of the phase's own where the host has
them (executor/cgroups.py), killed whole when the phase ends.
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
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import structlog

from executor.caps import Enforcement, Exceeded, JobCaps, PhaseLimits
from executor.errors import IsolationError
from executor.jobfiles import (
    adopt,
    clear_files_of,
    ipc_of,
    remove_files_of,
    remove_ipc_of,
    remove_tree,
    seal,
)
from executor.jobinit import SCRATCH, init_python, read_reports, state_carry, under_init
from executor.shellinit import shell_init, under_shell_init, usable_for
from executor.spawn import Spawn, chain, death_signal, graceful, helper_chain, setpriv
from executor.spawnhelper import spawn_helper
from executor.uids import (
    DEFAULT_UIDS,
    allocate,
    default_lock_dir,
    gave_back_clean,
    kill_uid,
    reclaim_uid,
    uid_range,
)

log = structlog.get_logger(__name__)

MODES = ("auto", "sandbox", "user", "bwrap", "none")
UID_MODES = ("sandbox", "user")  # a job uid of its own per phase
NETWORKS = ("allowed", "none")
# What the uid fallback does not cover, said at start (`runplane up`, `executor`).
USER_ONLY = (
    "jobs share the host's IPC, PID and mount namespaces: a job sees other jobs' command "
    "lines, and what it leaves in world-writable directories or SysV IPC is swept only "
    "when its phase ends"
)

BWRAP_UNHELD = (
    "NOT HELD: the bwrap mode (no root) makes no control group, sets no rlimit and watches "
    "no disk; a job may use the host's memory, processes, CPU and disk until it ends"
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
    network: str = "allowed"  # or "none": the sandbox's own network namespace
    limits: Enforcement = field(default_factory=Enforcement)  # caps: executor/caps.py

    @classmethod
    def choose(
        cls,
        wanted: str,
        *,
        fallback_to_none: bool = False,
        caps: JobCaps | None = None,
        network: str = "allowed",
        cgroups: bool = True,
    ) -> Isolation:
        """The isolation `wanted` names ("auto": root -> user, else bwrap if it works),
        with the jobs' `caps` (held by cgroups where the host has them, unless `cgroups`
        is False: rlimits) and `network` ("none" only where a sandbox can unshare it).

        Nothing available: IsolationError, or `none` with a loud warning if
        `fallback_to_none` (`runplane up` on a laptop)."""
        chosen = cls._choose(wanted, fallback_to_none=fallback_to_none)
        if network not in NETWORKS:
            raise IsolationError(f"unknown job network {network!r}: one of allowed, none")
        if network == "none" and chosen.mode != "sandbox":
            raise IsolationError(
                f"--job-network none needs a sandbox of its own network (--isolation "
                f"sandbox), and jobs run in the {chosen.mode} mode, which "
                + (
                    "cannot carry the phase's state backend into one (its jobs' plans would fail)"
                    if chosen.mode == "bwrap"
                    else "shares the host's network"
                )
                + ": refusing to start rather than let jobs reach it"
            )
        if chosen.mode not in UID_MODES:  # no uid of the job's own: the tmpfs size only
            return replace(chosen, network=network, limits=Enforcement(caps or JobCaps()))
        limits = Enforcement.find(caps or JobCaps(), cgroups=cgroups)
        shell_init()  # installed now, and said now if the Python init stands in for it
        spawn_helper()  # built now (once per machine), or said now if it cannot be
        return replace(chosen, network=network, limits=limits)

    @classmethod
    def _choose(cls, wanted: str, *, fallback_to_none: bool) -> Isolation:
        if wanted not in MODES:
            raise IsolationError(f"unknown isolation {wanted!r}: one of {', '.join(MODES)}")
        uids = uid_range()
        if wanted == "none":
            log.warning("isolation_none", why="asked for", danger=_DANGER)
            return cls(mode="none")
        if wanted in ("auto", "sandbox", "user") and os.geteuid() == 0:
            why = "asked for" if wanted == "user" else sandbox_problem(uids[-1])
            if not why:  # bwrap by its path: no walk of PATH at each job process
                found = shutil.which("bwrap") or "bwrap"
                return cls(mode="sandbox", uids=uids, lock_dir=default_lock_dir(), bwrap=found)
            if wanted == "sandbox":
                raise IsolationError(f"--isolation sandbox: bubblewrap cannot be used ({why})")
            log.warning("isolation_uid_only", why=why, not_covered=USER_ONLY)
            return cls(mode="user", uids=uids, lock_dir=default_lock_dir())
        if wanted in ("sandbox", "user"):
            raise IsolationError(f"--isolation {wanted} needs the executor to run as root")
        why = bwrap_problem()
        if not why:
            return cls(mode="bwrap", bwrap=shutil.which("bwrap") or "bwrap")
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
        uid, fd, clean = allocate(self.uids, self.lock_dir)
        limits = None
        try:
            if not clean:  # its last holder's end was not seen to leave nothing of it
                kill_uid(uid)  # a daemon an earlier holder left (its executor was killed)
                remove_files_of(uid)  # and what it left where anyone may write
                remove_ipc_of(uid)  # and its SysV IPC objects
            for path in (home, temp):
                os.chown(path, uid, uid, follow_symlinks=False)
            scope = root.parent.parent.name  # the jobs directory's: runplane-<digest>
            limits = self.limits.phase(scope, root.name, (root, temp), uid=uid)
        except BaseException:
            os.close(fd)
            shutil.rmtree(temp, ignore_errors=True)
            raise
        return Jail(self, root, temp, uid, fd, limits)

    def sweep(self, scope: str) -> int:
        """Remove the phase groups a killed executor of `scope` left (executor/sweep.py)."""
        return self.limits.sweep(scope) if self.mode in UID_MODES else 0

    def caps_said(self) -> dict[str, str]:
        """Which mechanism holds each cap of the jobs (logged at start), or {}: the bwrap
        mode holds only the tmpfs sizes, and says so."""
        if self.mode == "bwrap":
            return self.limits.unheld(BWRAP_UNHELD)
        if self.mode not in UID_MODES:
            return {}
        return self.limits.mechanisms(sandbox=self.mode == "sandbox")

    def reclaim(self, uid: int) -> bool:
        """Kill what runs as job uid `uid` if no live phase holds it (executor/sweep.py);
        False if it is not a job uid or is held."""
        if self.mode not in UID_MODES or uid not in self.uids or self.lock_dir is None:
            return False
        return reclaim_uid(self.lock_dir, uid)


class Jail:
    """One phase's identity: spawns its processes, kills them all at the end."""

    def __init__(
        self,
        isolation: Isolation,
        root: Path,
        tmp: Path,
        uid: int | None,
        lock: int,
        limits: PhaseLimits | None = None,
    ) -> None:
        self.isolation = isolation
        self.root = root
        self.tmp = tmp
        self.uid = uid
        self._lock = lock
        self.limits = limits
        self._guard = threading.Lock()
        self._closed = False  # the caps' watch (a thread) against close()
        self._under_init = False  # the uid mode's processes start under an init
        # what the sandbox's inits report (full tmpfs mounts): theirs to write, ours to read
        self._reports = os.pipe() if isolation.mode == "sandbox" else (-1, -1)

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
            return self._sandboxed(argv, env, cwd, options)
        if self.mode == "user" and (usable_for(argv) or init_python()):
            assert self.uid is not None and self.limits is not None
            self._under_init = True  # its init: the same, and kills the uid
            adopt(self.root / "src", self.uid)
            options.update(user=self.uid, group=self.uid, extra_groups=[], umask=0o077)
            if usable_for(argv):  # executor/shellinit.py: the death signal set here
                inited = under_shell_init(argv, report=False)
                chained = self._chained(inited, signal.SIGTERM)
                if chained is not None:  # vforked (executor/spawn.py)
                    plain = {k: options[k] for k in ("start_new_session", "close_fds", "umask")}
                    return Spawn(chained, env, cwd, plain)
                setup = death_signal(os.getpid(), signal.SIGTERM)
                options["preexec_fn"] = self.limits.preexec(setup)
                return Spawn(under_shell_init(argv, report=False), env, cwd, options)
            options["preexec_fn"] = self.limits.preexec(death_signal(os.getpid(), signal.SIGKILL))
            return Spawn(under_init(argv, parent=os.getpid()), env, cwd, options)
        wrapped, death = graceful(argv)
        options["preexec_fn"] = death_signal(os.getpid(), death)
        if self.mode == "user":
            assert self.uid is not None and self.limits is not None
            adopt(self.root / "src", self.uid)
            options.update(user=self.uid, group=self.uid, extra_groups=[], umask=0o077)
            options["preexec_fn"] = self.limits.preexec(options["preexec_fn"])
        return Spawn(wrapped, env, cwd, options)

    def _sandboxed(
        self, argv: Sequence[str], env: dict[str, str], cwd: Path, options: dict[str, Any]
    ) -> Spawn:
        """`argv` as the job in its sandbox, under its init: the shell init (its death
        signal set by `setpriv` as bwrap starts it, its report on its standard input),
        or the Python one where the shell's cannot serve (a network of none, whose
        state backend only the Python init carries in)."""
        assert self.uid is not None and self.limits is not None
        adopt(self.root / "src", self.uid)
        options.update(user=self.uid, group=self.uid, extra_groups=[], umask=0o077)
        options["preexec_fn"] = self.limits.preexec(death_signal(os.getpid(), signal.SIGKILL))
        carry = state_carry(env, self.root) if self.isolation.network == "none" else ""
        helper = spawn_helper()
        tool = helper or setpriv()  # the helper takes setpriv's `--pdeathsig SIG --`
        if not carry and tool and usable_for(argv):
            inner = [tool, "--pdeathsig", "TERM", "--", *under_shell_init(argv, report=True)]
            files = (shell_init(), helper) if helper else (shell_init(),)
            bwrapped = self._bwrap_argv(inner, cwd, init=True, files=files)
            chained = self._chained(bwrapped, signal.SIGKILL)
            if chained is not None:  # no preexec_fn, no uid switch: vforked (spawn.py)
                plain = {k: options[k] for k in ("start_new_session", "close_fds", "umask")}
                return Spawn(chained, env, cwd, plain, stdin=self._reports[1])
            return Spawn(bwrapped, env, cwd, options, stdin=self._reports[1])
        inner = under_init(argv, parent=0, report=self._reports[1], carry=carry)
        bwrapped = self._bwrap_argv(inner, cwd, init=True)
        return Spawn(bwrapped, env, cwd, options, keep_fds=(self._reports[1],))

    def _chained(self, argv: Sequence[str], death: signal.Signals) -> list[str] | None:
        """`argv` behind the exec chain that switches to the job's uid, sets `death` as
        its parent death signal, joins the phase's groups and takes its rlimits
        (executor/spawn.py `chain`), or None where the chain cannot (no setpriv, a
        control group v2): then the `preexec_fn`."""
        assert self.uid is not None and self.limits is not None
        groups, helper = self.limits.by_path(), spawn_helper()
        if groups is None:
            return None
        if helper:  # one exec of a static program (executor/spawnhelper.py)
            limits = self.limits.limit_words()
            return [*helper_chain(helper, self.uid, groups, limits, death), *argv]
        prefix = chain(self.uid, groups, self.limits.ulimit(), death, shell_init())
        return None if prefix is None else [*prefix, *argv]

    def ended(self, code: int) -> bool:
        """A job's process ended with `code` (its rlimits may have killed it). True if it
        was an init the job killed (the uid mode: the same uid may): then nothing would
        kill the rest with the executor, and the caller kills them now (`kill`)."""
        if self.limits is not None:
            self.limits.saw_exit(code)
        # the init ends by exit(), with the job's status (128 + a signal): only a signal
        # sent to the init itself (SIGKILL, SIGHUP...) ends it by a signal
        return self.mode == "user" and self._under_init and code < 0

    def check(self) -> Exceeded | None:
        """The cap the phase went over, if any (walks its directory: off the event loop).
        The walk holds no lock: `close` does not wait for it, it stops when closed."""
        with self._guard:  # the report pipe is closed by close(): read it before
            if self.limits is None or self._closed:
                return None
            full = read_reports(self._reports[0]) if self._reports[0] >= 0 else []
        over = self.limits.check(full, stop=lambda: self._closed)
        return None if self._closed else over

    def kill(self) -> None:
        """SIGKILL every process of the job now (a cap was exceeded)."""
        with self._guard:
            if self._closed:
                return
            if self.limits is not None:
                self.limits.kill()
            if self.uid is not None:
                kill_uid(self.uid)

    def _bwrap_argv(
        self, argv: Sequence[str], cwd: Path, *, init: bool = False, files: Sequence[str] = ()
    ) -> list[str]:
        """bubblewrap around `argv`: the root file system read-only, runplane's
        directories hidden, this job's directory bound back writable. `init`: `argv` is
        the namespace's init (JOB_INIT), which outlives bwrap to stop the job. `files`:
        bound read-only where they are (the shell init, in a directory a tmpfs hides)."""
        death = ["--as-pid-1"] if init else ["--die-with-parent"]
        out = [self.isolation.bwrap, *death, "--unshare-pid", "--unshare-ipc"]
        if self.isolation.network == "none":
            out.append("--unshare-net")
        out += ["--unshare-uts", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
        for scratch in SCRATCH:
            out += ["--size", str(self.isolation.limits.caps.tmpfs), "--tmpfs", scratch]
        out += _run_files()
        for hidden in self.isolation.hidden:
            out += ["--tmpfs", str(hidden)]
        for shown in (*self.isolation.shown, *files):
            out += ["--ro-bind", str(shown), str(shown)]
        out += ["--bind", str(self.root), str(self.root), "--bind", str(self.tmp), str(self.tmp)]
        out += ["--chdir", str(cwd), "--"]
        return out + list(argv)

    def close(self) -> None:
        """Kill every process of the job (all of its uid; in the sandbox with a phase
        group, the group's: see below), remove its TMPDIR, give the uid back, clean if
        nothing of it is left. (Its directory is the caller's to remove.)"""
        with self._guard:
            self._closed = True
        try:
            # its group: everything in it killed, then removed
            emptied = self.limits.close() if self.limits is not None else False
            if self._lock >= 0:
                assert self.uid is not None
                sealed = seal(self.root)  # before the uid may serve another phase: see `seal`
                if self.mode == "sandbox" and emptied:
                    # Nothing of it can be left but its directories: its processes were
                    # all in the group (gone), and the sandbox gave it no other place to
                    # write (the system read-only, its own tmpfs mounts) and an IPC
                    # namespace of its own, all gone with their processes. No kill of
                    # the uid, no sweep of the shared directories, no look at SysV IPC.
                    cleared = True
                else:
                    kill_uid(self.uid)
                    _, cleared = clear_files_of(self.uid)
                    remove_ipc_of(self.uid)
                    cleared = cleared and not ipc_of(self.uid)
                if sealed and cleared:
                    gave_back_clean(self._lock, self.uid)  # its next phase needs no sweep first
        finally:
            remove_tree(self.tmp)
            for fd in self._reports:
                if fd >= 0:
                    os.close(fd)
            self._reports = (-1, -1)
            if self._lock >= 0:
                os.close(self._lock)
                self._lock = -1


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
