"""A short phase's isolation is cheap and what it reuses carries nothing across.

A job uid is reused from phase to phase, across organizations (executor/uids.py). In the
sandbox with a phase control group, a phase's end neither kills the uid's processes nor
sweeps the shared directories and SysV IPC for it (executor/isolation.py `Jail.close`):
its processes were all in the group, and the sandbox gave it no place to leave anything
but its own directories. These are the attacks on that: a job leaves all it can and the
next holder of its uid, another organization's perhaps, finds none of it. Also: a clean
uid is found without a look at what runs; a small tree is removed in-process, never
following a link; a custom step's checkout owns its objects without `git repack`.
Real uids, real bubblewrap, real cgroups, as root.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from executor import uids
from executor.gitrepo import copy_borrowed, write_repository
from executor.isolation import Isolation, Jail, sandbox_problem
from executor.jobfiles import remove_tree, world_writable
from executor.uids import DEFAULT_UIDS
from tests.caps_support import kill_uid_calls, live_pids_of

NO_SANDBOX = sandbox_problem(DEFAULT_UIDS[-1]) if os.geteuid() == 0 else "not root"
sandboxed = pytest.mark.skipif(bool(NO_SANDBOX), reason=f"no sandbox: {NO_SANDBOX}")
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="job uids need root")

UID = 1_600_700_000 + (os.getpid() % 10_000) * 4  # this module's own
PATH = {"PATH": "/usr/bin:/bin"}


def _iso(tmp_path: Path, *, cgroups: bool = True, size: int = 1) -> Isolation:
    chosen = Isolation.choose("sandbox", cgroups=cgroups)
    return replace(chosen, uids=range(UID, UID + size), lock_dir=tmp_path / "locks")


def _enter(iso: Isolation, tmp_path: Path, name: str) -> Jail:
    root, tmp = tmp_path / "jobs" / name, tmp_path / "tmp"
    root.mkdir(parents=True)
    tmp.mkdir(exist_ok=True)
    return iso.enter(root, tmp)


async def _sh(jail: Jail, script: str) -> tuple[int, str]:
    """`script` run by /bin/sh as the jail's job, in its sandbox; exit code and output."""
    how = jail.spawn(["/bin/sh", "-c", script], PATH, jail.home)
    proc = await asyncio.create_subprocess_exec(
        *how.argv,
        cwd=how.cwd,
        env=how.env,
        stdin=how.stdin if how.stdin >= 0 else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        pass_fds=how.keep_fds,
        **how.options,
    )
    out, _ = await proc.communicate()
    return await proc.wait(), out.decode()


def _files_of(uid: int) -> list[str]:
    """What `uid` owns at the top of the host's world-writable directories."""
    out = []
    for place in world_writable():
        for entry in os.scandir(place):
            try:
                if entry.stat(follow_symlinks=False).st_uid == uid:
                    out.append(entry.path)
            except OSError:
                continue
    return out


def _ipc_of(uid: int) -> list[str]:
    out = []
    for table in ("shm", "sem", "msg"):
        head, *rows = Path(f"/proc/sysvipc/{table}").read_text().splitlines()
        at, cat = head.split().index("uid"), head.split().index("cuid")
        out += [r for r in rows if uid in (int(r.split()[at]), int(r.split()[cat]))]
    return out


LEAVE = (
    "setsid sleep 300 </dev/null >/dev/null 2>&1 & "
    "echo A-SECRET > /tmp/left; mkdir -p /var/tmp/d /run/lock; echo A > /var/tmp/d/f; "
    "echo A > /dev/shm/left; echo A > /run/lock/left; echo A > $HOME/left; "
    "echo A > $TMPDIR/left; ipcmk -M 4096 >/dev/null && ipcmk -Q >/dev/null && echo made"
)
LOOK = (
    "cat /tmp/left /var/tmp/d/f /dev/shm/left /run/lock/left $HOME/left $TMPDIR/left "
    "2>/dev/null; ipcs -m -q | grep -c '^0x' ; ps -e -o comm= | grep -c sleep; echo looked"
)


@as_root
@sandboxed
async def test_a_sandboxed_job_leaves_nothing_for_the_next_holder_of_its_uid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack: organization A's job leaves a daemon in a session of its own, files in
    /tmp, /var/tmp, /dev/shm, /run/lock, its HOME and TMPDIR, a SysV segment and a
    message queue. Its phase ends and gives the uid back clean with no kill of the uid nor
    sweep; organization B's next phase gets the same uid at once and finds none of it,
    in its sandbox or anywhere on the host. (Checked to fail with a sandbox that shares
    the host's /tmp, /run and IPC: `_bwrap_argv` without its tmpfs mounts and
    `--unshare-ipc`, the rest as here.)"""
    iso = _iso(tmp_path)
    assert iso.limits.cgroups, "this host gives the phase a control group"
    kills = kill_uid_calls(monkeypatch)
    a = _enter(iso, tmp_path, "org-a")
    kills.clear()  # its first holder: a uid never given back clean is swept as it is taken
    code, out = await _sh(a, LEAVE)
    assert code == 0 and "made" in out, out
    a_home, a_tmp = a.home, a.tmp
    a.close()
    assert (tmp_path / "locks" / str(UID)).read_bytes() == uids.CLEAN
    assert kills == [], "the sandbox's end needs no kill of its uid"
    assert not live_pids_of(UID), "a daemon of the job outlived its phase"
    assert not _files_of(UID), "a file of the job is left in a shared directory"
    assert not _ipc_of(UID), "a SysV object of the job outlived its phase"
    b = _enter(iso, tmp_path, "org-b")
    try:
        assert b.uid == UID and kills == [], "the clean uid serves at once, no sweep"
        code, out = await _sh(b, LOOK)
        assert "A" not in out and out.split() == ["0", "0", "looked"], out
        # A's directories are sealed (the executor's, 0700) until they are removed.
        code, out = await _sh(b, f"cat {a_home}/left {a_tmp}/left; echo done")
        assert "A" not in out and "done" in out, out
    finally:
        b.close()


@as_root
@sandboxed
async def test_a_sandbox_without_a_phase_group_still_sweeps_its_uid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a control group (none on the host, or --no-cgroups) a process of the job
    might outlive its sandbox's end (an init stopping gracefully): the phase's end kills
    every process of the uid and sweeps, as the uid mode does."""
    iso = _iso(tmp_path, cgroups=False)
    kills = kill_uid_calls(monkeypatch)
    jail = _enter(iso, tmp_path, "a")
    kills.clear()
    code, out = await _sh(jail, "echo ran")
    assert code == 0 and "ran" in out
    jail.close()
    assert kills == [UID]
    assert (tmp_path / "locks" / str(UID)).read_bytes() == uids.CLEAN


@as_root
def test_a_clean_uid_is_found_without_a_look_at_what_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lower uids left dirty by killed executors (their lock files empty) cost each phase
    a look at all of /proc and every jobs directory; a clean uid further on is taken
    first, with no look. A dirty one is still looked at before it serves."""
    locks = tmp_path / "locks"
    locks.mkdir(mode=0o700)
    (locks / str(UID)).write_bytes(b"")  # dirty, held by no one
    (locks / str(UID + 1)).write_bytes(b"")
    (locks / str(UID + 2)).write_bytes(uids.CLEAN)
    looks: list[int] = []
    real = uids.uids_in_use

    def counted() -> set[int]:
        looks.append(1)
        return real()

    monkeypatch.setattr(uids, "uids_in_use", counted)
    uid, fd, clean = uids.allocate(range(UID, UID + 3), locks)
    try:
        assert (uid, clean, looks) == (UID + 2, True, [])
        uid2, fd2, clean2 = uids.allocate(range(UID, UID + 3), locks)
        os.close(fd2)
        assert (uid2, clean2, looks) == (UID, False, [1]), "a dirty uid is looked at"
    finally:
        os.close(fd)


def test_a_small_tree_is_removed_in_process_without_following_a_link(tmp_path: Path) -> None:
    """A job's directory with a link to a directory outside and one to a file outside:
    the links go, what they point at stays; a tree past the in-process bound goes too
    (by `rm`)."""
    outside = tmp_path / "outside"
    (outside / "d").mkdir(parents=True)
    (outside / "d" / "keep").write_text("k")
    (outside / "f").write_text("k")
    job = tmp_path / "job"
    (job / "a" / "b").mkdir(parents=True)
    (job / "a" / "b" / "x").write_text("x")
    (job / "a" / "dlink").symlink_to(outside / "d")
    (job / "flink").symlink_to(outside / "f")
    assert remove_tree(job)
    assert not job.exists() and (outside / "d" / "keep").exists() and (outside / "f").exists()
    big = tmp_path / "big"
    big.mkdir()
    for i in range(2100):
        (big / str(i)).write_text("")
    assert remove_tree(big) and not big.exists()


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, check=True
    ).stdout.strip()


@pytest.mark.parametrize("packed", [False, True])
def test_a_checkout_owns_its_objects_once_copied_from_the_mirror(
    tmp_path: Path, packed: bool
) -> None:
    """The clone borrows the mirror's objects; once they are copied in (loose ones and
    whole packs) it needs the mirror no more: with the mirror gone, its history reads and
    `git fsck` finds every object."""
    src = tmp_path / "src"
    src.mkdir()
    _git("init", "-q", "-b", "main", cwd=src)
    for i in range(3):
        (src / "main.tf").write_text(f"# {i}\n")
        _git("add", ".", cwd=src)
        _git("-c", "user.name=a", "-c", "user.email=a@b", "commit", "-qm", f"c{i}", cwd=src)
    mirror = tmp_path / "mirror.git"
    _git("clone", "-q", "--mirror", str(src), str(mirror), cwd=tmp_path)
    if packed:
        _git("gc", "-q", cwd=mirror)
    sha = _git("rev-parse", "HEAD", cwd=src)
    dest = tmp_path / "dest"
    write_repository(dest, mirror, str(src), sha, "main")
    alternates = dest / ".git" / "objects" / "info" / "alternates"
    assert copy_borrowed(dest / ".git" / "objects", alternates)
    alternates.unlink()
    mirror.rename(tmp_path / "gone.git")
    assert _git("log", "--format=%s", cwd=dest).split() == ["c2", "c1", "c0"]
    _git("fsck", "--strict", "--no-dangling", cwd=dest)
    _git("read-tree", "--reset", "-u", "HEAD", cwd=dest)
    assert (dest / "main.tf").read_text() == "# 2\n"


def test_attack_a_directory_swapped_for_a_link_mid_removal_does_not_lead_outside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The in-process removal runs as root. If anything of the job still ran as its tree
    is removed (a process that escaped the kill, or a removal raced with its end), it
    could swap a directory already listed for a link to another place: a removal by path
    (`here/name`) then unlinks the same names there (/etc/passwd...). Here the swap is
    made just before the first unlink, as that process would; what the link points at
    stays, because each entry is removed relative to the directory actually listed."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_text("not the job's")
    job = tmp_path / "job"
    (job / "a" / "x").mkdir(parents=True)
    (job / "a" / "x" / "victim").write_text("the job's")
    real = os.unlink
    swapped: list[bool] = []

    def racing(path: object, *args: object, **kw: object) -> None:
        if not swapped:
            swapped.append(True)
            os.rename(job / "a" / "x", job / "a" / "moved")
            (job / "a" / "x").symlink_to(outside)
        real(path, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "unlink", racing)
    remove_tree(job)
    monkeypatch.setattr(os, "unlink", real)
    assert swapped
    assert (outside / "victim").exists(), "the removal followed a swapped-in link"
    assert remove_tree(job) and not job.exists()
