"""The job's shell init (executor/shellinit.py), which replaced the Python init for its
cost: it keeps every guarantee of the Python one. Real job uids, bubblewrap and signals;
as root, as CI runs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import tempfile
from pathlib import Path

import pytest

from executor import shellinit
from executor.caps import JobCaps
from executor.isolation import Isolation, Jail
from executor.jobinit import read_reports
from executor.output import Masker
from executor.process import StepLog, run
from tests.caps_support import NO_SANDBOX
from tests.helpers import eventually
from tests.jail_support import jails as jails  # the fixture
from tests.jail_support import run_as_job

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="job uids need root")

SANDBOX = pytest.param(
    "sandbox", marks=pytest.mark.skipif(bool(NO_SANDBOX), reason=f"no sandbox: {NO_SANDBOX}")
)

# The job's attack on its init: trace it (PTRACE_SEIZE, which stops nothing; the tracer's
# exit lets it go), which would let it keep the init from killing the job's daemons when
# the executor dies, and read its /proc files. Its init is its parent (the uid mode) or
# its namespace's process 1 (the sandbox).
TRACE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
init = os.getppid()
seized = libc.ptrace(0x4206, init, 0, 0) == 0
try:
    with open(f"/proc/{init}/environ", "rb"):
        environ = "read"
except OSError:
    environ = "refused"
print("seized" if seized else "refused", environ, flush=True)
"""


def _jail(tmp_path: Path, mode: str) -> Jail:
    # the scope of its control groups (the jobs directory's parent): a name of its own,
    # not the test's, which a session running the same test at once would share
    base = Path(tempfile.mkdtemp(dir=tmp_path))
    root, tmp = base / "jobs" / "phase", base / "tmp"
    root.mkdir(parents=True)
    tmp.mkdir()
    for path in (tmp_path, base, base / "jobs"):
        path.chmod(0o711)  # the sandbox's job crosses them to its own directory
    return Isolation.choose(mode, caps=JobCaps()).enter(root, tmp)


async def _run(jail: Jail, argv: list[str], tmp_path: Path) -> tuple[int, str]:
    return await run_as_job(jail, argv, tmp_path / "step.log")


@pytest.mark.parametrize("mode", ["user", SANDBOX])
async def test_a_job_starts_under_the_shell_init_not_the_python_one(
    tmp_path: Path, jails: list[Jail], mode: str
) -> None:
    """What the lifecycle benchmark lost ~24 ms of CPU per job process to (issue 23)."""
    jail = _jail(tmp_path, mode)
    jails.append(jail)
    argv = jail.spawn(["/bin/true"], {}, jail.home).argv
    assert shellinit.shell_init() in argv
    assert not any("python" in word for word in argv)


@pytest.mark.parametrize("mode", ["user", SANDBOX])
async def test_a_job_can_neither_trace_its_init_nor_read_its_proc_files(
    tmp_path: Path, jails: list[Jail], mode: str
) -> None:
    """Attack: a job traces its init (the same uid) to keep it from killing the job's
    daemons once the executor dies. The init is an execute-only copy of the shell, so the
    kernel makes it undumpable: refused, as the Python init's own prctl refused it."""
    jail = _jail(tmp_path, mode)
    jails.append(jail)
    code, log = await _run(jail, ["/usr/bin/python3", "-c", TRACE], tmp_path)
    assert code == 0, log
    assert "refused refused" in log, log


async def test_the_same_trace_takes_a_readable_shell_for_its_init(
    tmp_path: Path, jails: list[Jail], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attack above is real: with the system's own (readable) shell as the init, the
    job seizes it and reads its environment. What the execute-only copy prevents."""
    monkeypatch.setattr(shellinit, "shell_init", lambda: os.path.realpath("/bin/sh"))
    jail = _jail(tmp_path, "user")
    jails.append(jail)
    code, log = await _run(jail, ["/usr/bin/python3", "-c", TRACE], tmp_path)
    assert code == 0, log
    assert "seized read" in log, log


# The job ends only once the test has sent its signals (`sent`): all of them reach the
# init while the job is still stopping, as a dying executor's do. Without that wait, a
# test process held off the CPU for the job's ~50 ms between two of its kills (a loaded
# machine) sent the next one to an init already gone and reaped: ProcessLookupError.
TERMS = """
trap 'echo got TERM; echo $$ >> terms; while [ ! -e sent ]; do sleep 0.01; done; exit 7' TERM
setsid sleep 300 >/dev/null 2>&1 &
echo started
while :; do sleep 0.05; done
"""


async def test_however_many_death_signals_the_job_gets_one_sigterm_then_its_uid_is_killed(
    tmp_path: Path, jails: list[Jail]
) -> None:
    """A killed executor sends its job's init a parent death signal per thread it passes
    the init on to. The job (Terraform) must get exactly one SIGTERM (a second makes it
    exit at once, writing no errored.tfstate); once it has ended, the init kills every
    process of the uid, the daemon in a session of its own too."""
    jail = _jail(tmp_path, "user")
    jails.append(jail)
    assert jail.uid is not None
    log = StepLog(tmp_path / "step.log", Masker())
    task = asyncio.ensure_future(
        run(["/bin/sh", "-c", TERMS], cwd=jail.home, env={}, step_log=log, jail=jail)
    )

    async def started() -> bool:
        return "started" in (tmp_path / "step.log").read_text()

    await eventually(started, what="the job and its daemon started")
    init = _child_of_this_process(jail.uid)  # its init, the job's parent
    pidfd = os.pidfd_open(init)  # signals for this process only, never for a pid reused
    try:
        assert _child_of_this_process(jail.uid) == init  # the pidfd's: still the init
        for _ in range(3):
            signal.pidfd_send_signal(pidfd, signal.SIGTERM)
    finally:
        os.close(pidfd)
    (jail.home / "sent").touch()
    code = await asyncio.wait_for(task, 30)
    log.close()
    assert code == 7
    assert (tmp_path / "step.log").read_text().count("got TERM") == 1
    assert len((jail.home / "terms").read_text().split()) == 1

    async def gone() -> bool:
        assert jail.uid is not None
        return not _pids_of(jail.uid)

    await eventually(gone, timeout=10, what="every process of the uid gone, the daemon too")


@pytest.mark.parametrize("mode", ["user", SANDBOX])
async def test_exit_codes_and_signals_pass_through_the_init_and_it_says_nothing(
    tmp_path: Path, jails: list[Jail], mode: str
) -> None:
    """The job's status is the init's (128 + a signal for one killed), the job gets the
    group's SIGINT as it would without an init (a background job of a shell would ignore
    it) and its standard input is empty; the shell prints no `Killed` of its own."""
    jail = _jail(tmp_path, mode)
    jails.append(jail)
    assert await _run(jail, ["/bin/sh", "-c", "exit 3"], tmp_path) == (3, "")
    code, log = await _run(jail, ["/bin/sh", "-c", "kill -9 $$"], tmp_path)
    assert (code, log) == (137, "")
    looks = "grep SigIgn /proc/self/status; readlink /proc/self/fd/0; kill -INT $$; sleep 30"
    code, log = await _run(jail, ["/bin/sh", "-c", looks], tmp_path)
    assert code == 128 + signal.SIGINT, log
    assert "SigIgn:\t0000000000000000" in log and "/dev/null" in log, log


FORGE = """
for fd in /proc/self/fd/* /proc/1/fd/0; do (echo 'tmpfs /tmp 0 1' > "$fd") 2>/dev/null; done
echo done
"""


@pytest.mark.skipif(bool(NO_SANDBOX), reason=f"no sandbox: {NO_SANDBOX}")
async def test_a_sandboxed_job_cannot_forge_its_inits_report(
    tmp_path: Path, jails: list[Jail]
) -> None:
    """Attack: the init reports on its standard input which tmpfs mounts were full; the
    job writes a report of its own to every descriptor it has and to its init's. None
    reaches the executor: the phase is over no cap (a real full /tmp is: test_caps.py)."""
    jail = _jail(tmp_path, "sandbox")
    jails.append(jail)
    code, log = await _run(jail, ["/bin/sh", "-c", FORGE], tmp_path)
    assert code == 0 and log.strip().endswith("done"), log
    assert await asyncio.to_thread(jail.check) is None


def test_only_well_formed_reports_of_the_sandboxs_mounts_count() -> None:
    """A full mount is `tmpfs PLACE` (the Python init) or `tmpfs PLACE 0 BLOCKS` (the
    shell's `stat -f`); anything else, another place or a mount with room, is none."""
    read, write = os.pipe()
    lines = [
        "tmpfs /tmp 0 2048",
        "tmpfs /var/tmp 12 2048",
        "tmpfs /run",
        "tmpfs /etc 0 2048",
        "tmpfs /dev/shm 0 0",
        "tmpfs /dev/shm 0 x",
        "nonsense",
    ]
    os.write(write, ("\n".join(lines) + "\n").encode())
    try:
        assert read_reports(read) == ["/tmp", "/run"]
    finally:
        os.close(read)
        os.close(write)


def _pids_of(uid: int) -> list[int]:
    """The processes whose real uid is `uid`, oldest first."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            status = Path(f"/proc/{name}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("Uid:") and int(line.split()[1]) == uid:
                found.append(int(name))
    return sorted(found, key=_started_at)


def _child_of_this_process(uid: int) -> int:
    """The one process of `uid` whose parent is this process (the job's init)."""
    found = []
    for pid in _pids_of(uid):
        with contextlib.suppress(OSError):
            status = Path(f"/proc/{pid}/status").read_text()
            if f"\nPPid:\t{os.getpid()}\n" in status:
                found.append(pid)
    assert len(found) == 1, found
    return found[0]


def _started_at(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 1 << 62
