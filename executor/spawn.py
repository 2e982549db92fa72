"""How a job's process is started: its own process group, and death with the executor.

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

A `preexec_fn`, or a uid or groups to switch to, makes CPython fork the executor (~100 MB:
its page tables copied, then its pages faulted back as written, ~5 ms of CPU per job
process on the shared machine of issue 26); without them it vforks. So where it can, a
job's process is started by an exec chain instead (`chain`): `setpriv` switches to the
job's uid and gid (saved ids too), drops the groups, sets no_new_privs and the parent
death signal after the switch; then a shell as the job (`CHAIN`) checks that its parent
is still the executor (one that died before the signal was set would never send it: the
chain stops), joins the phase's control groups through their `cgroup.procs` (the
phase's uid's to write: executor/cgroups.py `delegate`), takes the rlimits, and execs the
rest. Its own process group and umask CPython sets in the vforked child. Where the spawn
helper was built (executor/spawnhelper.py), one exec of it does what `setpriv` and the
chain's shell did, the same steps in the same order (`helper_chain`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)

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

_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38
_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl  # looked up now: the child between fork and exec only calls it


@dataclass(frozen=True)
class Spawn:
    """How to start one process: what `asyncio.create_subprocess_exec` is given."""

    argv: list[str]
    env: dict[str, str]
    cwd: Path
    options: dict[str, Any] = field(default_factory=dict)
    keep_fds: tuple[int, ...] = ()  # open in the child (its init's report pipe)
    stdin: int = -1  # the child's standard input (the shell init's report pipe); -1: none


def death_signal(parent: int, sig: signal.Signals = DEATH_SIGNAL) -> Callable[[], None]:
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


# The job's side of the exec chain (module docstring): $1 the executor's pid, then the
# group files to join, `--`, and what to exec. Regular builtins through `command`: an
# exported function of the job's environment (bash as /bin/sh) cannot stand in for one.
CHAIN = """\
command test "$PPID" = "$1" || exit 125
shift
while command test "$1" != --; do
  command printf 0 > "$1" || exit 125
  shift
done
shift
ULIMIT
exec "$@"
"""


def chain(
    uid: int, groups: Sequence[Path], ulimit: str, death: signal.Signals, shell: str
) -> list[str] | None:
    """The argv before a job's own that does what `death_signal` and the phase's
    `preexec` did, with no `preexec_fn` (module docstring): as `uid`, its parent death
    signal `death`, in the groups whose `cgroup.procs` are `groups`, with the `ulimit`
    commands (executor/caps.py), by `shell`: the init's execute-only copy, which the
    kernel keeps undumpable (a daemon of the same uid cannot trace it past the groups and
    rlimits). None without `setpriv` or `shell`."""
    tool = setpriv()
    if tool is None or not shell:
        return None
    ids = [f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs"]
    script = CHAIN.replace("ULIMIT\n", ulimit)
    out = [tool, *ids, "--pdeathsig", death.name.removeprefix("SIG"), "--", shell, "-c"]
    return [*out, script, "runplane-spawn", str(os.getpid()), *map(str, groups), "--"]


def helper_chain(
    helper: str, uid: int, groups: Sequence[Path], limits: Sequence[str], death: signal.Signals
) -> list[str]:
    """`chain` done by the spawn helper (executor/spawnhelper.c) in one exec: as `uid`,
    its parent death signal `death`, its parent still the executor, in the groups whose
    `cgroup.procs` are `groups`, with the rlimits `limits` (executor/caps.py
    `limit_words`)."""
    ids = [f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs"]
    out = [helper, *ids, "--pdeathsig", death.name.removeprefix("SIG"), "runplane-spawn"]
    return [*out, str(os.getpid()), *map(str, groups), "--", *limits, "--"]
