"""A killed executor's leftovers (provider plugins still running, job directories) are
cleared when an executor starts on its work directory, never while a sibling lives."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from executor import sweep


async def _orphan(cwd: Path) -> asyncio.subprocess.Process:
    """A process working in a job directory, as a provider plugin outlives Terraform."""
    return await asyncio.create_subprocess_exec("sleep", "300", cwd=str(cwd))


async def test_an_executor_starting_kills_what_a_killed_one_left_and_keeps_errored_state(
    tmp_path: Path,
) -> None:
    work = tmp_path / "work"
    job = work / "jobs" / "run1-apply-x" / "src" / "net"
    job.mkdir(parents=True)
    (job / "errored.tfstate").write_text('{"serial": 3}')
    orphan = await _orphan(job)
    bystander = await _orphan(tmp_path)  # not under jobs/: left alone
    try:
        fd = await asyncio.to_thread(sweep.hold, work)
        try:
            assert await asyncio.wait_for(orphan.wait(), 5) == -9
            assert bystander.returncode is None
            assert list((work / "jobs").iterdir()) == []
            kept = work / "unsaved-state" / "run1-apply-x.errored.tfstate"
            assert kept.read_text() == '{"serial": 3}'
            assert kept.stat().st_mode & 0o777 == 0o600
        finally:
            os.close(fd)
    finally:
        for p in (orphan, bystander):
            if p.returncode is None:
                p.kill()
                await p.wait()


async def test_no_sweep_while_a_sibling_executor_holds_the_work_directory(
    tmp_path: Path,
) -> None:
    work = tmp_path / "work"
    running = work / "jobs" / "run2-plan-y"
    (work / "jobs").mkdir(parents=True)
    sibling = await asyncio.to_thread(sweep.hold, work)  # a live executor
    running.mkdir()
    terraform = await _orphan(running)  # its Terraform, at work
    try:
        second = await asyncio.to_thread(sweep.hold, work)
        os.close(second)
        await asyncio.sleep(0.2)
        assert terraform.returncode is None and running.is_dir()
    finally:
        os.close(sibling)
        terraform.kill()
        await terraform.wait()
