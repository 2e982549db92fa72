"""Running a job's processes as an identity that can reach nothing of runplane's.

Every process the executor starts for a run (Terraform and its providers, a custom step's
`/bin/sh -c`, and whatever those start) runs tenant code. Trusted work (the checkout from
the repository mirrors, reading plan files, the state backend) stays in the executor
process; what runs tenant code is spawned through a `Jail`, one per phase:

- `user` (the executor runs as root): an unprivileged numeric uid/gid of its own per
  phase, from a range (`RUNPLANE_JOB_UIDS`, default `DEFAULT_UIDS`; no passwd entry is
  needed). A uid is allocated by an exclusive `flock` on `<lock dir>/<uid>`, held for the
  phase's life, so two executors of one machine never share one; whatever still runs as
  that uid is killed when it is taken and when it is given back (`kill(-1)` from a child
  of that uid: escaped daemons included, no process list race). The job uid owns only its
  checkout (`src/`, handed over after the checkout, never following a link) and its
  `home/` (HOME and TMPDIR), both 0700; it cannot read the data or work directory (0700),
  the key, the mirrors, another phase's directories, nor any runplane process's
  `/proc/<pid>/environ` or memory (another uid). `no_new_privs` is set: no setuid binary
  gives it root back.
- `bwrap` (not root, bubblewrap works): the same uid, but in namespaces of its own (pid,
  ipc, uts; the network is shared, providers need it) with the data, work and jobs
  directories hidden under empty tmpfs mounts, its own phase's directory bound back.
- `none`: as before, the executor's own identity. Only when asked for.

Every child gets its own process group and dies with the executor: when the executor
dies, Terraform stops as on Ctrl-C and can still write `errored.tfstate`; what is left is
killed by the next executor starting on the work directory (`executor/sweep.py`).

Terraform must get that signal exactly once: a second interrupt makes it exit at once
("Two interrupts received"), writing no state at all. The kernel sends a parent death
signal again each time the child is handed to another parent, and the executor is
multithreaded: killed, its threads end one after the other, the child passes from one to
the next and gets one signal per thread (two interrupts in most kills, seen with
Terraform 1.0.3). So a job's process is started by a single-threaded `/bin/sh`
(`GRACEFUL`) whose parent death signal is SIGKILL (any number of them kill it once); the
job's process itself is exec'd through `setpriv --pdeathsig TERM`, relative to that
shell, and gets one SIGTERM when it dies. The signals are set in `preexec_fn`, which
CPython's `_posixsubprocess` calls after `setreuid` (a change of credentials clears them,
so they could not be set earlier). Without `setpriv`, the job's process gets the death
signal straight from the executor, as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import os
import shutil
import signal
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import structlog

from executor.errors import SetupError

log = structlog.get_logger(__name__)

MODES = ("auto", "user", "bwrap", "none")
DEFAULT_UIDS = range(1_500_000_000, 1_500_065_536)  # far above any real user or subuid range
UIDS_ENV = "RUNPLANE_JOB_UIDS"  # "first-last", both included
DEATH_SIGNAL = signal.SIGTERM  # Terraform stops gracefully on it, as on SIGINT
# The shell between the executor and a job's process (module docstring). It ignores the
# group's SIGINT (the job's process gets it too, and handles it), waits for the process
# and ends as it ended: with its exit status, or killed by the same signal.
GRACEFUL = (
    "trap : INT\n"
    '"$@"\n'
    "s=$?\n"
    'if [ "$s" -gt 128 ] && [ "$s" -lt 160 ]; then trap - INT; kill -"$((s - 128))" "$$"; fi\n'
    'exit "$s"\n'
)
_SHELL = "/bin/sh"

_DANGER = "every run's code can read this machine's runplane data, keys and other runs"
_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38
_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl  # looked up now: the child between fork and exec only calls it


class IsolationError(SetupError):
    """The isolation asked for cannot be had on this machine."""


@dataclass(frozen=True)
class Spawn:
    """How to start one process: what `asyncio.create_subprocess_exec` is given."""

    argv: list[str]
    env: dict[str, str]
    cwd: Path
    options: dict[str, Any] = field(default_factory=dict)


def uid_range(text: str | None = None) -> range:
    """The job uids `RUNPLANE_JOB_UIDS` ("first-last") names; DEFAULT_UIDS if unset."""
    text = os.environ.get(UIDS_ENV, "") if text is None else text
    if not text:
        return DEFAULT_UIDS
    first, sep, last = text.partition("-")
    try:
        lo, hi = int(first), int(last)
    except ValueError:
        lo = hi = -1
    if not sep or lo < 1000 or hi < lo or hi >= 2**32 - 1:
        raise IsolationError(f"{UIDS_ENV}={text!r}: expected first-last, uids >= 1000")
    return range(lo, hi + 1)


def default_lock_dir() -> Path:
    """Where job uids are locked: one place per machine (per user without root)."""
    if os.geteuid() == 0 and os.path.isdir("/run") and os.access("/run", os.W_OK):
        return Path("/run/runplane-uids")
    return Path(tempfile.gettempdir()) / f"runplane-uids-{os.geteuid()}"


def private_dir(path: Path, mode: int) -> Path:
    """Create `path` (parents as needed) or check it: a directory, not a link, ours, and
    writable by no one else; then give it `mode`. A shared temporary directory is
    writable by everyone: what someone else made there in advance is refused."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise IsolationError(f"{path} is not a directory of this user's (a link, or another's)")
    os.chmod(path, mode, follow_symlinks=False)
    return path


def _death_signal(parent: int, sig: signal.Signals = DEATH_SIGNAL) -> Callable[[], None]:
    """The child's last steps before exec: parent death signal, no new privileges."""

    def setup() -> None:
        _prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        _prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        if os.getppid() != parent:  # the executor died before the signal was set
            os.kill(os.getpid(), sig)

    return setup


@functools.cache
def setpriv() -> str | None:
    """util-linux's `setpriv` if it sets a parent death signal (2.33 and later)."""
    found = shutil.which("setpriv", path="/usr/bin:/bin:/usr/sbin:/sbin")
    if found is None or not os.path.isfile(_SHELL):
        log.warning(
            "death_signal_direct",
            why="no setpriv or /bin/sh: Terraform may get "
            "two interrupts when the executor is killed, and write no state",
        )
        return None
    done = subprocess.run(
        [found, "--pdeathsig", "TERM", "--", "true"], capture_output=True, check=False
    )
    return found if done.returncode == 0 else None


def graceful(argv: Sequence[str]) -> tuple[list[str], signal.Signals]:
    """`argv` started so that it gets one SIGTERM when the executor dies (module
    docstring), and the parent death signal of what the executor starts for it."""
    tool = setpriv()
    if tool is None:
        return list(argv), DEATH_SIGNAL
    wrapped = [_SHELL, "-c", GRACEFUL, "runplane-job", tool, "--pdeathsig", "TERM", "--"]
    return wrapped + list(argv), signal.SIGKILL


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
        if wanted in ("auto", "user") and os.geteuid() == 0:
            return cls(mode="user", uids=uids, lock_dir=default_lock_dir())
        if wanted == "user":
            raise IsolationError("--isolation user needs the executor to run as root")
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
        os.chmod(root, 0o711 if self.mode == "user" else 0o700)
        (root / "logs").mkdir(mode=0o700, exist_ok=True)
        home = root / "home"
        home.mkdir(mode=0o700)
        temp = Path(tempfile.mkdtemp(dir=tmp))
        if self.mode != "user":
            return Jail(self, root, temp, None, -1)
        uid, fd = self._allocate()
        try:
            kill_uid(uid)  # a daemon an earlier holder left (its executor was killed)
            remove_files_of(uid)  # and what it left where anyone may write
            for path in (home, temp):
                os.chown(path, uid, uid, follow_symlinks=False)
        except BaseException:
            os.close(fd)
            shutil.rmtree(temp, ignore_errors=True)
            raise
        return Jail(self, root, temp, uid, fd)

    def _allocate(self) -> tuple[int, int]:
        """A job uid no other phase of this machine holds, and the fd of its lock."""
        assert self.lock_dir is not None
        locks = private_dir(self.lock_dir, 0o700)
        # Uids in use when last looked: one look (all of /proc, every jobs directory)
        # serves the whole walk, not one per uid: with dozens of uids left by killed
        # executors that walk took 0.4-0.5 s per phase, on the executor's event loop.
        seen: set[int] | None = None
        for uid in self.uids:
            fd = os.open(locks / str(uid), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            if seen is None or uid not in seen:  # looked at again holding its lock
                seen = uids_in_use()
            if uid in seen:
                # A killed executor's Terraform, stopping gracefully on its parent death
                # signal to write errored.tfstate, or a killed executor's job directories,
                # still its uid's (not sealed): left to that executor's next start
                # (executor/sweep.py), never handed to another phase with them.
                os.close(fd)
                continue
            return uid, fd
        raise IsolationError(f"all {len(self.uids)} job uids are in use")

    def reclaim(self, uid: int) -> bool:
        """Kill what runs as job uid `uid` if no live phase holds it (executor/sweep.py);
        False if it is not a job uid or is held."""
        if self.mode != "user" or uid not in self.uids or self.lock_dir is None:
            return False
        try:
            fd = os.open(self.lock_dir / str(uid), os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            return False  # never allocated here: not ours to kill
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a live phase of some executor has it now
        else:
            kill_uid(uid)
            return True
        finally:
            os.close(fd)


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
            "preexec_fn": _death_signal(os.getpid()),
            "close_fds": True,
        }
        if self.mode == "bwrap":  # --die-with-parent: the sandbox dies with the executor
            return Spawn(self._bwrap_argv(argv, cwd), env, cwd, options)
        wrapped, death = graceful(argv)
        options["preexec_fn"] = _death_signal(os.getpid(), death)
        if self.mode == "user":
            assert self.uid is not None
            adopt(self.root / "src", self.uid)
            options.update(user=self.uid, group=self.uid, extra_groups=[], umask=0o077)
        return Spawn(wrapped, env, cwd, options)

    def _bwrap_argv(self, argv: Sequence[str], cwd: Path) -> list[str]:
        """bubblewrap around `argv`: the root file system read-only, runplane's
        directories hidden, this job's directory bound back writable."""
        out = [self.isolation.bwrap, "--die-with-parent", "--unshare-pid", "--unshare-ipc"]
        out += ["--unshare-uts", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
        out += ["--tmpfs", "/tmp", "--tmpfs", "/dev/shm"]
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
        finally:
            remove_tree(self.tmp)
            if self._lock >= 0:
                os.close(self._lock)
                self._lock = -1


# Where any uid may create files (sticky, world-writable): a job's leftovers there would
# be readable by the next phase given the same uid, of another organization perhaps.
SHARED_TEMP = (Path("/tmp"), Path("/var/tmp"), Path("/dev/shm"))


def leftover_job_uids() -> set[int]:
    """The uids that still own a job directory of some executor of this machine (under
    `<tmpdir>/runplane-*/jobs/`): ones whose executor died before sealing it."""
    found: set[int] = set()
    for home in Path(tempfile.gettempdir()).glob("runplane-*/jobs/*/home"):
        with contextlib.suppress(OSError):
            found.add(os.lstat(home).st_uid)
    return found


def uids_in_use() -> set[int]:
    """The uids a job may not be given now: one Terraform runs as (a killed executor's,
    stopping gracefully), or that owns a leftover job directory."""
    return {uid for _, uid in terraform_processes()} | leftover_job_uids()


def seal(root: Path) -> None:
    """Make a finished job's directories (`src/`, `home/`) the executor's again, 0700, so
    that what is in them (a plan file, a state) cannot be read by the next phase given the
    same uid, perhaps another organization's, while the directory waits to be removed.
    The job cannot have replaced them: `root` is the executor's (0711)."""
    for name in ("src", "home"):
        path = root / name
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                continue
            os.chown(path, os.geteuid(), os.getegid(), follow_symlinks=False)
            os.chmod(path, 0o700)  # a directory still: the job cannot replace it
        except OSError as e:
            log.warning("job_dir_not_sealed", path=str(path), error=repr(e))


def remove_tree(path: Path, *, as_uid: int | None = None) -> bool:
    """`rm -rf` of `path` without following links and without recursion in Python (a
    job's tree may be deeper than Python's recursion limit: shutil.rmtree raised there),
    as `as_uid` when given (then it can remove only what that uid could); True if gone."""
    if not os.path.lexists(path):
        return True
    rm = shutil.which("rm") or "/bin/rm"
    ids: dict[str, Any] = {} if as_uid is None else {"user": as_uid, "group": as_uid}
    if as_uid is not None:
        ids["extra_groups"] = []
    done = subprocess.run(
        [rm, "-rf", "--one-file-system", "--", str(path)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        close_fds=True,
        check=False,
        **ids,
    )
    if done.returncode != 0:
        log.warning(
            "tree_not_removed", path=str(path), error=done.stderr[-300:].decode(errors="replace")
        )
    return not os.path.lexists(path)


def remove_files_of(uid: int, places: Sequence[Path] = SHARED_TEMP) -> int:
    """Remove what `uid` owns at the top of each shared temporary directory (a directory
    with all below it, removed as that uid); how many entries were removed. Never follows
    a link, and never fails the caller: what is left is logged."""
    removed = 0
    for place in places:
        try:
            entries = list(os.scandir(place))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    gone = remove_tree(Path(entry.path), as_uid=uid)
                else:
                    os.unlink(entry.path)
                    gone = True
                removed += gone
            except Exception as e:  # noqa: BLE001  # a job's leftovers never stop a phase's end
                log.warning("job_file_not_removed", path=entry.path, error=repr(e))
    return removed


def terraform_processes() -> Iterator[tuple[Path, int]]:
    """`(/proc/<pid>, uid)` of each live process named terraform (Linux /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != "terraform":
                continue
            status = dict(
                line.split(":", 1)
                for line in (entry / "status").read_text().splitlines()
                if ":" in line
            )
            if status["State"].split()[0] != "Z":  # a zombie is dead, only not reaped
                yield entry, int(status["Uid"].split()[0])
        except (OSError, ValueError, KeyError, IndexError):
            continue


def kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid`: a child turned `uid` calls kill(-1), which the
    kernel delivers to all of that uid's processes at once (a forking daemon cannot
    slip through), sparing only the caller, which then runs /bin/true."""
    if uid < 1000:
        raise ValueError(f"refusing to kill every process of uid {uid}")

    def kill_all() -> None:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass  # nothing runs as uid

    true = shutil.which("true") or "/bin/true"
    subprocess.run(
        [true],
        user=uid,
        group=uid,
        extra_groups=[],
        preexec_fn=kill_all,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        close_fds=True,
        check=False,
    )


def adopt(top: Path, uid: int) -> int:
    """Give the executor's files under `top` to `uid`, never following a link; the count.

    fd-relative throughout (`os.fwalk`, which checks it descends into the directory it
    listed): the job may be running and renaming things meanwhile. Each file is opened
    without following links and checked on its fd before `fchown`; a file with other
    hard links (git's local clone shares objects with their source) is left as it is,
    readable but not the job's, so that nothing outside `top` changes owner."""
    me = os.geteuid()
    try:
        st = os.lstat(top)
    except FileNotFoundError:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        raise IsolationError(f"{top} is not a directory")
    changed = 0
    for _, dirs, files, dirfd in os.fwalk(top, follow_symlinks=False):
        here = os.fstat(dirfd)
        if here.st_uid == me:
            os.fchown(dirfd, uid, uid)
            changed += 1
        for name in (*dirs, *files):
            changed += _adopt_file(name, dirfd, me, uid)
    os.chmod(top, 0o700, follow_symlinks=False)
    return changed


def _adopt_file(name: str, dirfd: int, me: int, uid: int) -> int:
    try:
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return 0
    if st.st_uid != me or not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        return 0  # a directory is done by the walk; links stay the executor's
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dirfd)
    except OSError:
        return 0  # gone or replaced by a link meanwhile
    try:
        st = os.fstat(fd)
        if st.st_uid != me or not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            return 0
        os.fchown(fd, uid, uid)
        return 1
    finally:
        os.close(fd)


def bwrap_problem(binary: str = "bwrap") -> str:
    """Why bubblewrap cannot isolate jobs here ("" if it can): absent, or its namespaces
    refused (a container without user namespaces)."""
    found = shutil.which(binary)
    if found is None:
        return "bwrap is not installed (Debian package bubblewrap)"
    true = shutil.which("true") or "/bin/true"
    argv = [found, "--die-with-parent", "--unshare-pid", "--ro-bind", "/", "/"]
    argv += ["--dev", "/dev", "--proc", "/proc", "--", true]
    try:
        done = subprocess.run(argv, capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{found}: {e}"
    if done.returncode != 0:
        return f"{found}: {done.stderr.decode(errors='replace').strip()[:300]}"
    return ""
