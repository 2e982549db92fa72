"""A job uid given back clean serves its next phase without a sweep first
(executor/uids.py `CLEAN`): its phase's end killed every process of it, removed what it
left in shared places and its SysV IPC objects, and sealed its directories, and nothing
runs as it until its next holder starts something. A uid whose phase did not end so (its
executor was killed) is swept before it serves again, as always. Real uids, as root."""

from __future__ import annotations

import asyncio
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from executor import isolation, uids
from executor.isolation import Isolation, Jail
from tests.caps_support import kill_uid_calls, live_pids_of
from tests.helpers import eventually

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="job uids need root")

UID = 1_600_500_000 + (os.getpid() % 10_000) * 4  # this module's own


def _iso(tmp_path: Path) -> Isolation:
    return replace(Isolation.choose("user"), uids=range(UID, UID + 1), lock_dir=tmp_path / "locks")


def _enter(iso: Isolation, tmp_path: Path, name: str) -> Jail:
    root, tmp = tmp_path / "jobs" / name, tmp_path / "tmp"
    root.mkdir(parents=True)
    tmp.mkdir(exist_ok=True)
    return iso.enter(root, tmp)


def test_a_uid_given_back_clean_serves_its_next_phase_without_a_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    iso = _iso(tmp_path)
    _enter(iso, tmp_path, "a").close()
    assert (tmp_path / "locks" / str(UID)).read_bytes() == uids.CLEAN
    kills = kill_uid_calls(monkeypatch)
    jail = _enter(iso, tmp_path, "b")
    assert jail.uid == UID and kills == [], "no sweep of a clean uid"
    assert (tmp_path / "locks" / str(UID)).read_bytes() == b"", "dirty while it serves"
    jail.close()
    assert kills == [UID]


async def test_a_uid_whose_executor_died_mid_phase_is_swept_before_it_serves_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack: a job leaves a daemon, a file in /tmp and a SysV segment, and its executor
    dies (its lock let go, its phase never closed). The uid's next phase, perhaps another
    organization's, finds none of them."""
    iso = _iso(tmp_path)
    _enter(iso, tmp_path, "a").close()  # given back clean once
    jail = _enter(iso, tmp_path, "b")
    leave = f"setsid sleep 300 >/dev/null 2>&1 & ipcmk -M 4096 >/dev/null; echo x > /tmp/left-{UID}"
    how = jail.spawn(["/bin/sh", "-c", leave], {"PATH": "/usr/bin:/bin"}, jail.home)
    proc = await asyncio.create_subprocess_exec(*how.argv, cwd=how.cwd, env=how.env, **how.options)
    assert await proc.wait() == 0
    assert live_pids_of(UID) and Path(f"/tmp/left-{UID}").exists()
    os.close(jail._lock)  # the executor's death, as the kernel lets its lock go
    kills = kill_uid_calls(monkeypatch)
    nxt = _enter(iso, tmp_path, "c")
    try:
        assert nxt.uid == UID and kills == [UID], "a dirty uid is swept first"
        await eventually(_none_of_uid, timeout=10, what="the daemon killed")
        assert not Path(f"/tmp/left-{UID}").exists()
        assert not _segments_of(UID)
    finally:
        jail._lock = -1  # let go above
        jail.close()
        nxt.close()


def test_a_uid_whose_end_left_something_is_not_given_back_clean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory that could not be sealed (or a file not removed) keeps the uid dirty:
    its next phase sweeps and looks at it first."""
    iso = _iso(tmp_path)
    monkeypatch.setattr(isolation, "seal", lambda root: False)
    _enter(iso, tmp_path, "a").close()
    assert (tmp_path / "locks" / str(UID)).read_bytes() == b""


async def _none_of_uid() -> bool:
    return not live_pids_of(UID)


def _segments_of(uid: int) -> list[str]:
    rows = subprocess.run(["ipcs", "-m"], capture_output=True, text=True).stdout.splitlines()
    return [r for r in rows if str(uid) in r.split()]
