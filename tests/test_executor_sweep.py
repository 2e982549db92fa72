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


async def test_a_leftover_terraform_is_let_write_its_errored_state_before_the_sweep(
    tmp_path: Path,
) -> None:
    """A killed executor's Terraform got SIGTERM (its parent death signal) and is still
    failing to reach the dead state backend: the start waits for it, so the state it then
    writes, the only record of what it applied, is kept rather than killed."""
    work = tmp_path / "work"
    job = work / "jobs" / "run2-apply-x" / "src"
    job.mkdir(parents=True)
    fake = tmp_path / "bin" / "terraform"  # /proc/<pid>/comm is the script's name
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nsleep 1.5\necho '{\"serial\": 7}' > errored.tfstate\n")
    fake.chmod(0o755)
    dying = await asyncio.create_subprocess_exec(str(fake), cwd=str(job))
    try:
        await asyncio.to_thread(sweep.sweep, work / "jobs", work / "unsaved-state")
        kept = work / "unsaved-state" / "run2-apply-x.errored.tfstate"
        assert kept.read_text().strip() == '{"serial": 7}'
        assert await asyncio.wait_for(dying.wait(), 5) == 0  # it ended on its own
    finally:
        if dying.returncode is None:
            dying.kill()
            await dying.wait()


async def test_an_errored_state_that_is_a_link_is_never_kept(tmp_path: Path) -> None:
    """The job's uid owned its directory: an `errored.tfstate` linked to a file of ours
    (the encryption key) must not be copied out and recorded as the tenant's state."""
    work = tmp_path / "work"
    job = work / "jobs" / "run3-apply-x" / "src"
    job.mkdir(parents=True)
    key = tmp_path / "encryption.key"
    key.write_text("the-deployment-key")
    (job / "errored.tfstate").symlink_to(key)
    await asyncio.to_thread(sweep.sweep, work / "jobs", work / "unsaved-state")
    assert not (work / "unsaved-state" / "run3-apply-x.errored.tfstate").exists()
    assert key.read_text() == "the-deployment-key"


async def test_a_leftover_tree_deeper_than_pythons_recursion_does_not_stop_the_start(
    tmp_path: Path,
) -> None:
    """Attack: a job of a killed executor leaves 1,200 nested directories. The start still
    keeps the job's errored state and removes the whole directory (pathlib's rglob and
    shutil.rmtree both recursed past Python's limit there)."""
    work = tmp_path / "work"
    job = work / "jobs" / "run4-apply-x" / "src"
    job.mkdir(parents=True)
    (job / "errored.tfstate").write_text('{"serial": 9}')

    def nest(deep: Path) -> None:  # os.makedirs recurses too
        for _ in range(1200):
            deep = deep / "x"
            deep.mkdir()

    await asyncio.to_thread(nest, job)
    await asyncio.to_thread(sweep.sweep, work / "jobs", work / "unsaved-state")
    kept = work / "unsaved-state" / "run4-apply-x.errored.tfstate"
    assert kept.read_text() == '{"serial": 9}'
    assert list((work / "jobs").iterdir()) == []
