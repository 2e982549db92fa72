"""The job's init as a shell script: what `JOB_INIT` (executor/jobinit.py) does, for a
fortieth of its cost.

Every process of a job starts under an init (the uid and sandbox modes). The Python init
costs ~28 ms of CPU per process (the interpreter and `subprocess`), more than the rest of
a short phase's isolation together; this one is the system's POSIX shell (dash on Debian,
~1 ms) and `env` (~0.5 ms), or in place of `env` and `stat` the spawn helper, a static
program that loads nothing (executor/spawnhelper.py). It does the same, with the same
guarantees:

- It runs as the job's uid, with a parent death signal (SIGTERM) set after the uid switch:
  in the uid mode by the executor's `preexec_fn` (CPython's `_posixsubprocess` calls it
  after `setreuid`; a change of credentials clears the signal, an `exec` does not), in the
  sandbox by `setpriv --pdeathsig TERM` between bubblewrap and it (bubblewrap's own
  `--die-with-parent` would SIGKILL Terraform). A killed executor may send it several
  (one per thread of the executor that passes it on): only the first counts.
- It ignores the group's SIGINT (the job gets it, and stops as on Ctrl-C). On its parent
  death signal it gives the job exactly one SIGTERM (a second would make Terraform exit at
  once, writing no `errored.tfstate`), waits for it up to `STOP_GRACE_S`, and kills every
  process of its uid (`kill -KILL -1`: in the uid mode all of the phase's, a daemon in a
  session of its own too; in the sandbox all of its PID namespace).
- It cannot be traced nor its `/proc` files read by the job (the same uid): it is an
  execute-only copy of the shell (mode 0111, root's, in a root-only directory), and the
  kernel makes a process that executes a file it may not read undumpable, as the Python
  init made itself with `prctl(PR_SET_DUMPABLE, 0)`. A host where that would not hold
  (`fs.suid_dumpable` 1) keeps the Python init.
- The job is started in the background, so that the shell can act on a signal while it
  waits (a foreground wait defers traps until the job ends); a non-interactive shell
  starts a background job with SIGINT and SIGQUIT ignored and its standard input on
  /dev/null: `env --default-signal` gives it the two signals back.
- In the sandbox, the init's standard input is the phase's report pipe (the job never
  sees it: its standard input is /dev/null): when the job has ended, the init writes there
  the free and total blocks of each of the sandbox's tmpfs mounts (`stat -f`), from which
  the executor tells a full one (executor/caps.py).

The init exits as the job did (128 + the signal for one killed by a signal): only a
signal sent to the init itself ends it by a signal, which the executor takes for a job
that killed its own init (executor/isolation.py `Jail.ended`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import structlog

from executor.jobfiles import private_dir
from executor.jobinit import SCRATCH, STOP_GRACE_S
from executor.spawnhelper import init_dir, spawn_helper

log = structlog.get_logger(__name__)

_SHELL = "/bin/sh"
_BIN_PATH = "/usr/bin:/bin"
# $1: "report" (the sandbox: report the tmpfs mounts on standard input) or ""; then the
# job's argv. ENV and SLEEP are absolute paths, STATFS a command (`stat -f` printing
# `tmpfs PLACE FREE BLOCKS` per place, or the spawn helper's `--statfs`, which prints the
# same), GRACE and SCRATCH constants. ENV is `env` or the spawn helper, which take the
# same `--default-signal=INT,QUIT --`.
SH_INIT = """\
report=$1
shift
told= sent= job=
stop() {
  told=1
  if [ -z "$sent" ] && [ -n "$job" ]; then
    sent=1
    kill -TERM "$job" 2>/dev/null
    (SLEEP GRACE; kill -KILL -1) &
  fi
}
trap : INT
trap stop TERM
ENV --default-signal=INT,QUIT -- "$@" &
job=$!
if [ -n "$told" ]; then stop; fi
wait "$job" 2>/dev/null
s=$?
while [ "$s" -gt 128 ] && kill -0 "$job" 2>/dev/null; do
  wait "$job" 2>/dev/null
  s=$?
done
if [ -n "$report" ]; then STATFS SCRATCH >&0 2>/dev/null; fi
if [ -n "$told" ]; then kill -KILL -1 2>/dev/null; fi
exit "$s"
"""


@functools.cache
def _tools() -> dict[str, str] | None:
    """Absolute paths of what the script runs (never the job's PATH), or None."""
    found = {name: shutil.which(name, path=_BIN_PATH) for name in ("env", "sleep", "stat")}
    if any(path is None for path in found.values()):
        return None
    return {k: v for k, v in found.items() if v is not None}


@functools.cache
def script() -> str:
    """SH_INIT with its tools' paths and constants in place."""
    tools, helper = _tools(), spawn_helper()
    assert tools is not None
    statfs = f"{helper} --statfs" if helper else f"{tools['stat']} -f -c 'tmpfs %n %a %b'"
    return (
        SH_INIT.replace("ENV", helper or tools["env"])
        .replace("SLEEP", tools["sleep"])
        .replace("STATFS", statfs)
        .replace("GRACE", str(STOP_GRACE_S))
        .replace("SCRATCH", " ".join(SCRATCH))
    )


@functools.cache
def shell_init() -> str:
    """The execute-only copy of the system's shell the init runs (module docstring), made
    once per process; "" where the init cannot be a shell here (then the Python one)."""
    why = _problem()
    if why:
        log.warning("job_init_python", why=why, costs="~28 ms of CPU per job process")
        return ""
    try:
        return str(_install(Path(os.path.realpath(_SHELL)), init_dir()))
    except OSError as e:
        log.warning("job_init_python", why=f"the shell init could not be installed: {e!r}")
        return ""


def _problem() -> str:
    """Why the shell init cannot be used here ("" if it can)."""
    if os.geteuid() != 0:
        return "not root (no job uid to run it as)"
    if _tools() is None:
        return f"no env, sleep or stat in {_BIN_PATH}"
    with contextlib.suppress(OSError):
        if Path("/proc/sys/fs/suid_dumpable").read_text().strip() == "1":
            return "fs.suid_dumpable is 1: an execute-only init would stay dumpable"
    tools = _tools()
    assert tools is not None
    try:
        done = subprocess.run(
            [tools["env"], "--default-signal=INT,QUIT", "--", "true"],
            capture_output=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"env: {e}"
    if done.returncode != 0:
        return "env has no --default-signal (GNU coreutils 8.31 or later)"
    return ""


def _install(source: Path, where: Path) -> Path:
    """`source` copied into `where` (made 0711, root's) as an execute-only file named by
    its content, replaced atomically; an existing copy of root's, 0111, is kept."""
    data = source.read_bytes()
    target = private_dir(where, 0o711) / f"sh-{hashlib.sha256(data).hexdigest()[:16]}"
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(target)
        if stat.S_ISREG(st.st_mode) and st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o111:
            return target
    fd, tmp = tempfile.mkstemp(dir=where, prefix=".sh-")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.chmod(tmp, 0o111)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return target


def under_shell_init(argv: Sequence[str], *, report: bool) -> list[str]:
    """`argv` started by the shell init (module docstring); `report`: it writes the
    sandbox's tmpfs mounts to its standard input when the job ends."""
    return [shell_init(), "-c", script(), "runplane-init", "report" if report else "", *argv]


def usable_for(argv: Sequence[str]) -> bool:
    """The shell init can start `argv` (`env` would take a first word with `=` for a
    variable to set)."""
    return bool(argv) and "=" not in argv[0] and bool(shell_init())
