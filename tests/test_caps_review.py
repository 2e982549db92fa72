"""The job caps after an attacker's review: what a job could hide from the disk cap
(files unlinked while open, millions of empty files), a job killing its own init in the
uid mode, the bwrap mode's caps, and the cores a phase may use. Real job uids, control
groups and processes; these tests run as root, as CI does."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from events.run import RunState, Workspace
from events.templates import SaveTemplate, TemplateStep
from executor import Executor
from executor.caps import JobCaps
from executor.cgroups import TOP
from executor.diskuse import walk
from executor.errors import IsolationError
from executor.isolation import Isolation, Jail
from executor.output import Masker
from executor.process import StepLog, run, spawn
from infra.options import ConfigError, Options
from infra.streams import dispatch_subject
from services.app.commands import App
from services.app.snapshot import Snapshotter
from services.root.cli import options, parser
from tests.bootstrap_support import Process
from tests.executor_support import commit
from tests.helpers import eventually

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="job uids need root")

MiB = 1024**2


def _jail(tmp_path: Path, caps: JobCaps, *, cgroups: bool = True) -> Jail:
    iso = Isolation.choose("user", caps=caps, cgroups=cgroups)
    root, tmp = tmp_path / "jobs" / "phase", tmp_path / "tmp"
    root.mkdir(parents=True)
    tmp.mkdir()
    return iso.enter(root, tmp)


@pytest.fixture
def jails(tmp_path: Path) -> Iterator[list[Jail]]:
    made: list[Jail] = []
    yield made
    for jail in made:
        jail.close()


async def _started(jail: Jail, script: str) -> asyncio.subprocess.Process:
    """`python3 -c script` as the job, in its home; once it printed its first line."""
    python = "/usr/bin/python3"
    proc = await spawn(
        [python, "-c", script], cwd=jail.home, env={}, jail=jail, stderr=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 60)
    assert line.strip() == b"ready", line
    return proc


async def _end(jail: Jail, proc: asyncio.subprocess.Process) -> None:
    """Kill the job, and wait for its output to end (asyncio's wait waits for it)."""
    await asyncio.to_thread(jail.kill)
    await asyncio.wait_for(proc.wait(), 30)


HIDE = """
import os, time
held = []
for i in range(3):
    with open("f", "wb") as f:
        f.write(b"x" * (12 * 1024 * 1024))
    held.append(os.open("f", os.O_RDONLY))
    os.unlink("f")
print("ready", flush=True)
time.sleep(300)
"""


@pytest.mark.parametrize("cgroups", [True, False], ids=["cgroup", "rlimits"])
async def test_files_unlinked_while_held_open_count_against_the_disk_cap(
    tmp_path: Path, jails: list[Jail], cgroups: bool
) -> None:
    """Attack: write a file up to the cap, keep it open, unlink it, repeat. The walk of
    the job's directory saw nothing (main: no cap exceeded with 36 MiB held on a 16 MiB
    cap); the phase's processes' descriptors are read too."""
    jail = _jail(tmp_path, JobCaps(disk=16 * MiB), cgroups=cgroups)
    jails.append(jail)
    proc = await _started(jail, HIDE)
    over = await asyncio.to_thread(jail.check)
    assert over is not None, "36 MiB held in unlinked files passed a 16 MiB cap"
    assert over.cap == "disk" and "3 unlinked files held open" in over.message, over.message
    await _end(jail, proc)


MAP = """
import mmap, os, time
maps = []
for i in range(2):
    fd = os.open("f", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 12 * 1024 * 1024)
    m = mmap.mmap(fd, 12 * 1024 * 1024)
    m[:] = b"x" * len(m)
    maps.append(m)
    os.close(fd)
    os.unlink("f")
print("ready", flush=True)
time.sleep(300)
"""


async def test_a_file_held_only_by_a_mapping_counts_too(tmp_path: Path, jails: list[Jail]) -> None:
    """The same with no descriptor left: a mapping keeps the blocks."""
    jail = _jail(tmp_path, JobCaps(disk=16 * MiB))
    jails.append(jail)
    proc = await _started(jail, MAP)
    over = await asyncio.to_thread(jail.check)
    assert over is not None and over.cap == "disk", over
    await _end(jail, proc)


async def test_a_job_within_its_disk_cap_is_not_taken_for_over_it(
    tmp_path: Path, jails: list[Jail]
) -> None:
    jail = _jail(tmp_path, JobCaps(disk=64 * MiB))
    jails.append(jail)
    proc = await _started(jail, HIDE)
    assert await asyncio.to_thread(jail.check) is None
    await _end(jail, proc)


EMPTY = """
import os
for i in range(3000):
    os.symlink("x", f"l{i}")
print("ready", flush=True)
"""


async def test_files_past_the_files_cap_fail_the_phase(tmp_path: Path, jails: list[Jail]) -> None:
    """Attack: millions of empty files or links take no blocks, only inodes and each
    walk's time (main: no cap; each 1 s walk of them ran on as root). Here 3,000 links
    on a cap of 1,000."""
    jail = _jail(tmp_path, JobCaps(files=1000))
    jails.append(jail)
    proc = await _started(jail, EMPTY)
    await proc.wait()
    over = await asyncio.to_thread(jail.check)
    assert over is not None and over.cap == "files", over
    assert over.message.startswith("resource_limit_exceeded: files 1000"), over.message


def test_the_walk_stops_once_past_its_most_files(tmp_path: Path) -> None:
    """Its cost is bounded by the cap, not by what the job made."""
    for i in range(5000):
        (tmp_path / f"f{i}").touch()
    cut = walk([tmp_path], most_files=100)
    assert not cut.complete and cut.files <= 101 + 1, cut
    whole = walk([tmp_path])
    assert whole.complete and whole.files == 5001, whole
    assert walk([tmp_path], stop=lambda: True).files == 0


async def test_a_closed_jail_ends_a_walk_at_once(tmp_path: Path) -> None:
    """close() does not wait for the watch's walk, which stops and says nothing (main:
    the walk held the lock through, close waited, and the closed phase was found over
    its cap)."""
    jail = _jail(tmp_path, JobCaps(disk=1))
    for i in range(20):
        sub = jail.home / f"d{i}"
        sub.mkdir()
        for j in range(2000):
            (sub / f"f{j}").touch()
    checking = asyncio.ensure_future(asyncio.to_thread(jail.check))
    await asyncio.sleep(0.05)
    began = time.monotonic()
    await asyncio.to_thread(jail.close)
    closed = time.monotonic() - began
    assert await checking is None
    assert closed < 5, closed


INIT_KILLER = "setsid sleep 300 >/dev/null 2>&1 & kill -9 $PPID; exec sleep 301"


async def test_a_job_that_kills_its_own_init_has_all_its_processes_killed_at_once(
    tmp_path: Path, jails: list[Jail]
) -> None:
    """Attack (uid mode: the job's init is its own uid): start a daemon, kill -9 the
    init and keep the step's output open. Nothing would then bring the daemon down with
    the executor; on main the step waited for its output (here 301 s) and the daemon
    lived on. The init's death by a signal now kills every process of the phase."""
    jail = _jail(tmp_path, JobCaps())
    jails.append(jail)
    assert jail.uid is not None
    log = StepLog(tmp_path / "step.log", Masker())
    began = time.monotonic()
    code = await asyncio.wait_for(
        run(
            ["/bin/sh", "-c", INIT_KILLER], cwd=jail.home, env={}, step_log=log, jail=jail, grace=1
        ),
        60,
    )
    log.close()
    assert code == -9, code
    assert time.monotonic() - began < 30

    async def gone() -> bool:
        assert jail.uid is not None
        return not _pids_of(jail.uid)

    await eventually(gone, timeout=10, what="every process of the job's uid gone")


def _pids_of(uid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and os.stat(f"/proc/{name}").st_uid == uid:
                found.append(int(name))
        except OSError:
            continue
    return found


def test_the_bwrap_mode_refuses_a_network_of_none_it_cannot_serve_state_in() -> None:
    """main accepted it, and every plan then failed to reach its state backend."""
    with pytest.raises(IsolationError, match="--job-network none needs"):
        Isolation.choose("bwrap", network="none")


def test_the_bwrap_mode_says_which_caps_it_does_not_hold() -> None:
    said = Isolation.choose("bwrap").caps_said()
    assert said["memory 2 GiB"].startswith("NOT HELD"), said
    assert said["disk 10 GiB"].startswith("NOT HELD"), said
    assert said["tmpfs 256 MiB"].startswith("tmpfs size"), said


SPIN = """
import time
print("ready", flush=True)
end = time.monotonic() + 3
while time.monotonic() < end:
    pass
"""


async def test_a_phase_uses_no_more_cores_than_its_cpus_cap(
    tmp_path: Path, jails: list[Jail]
) -> None:
    """--job-cpus: the phase's group has a CFS quota (main: a job could take every core
    of the host from the executor and the other jobs)."""
    jail = _jail(tmp_path, JobCaps(cpus=0.1))
    jails.append(jail)
    assert jail.limits is not None and jail.limits.group is not None
    group = jail.limits.group.dirs.get("cpus")
    if group is None:
        pytest.skip("no cgroup cpu controller on this host")
    quota = (group / "cpu.cfs_quota_us").read_text().strip()
    assert quota == "10000", quota
    proc = await _started(jail, SPIN)
    await proc.wait()
    throttled = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
    assert int(throttled["nr_throttled"]) > 0, throttled
    assert jail.limits.group.cpu_seconds() < 3 * 0.1 + 0.5


def test_the_jobs_weigh_on_the_cpu_as_one_busy_process_per_core(
    tmp_path: Path, jails: list[Jail]
) -> None:
    """The group every phase of the host sits under (`runplane/`) weighs one busy process
    per core against the processes outside it (main: one process, whatever the number
    of phases, so a sandboxed Terraform got half the CPU of the same one run by hand at
    a load of 5: bench/README.md, overhead). Its own quota still holds (above)."""
    jail = _jail(tmp_path, JobCaps())
    jails.append(jail)
    assert jail.limits is not None and jail.limits.group is not None
    group = jail.limits.group.dirs.get("cpus")
    if group is None:
        pytest.skip("no cgroup cpu controller on this host")
    top = group.parent.parent  # runplane/<scope>/<phase>
    assert top.name == TOP
    cores = os.cpu_count() or 1
    if jail.limits.group.version["cpus"] == 1:
        assert (top / "cpu.shares").read_text().strip() == str(1024 * cores)
    else:
        assert (top / "cpu.weight").read_text().strip() == str(min(10_000, 100 * cores))


SEMAPHORES = (
    'python3 -c "import ctypes; libc = ctypes.CDLL(None); '
    'print(sum(libc.semget(0, 1, 0o1600) >= 0 for _ in range(3000)))"'
)


async def test_a_phase_whose_end_is_slow_does_not_stall_the_executors_event_loop(
    nc: NATS, app: App, process: Process, repo: Path, executor: Executor
) -> None:
    """Attack: a job leaves 3,000 SysV semaphores, which its phase's end removes. On main
    that end ran on the event loop, one `ipcrm` each: every other phase's heartbeat (and
    everything else of the executor) waited ~9 s. Now it runs in a thread, and one
    `ipcrm` removes many."""
    scheduler = process(store=app.store, pinning=Snapshotter).app
    await app.create_org("acme", "alice")
    step = TemplateStep(number=100, kind="custom", name="sems", command=SEMAPHORES)
    await app.org_command("acme", SaveTemplate(actor="alice", name="sems", steps=[step]))
    await app.create_workspace("acme", "net", Workspace(repository=str(repo)), "alice")
    commit(repo, "# nothing\n")
    lags: list[float] = []

    async def watch() -> None:
        while True:
            began = time.monotonic()
            await asyncio.sleep(0.02)
            lags.append(time.monotonic() - began - 0.02)

    watching = asyncio.create_task(watch())
    try:
        run_id = str(
            (await app.create_run("acme", "net", "apply", "alice", template="sems")).state.run_id
        )
        assert await scheduler.admit_next("acme", "net") == run_id
        await scheduler.pin_run("acme", "net", run_id)  # type: ignore[attr-defined]
        body = {"org": "acme", "workspace": "net", "run_id": run_id, "phase": "custom-100"}
        await nc.jetstream().publish(dispatch_subject("default", "acme"), json.dumps(body).encode())

        async def ended() -> RunState:
            state: RunState = (await app.load_run("acme", "net", run_id)).state
            assert state.terminal, state.status
            return state

        done = await eventually(ended, timeout=60, what="the run ended")
        assert str(done.status) == "applied", done.error_message
    finally:
        watching.cancel()
    assert max(lags) < 1.5, f"the event loop stalled {max(lags):.1f} s"


def test_the_new_caps_are_settings_with_bounds() -> None:
    def opts(*args: str) -> Options:
        return options(parser().parse_args(["executor", *args]))

    assert opts().job_files == 200_000 and opts().job_cpus == 2.0
    got = opts("--job-files", "5000", "--job-cpus", "0.5")
    assert (got.job_files, got.job_cpus) == (5000, 0.5)
    assert opts("--job-cpus", "0").job_cpus == 0
    for bad in (["--job-files", "10"], ["--job-cpus", "-1"], ["--job-cpus", "lots"]):
        with pytest.raises(ConfigError):
            opts(*bad).check()
