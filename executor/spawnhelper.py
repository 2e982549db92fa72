"""The spawn helper: one small static program for the steps between the executor and a
job's own process (executor/spawnhelper.c), where each was a dynamically linked tool or a
shell of its own.

A sandboxed job's process went through eight execs, each costing the CPU of loading a
dynamic program (issue 26: ~13 ms of a `true` step's children): `setpriv` and a shell (the
exec chain, executor/spawn.py), bubblewrap, `setpriv --pdeathsig` inside it, the init's
shell, `env --default-signal`, the job, and `stat -f` for the init's report. The helper
takes the place of `setpriv`, the chain's shell, `env` and `stat`, doing exactly what
they did (its source says how), so a job's process now costs bubblewrap, the init's
shell, the job and three execs of a static program that loads nothing.

It is built once per machine from its source (`cc -static`), in the init's directory
(root's, 0711: `init_dir`), execute-only and root's like the init's
shell: a job may run it (which gives it nothing: as the job it cannot take another uid)
but neither read, trace, replace nor rename it. A host without a C compiler and a static
libc keeps the tools (said at start, `spawn_helper_missing`).
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
from pathlib import Path

import structlog

from executor.jobfiles import private_dir

log = structlog.get_logger(__name__)

SOURCE = Path(__file__).with_name("spawnhelper.c")
_BIN_PATH = "/usr/bin:/bin"
_BUILD_TIMEOUT_S = 120


def init_dir() -> Path:
    """Where the execute-only shell and the helper are kept: a directory only root may
    write in, which every uid may cross (0711)."""
    if os.path.isdir("/run") and os.access("/run", os.W_OK):
        return Path("/run/runplane-init")
    return Path(tempfile.gettempdir()) / f"runplane-init-{os.geteuid()}"


@functools.cache
def spawn_helper() -> str:
    """The helper's path, built now if this machine has none of this source yet; "" where
    it cannot be (not root, no C compiler or static libc): then the tools it replaces."""
    if os.geteuid() != 0:
        return ""
    try:
        return str(_installed(SOURCE.read_bytes(), private_dir(init_dir(), 0o711)))
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        log.warning(
            "spawn_helper_missing",
            why=str(e) or type(e).__name__,
            costs="setpriv, a shell, env and stat per job process (~4 ms of CPU)",
        )
        return ""


def usable(path: Path) -> bool:
    """`path` is a helper this process may run: a regular file of root's, mode 0111 (only
    root may have made it so in the init's directory, which only root may write)."""
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(path)
        return stat.S_ISREG(st.st_mode) and st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o111
    return False


def _installed(source: bytes, where: Path) -> Path:
    """The helper built from `source` in `where`, named by the source's digest; built and
    checked in a private directory there, then renamed into place (two executors building
    at once each put a whole one there)."""
    target = where / f"spawn-{hashlib.sha256(source).hexdigest()[:16]}"
    if usable(target):
        return target
    cc = shutil.which("cc", path=_BIN_PATH) or shutil.which("gcc", path=_BIN_PATH)
    if cc is None:
        raise ValueError(f"no C compiler (cc) in {_BIN_PATH}")
    with tempfile.TemporaryDirectory(dir=where, prefix=".build-") as build:
        src, out = Path(build) / "spawnhelper.c", Path(build) / "spawn"
        src.write_bytes(source)
        env = {"PATH": _BIN_PATH, "TMPDIR": build, "LC_ALL": "C"}  # none of the host's CFLAGS
        done = subprocess.run(
            [cc, "-static", "-O2", "-o", str(out), str(src)],
            cwd=build,
            env=env,
            capture_output=True,
            timeout=_BUILD_TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            said = done.stderr.decode(errors="replace").strip()[-300:]
            raise ValueError(f"{cc} -static failed: {said}")
        check = subprocess.run([str(out), "--statfs", "/"], capture_output=True, check=False)
        if not check.stdout.startswith(b"tmpfs / "):
            raise ValueError(f"the built helper does not work: {check!r}")
        os.chmod(out, 0o111)
        os.replace(out, target)
    return target
