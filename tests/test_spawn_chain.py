"""A sandboxed job's process is started without a `preexec_fn` (issue 26): CPython vforks
the executor, and an exec chain (`setpriv`, then a shell as the job: executor/spawn.py
`chain`; or one exec of the spawn helper, executor/spawnhelper.py, where it was built:
each test runs both) does what the `preexec_fn` did. Every guarantee is kept: the job's uid, gid and
saved ids, no groups, no_new_privs, no capability, the phase's control groups and
rlimits, and death with the executor, killed at any line. Real job uids, bubblewrap and
signals; as root, as CI runs."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from executor import isolation, shellinit, spawnhelper
from executor.caps import JobCaps
from executor.isolation import Isolation, Jail
from tests.caps_support import NO_SANDBOX
from tests.helpers import eventually
from tests.jail_support import jails as jails  # the fixture
from tests.jail_support import run_as_job

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="job uids need root")
SANDBOX = pytest.param(
    "sandbox", marks=pytest.mark.skipif(bool(NO_SANDBOX), reason=f"no sandbox: {NO_SANDBOX}")
)
MODES = ["user", SANDBOX]

CAPS = JobCaps(cpu_seconds=1234, disk=3 * 1024**3, processes=77)


def _jail(tmp_path: Path, name: str = "phase", mode: str = "sandbox") -> Jail:
    root, tmp = tmp_path / "jobs" / name, tmp_path / f"tmp-{name}"
    root.mkdir(parents=True)
    tmp.mkdir()
    for path in (tmp_path, tmp_path / "jobs", tmp):
        path.chmod(0o711)  # the sandbox's job crosses them to its own directory
    return Isolation.choose(mode, caps=CAPS).enter(root, tmp)


@pytest.fixture(autouse=True)
def umask() -> Iterator[None]:
    """As every runplane command runs (README): the groups it makes are 0700."""
    before = os.umask(0o077)
    yield
    os.umask(before)


@pytest.fixture(params=["helper", "tools"])
def chain(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The exec chain by the spawn helper, or by the tools it stands in for (setpriv, a
    shell, env, stat: a host where it could not be built)."""
    if request.param == "tools":
        for module in (isolation, shellinit):
            monkeypatch.setattr(module, "spawn_helper", lambda: "")
    elif not spawnhelper.spawn_helper():
        pytest.skip("the spawn helper cannot be built here (no cc -static)")
    shellinit.script.cache_clear()  # the init's script names the helper, or env and stat
    yield request.param
    shellinit.script.cache_clear()


async def _run(jail: Jail, argv: list[str], tmp_path: Path) -> tuple[int, str]:
    return await run_as_job(jail, argv, tmp_path / "step.log")


@pytest.mark.parametrize("mode", MODES)
async def test_a_job_is_spawned_without_a_preexec_fn_nor_a_uid_switch(
    tmp_path: Path, jails: list[Jail], mode: str, chain: str
) -> None:
    """What makes CPython fork the ~100 MB executor instead of vforking it."""
    jail = _jail(tmp_path, mode=mode)
    jails.append(jail)
    how = jail.spawn(["/bin/true"], {}, jail.home)
    assert not {"preexec_fn", "user", "group", "extra_groups"} & set(how.options), how.options
    assert how.options["start_new_session"] and how.options["umask"] == 0o077
    first = "setpriv" if chain == "tools" else os.path.basename(spawnhelper.spawn_helper())
    assert os.path.basename(how.argv[0]) == first and "--no-new-privs" in how.argv
    death = "KILL" if mode == "sandbox" else "TERM"  # the sandbox's init: TERM inside
    assert how.argv[how.argv.index("--pdeathsig") + 1] == death


LOOK = """
grep -E '^(Uid|Gid|Groups|NoNewPrivs|CapPrm|CapEff|CapInh|CapAmb):' /proc/self/status
grep -E '^Max (cpu time|file size|core file size|processes) ' /proc/self/limits
cat /proc/self/cgroup
umask
python3 -c '
import os
for how in (lambda: os.setresuid(0, 0, 0), lambda: os.setgid(0), lambda: os.setgroups([0])):
    try:
        how(); print("regained")
    except OSError:
        print("refused")
'
"""


@pytest.mark.parametrize("mode", MODES)
async def test_a_job_has_its_ids_caps_groups_and_rlimits_and_cannot_regain_root(
    tmp_path: Path, jails: list[Jail], mode: str, chain: str
) -> None:
    """The chain's job is the `preexec_fn`'s: the phase's uid and gid, real, effective and
    saved; no supplementary group; no_new_privs; no capability; in the phase's control
    groups; the phase's rlimits; umask 077. Its attempts to set its ids back to root's
    are refused."""
    jail = _jail(tmp_path, mode=mode)
    jails.append(jail)
    assert jail.uid is not None and jail.limits is not None
    code, log = await _run(jail, ["/bin/sh", "-c", LOOK], tmp_path)
    assert code == 0, log
    lines = {line.split(":")[0]: line for line in log.splitlines()}
    assert lines["Uid"].split()[1:] == [str(jail.uid)] * 4, log
    assert lines["Gid"].split()[1:] == [str(jail.uid)] * 4, log
    assert lines["Groups"].split() == ["Groups:"], log
    assert lines["NoNewPrivs"].split()[1] == "1", log
    for cap in ("CapPrm", "CapEff", "CapInh", "CapAmb"):
        assert lines[cap].split()[1] == "0" * 16, log
    assert "Max cpu time              1234                 1239 " in log, log
    disk = str(3 * 1024**3)
    assert f"Max file size             {disk}           {disk} " in log, log
    assert "Max core file size        0                    0 " in log, log
    group = jail.limits.group
    if group is not None:  # a host with control groups: the job is in the phase's
        for controller, path in group.dirs.items():
            name = str(path).split("/", 5)[-1]  # below /sys/fs/cgroup/<hierarchy>/
            assert f":/{name}\n" in log, (controller, name, log)
    else:
        assert "Max processes             77                   77 " in log, log
    assert "\n0077\n" in log, log
    assert log.count("refused") == 3 and "regained" not in log, log


ESCAPE = """
for f in "$@" /sys/fs/cgroup/*/cgroup.procs /sys/fs/cgroup/*/*/cgroup.procs \
         /sys/fs/cgroup/*/*/*/cgroup.procs; do
  (echo 0 > "$f") 2>/dev/null && echo "joined $f"
done
cat /proc/self/cgroup
echo done
"""


@pytest.mark.skipif(bool(NO_SANDBOX), reason=f"no sandbox: {NO_SANDBOX}")
async def test_a_job_can_join_no_other_group_through_the_files_delegated_to_its_uid(
    tmp_path: Path, jails: list[Jail], chain: str
) -> None:
    """Attack: the phase's `cgroup.procs` is its uid's (the chain joins by path). A job
    writes itself into every group's file it can see, its neighbour phase's (another
    org's uid) and the host's too: every write is refused (the sandbox's /sys is
    read-only; outside it the others are root's or another uid's), and it stays in its
    own phase's groups. Outside the sandbox, as the same uid, the neighbour's file is
    refused too, and so is every group above its own."""
    jail, other = _jail(tmp_path), _jail(tmp_path, "other")
    jails += [jail, other]
    assert jail.limits is not None and other.limits is not None and other.uid is not None
    if jail.limits.group is None:
        pytest.skip("no control groups on this host")
    delegated = other.limits.by_path()  # delegated to the neighbour's uid, as at its first spawn
    assert delegated
    files = [*jail.limits.group.procs_files(), *delegated]  # its own too
    code, log = await _run(jail, ["/bin/sh", "-c", ESCAPE, "sh", *map(str, files)], tmp_path)
    assert code == 0 and log.strip().endswith("done"), log
    assert "joined" not in log, log
    for path in jail.limits.group.dirs.values():
        assert f":/{str(path).split('/', 5)[-1]}\n" in log, log
    assert other.limits.group is not None
    for mine, theirs in zip(
        jail.limits.group.procs_files(), other.limits.group.procs_files(), strict=True
    ):
        # as the job's uid outside the sandbox (the chain's shell): its own phase's group
        # takes it (the check below is no broken shell), its neighbour's and the groups
        # above (its executor's scope, runplane's, the host's) refuse it
        assert _join_as(jail.uid, mine) == 0, mine
        for path in (theirs, mine.parent.parent / "cgroup.procs", mine.parents[2] / "cgroup.procs"):
            assert _join_as(jail.uid, path) != 0, f"{path} took a process of another phase"


def _join_as(uid: int | None, procs: Path) -> int:
    """The exit status of a shell as `uid` that writes itself into `procs`."""
    argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    argv += ["/bin/sh", "-c", 'echo 0 > "$1"', "sh", str(procs)]
    return subprocess.run(argv, capture_output=True, check=False).returncode


@pytest.mark.parametrize("mode", MODES)
def test_the_chain_runs_nothing_once_its_executor_is_gone(
    tmp_path: Path, jails: list[Jail], mode: str, chain: str
) -> None:
    """The race a parent death signal leaves: the executor killed after the vfork but
    before `setpriv` set the signal, which then never comes. The chain's shell finds its
    parent is not the executor any more and execs nothing: here the parent it expects is
    another process (the same as one whose executor died: its parent is init)."""
    jail = _jail(tmp_path, mode=mode)
    jails.append(jail)
    marker = jail.home / "ran"
    how = jail.spawn(["/bin/sh", "-c", f"touch {marker}"], {"PATH": "/usr/bin:/bin"}, jail.home)
    at = how.argv.index("runplane-spawn") + 1
    assert how.argv[at] == str(os.getpid())
    for parent, ran in ((str(os.getppid()), False), (str(os.getpid()), True)):
        argv = [*how.argv[:at], parent, *how.argv[at + 1 :]]
        done = subprocess.run(argv, env=how.env, cwd=how.cwd, check=False, **how.options)
        assert (done.returncode == 0) is ran and marker.exists() is ran, (parent, done)


KILLED = """
import asyncio, sys
from pathlib import Path
from executor.caps import JobCaps
from executor.isolation import Isolation
from executor.output import Masker
from executor.process import StepLog, run

async def main():
    base = Path(sys.argv[1])
    isolation = Isolation.choose(sys.argv[2], caps=JobCaps())
    jail = isolation.enter(base / "jobs" / "phase", base / "tmp")
    (base / "uid").write_text(str(jail.uid))
    log = StepLog(base / "step.log", Masker())
    await run(["/bin/sh", "-c", "setsid sleep 300 & echo started; sleep 300"],
              cwd=jail.home, env={"PATH": "/usr/bin:/bin"}, step_log=log, jail=jail)

asyncio.run(main())
"""


@pytest.mark.parametrize("mode", MODES)
async def test_a_job_dies_when_its_executor_is_killed(tmp_path: Path, mode: str) -> None:
    """kill -9 of the executor while its job (and a daemon in a session of its own) run:
    every process of the job's uid is gone, bwrap's and the chain's too."""
    base = Path(tempfile.mkdtemp(dir=tmp_path))  # the scope of its groups: a name of its own
    (base / "jobs" / "phase").mkdir(parents=True)
    (base / "tmp").mkdir()
    for path in (tmp_path, base, base / "jobs", base / "tmp"):
        path.chmod(0o711)
    executor = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        KILLED,
        str(base),
        mode,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=(tmp_path / "executor.err").open("wb"),
        cwd=Path(__file__).parent.parent,
    )

    async def said() -> int:
        assert executor.returncode is None, (tmp_path / "executor.err").read_text()
        text = (base / "uid").read_text() if (base / "uid").exists() else ""
        return int(text) if text.strip() else 0

    uid = await eventually(said, timeout=30, what="the executor's job uid")
    log = base / "step.log"

    async def started() -> bool:
        return log.exists() and "started" in log.read_text() and len(_pids_of(uid)) >= 3

    await eventually(started, timeout=30, what="the job and its daemon started")
    executor.kill()
    await executor.wait()

    async def gone() -> bool:
        return not _pids_of(uid)

    try:
        await eventually(gone, timeout=20, what="every process of the job's uid gone")
    finally:  # its phase group, which the next executor's sweep removes
        Isolation.choose(mode, caps=JobCaps()).sweep(base.name)


def _pids_of(uid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        try:
            status = Path(f"/proc/{name}/status").read_text() if name.isdigit() else ""
        except OSError:
            continue
        line = next((x for x in status.splitlines() if x.startswith("Uid:")), "")
        if line.split()[1:2] == [str(uid)] and "State:\tZ" not in status:
            found.append(int(name))
    return found
