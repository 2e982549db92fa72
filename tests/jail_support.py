"""Helpers for the tests that run processes as a job (tests/test_shell_init.py,
tests/test_spawn_chain.py, tests/test_spawn_helper_attacks.py): the jails a test entered,
closed after it, and one command run as the job with its exit code and log. Holds no
tests itself."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from executor.isolation import Jail
from executor.output import Masker
from executor.process import StepLog, run


@pytest.fixture
def jails() -> Iterator[list[Jail]]:
    """The jails a test entered (it appends them): closed after it."""
    made: list[Jail] = []
    yield made
    for jail in made:
        jail.close()


async def run_as_job(jail: Jail, argv: list[str], log_path: Path) -> tuple[int, str]:
    """Run `argv` as the job, in its home, with a plain PATH: its exit code and its log."""
    log = StepLog(log_path, Masker())
    try:
        code = await asyncio.wait_for(
            run(argv, cwd=jail.home, env={"PATH": "/usr/bin:/bin"}, step_log=log, jail=jail), 60
        )
    finally:
        log.close()
    return code, log_path.read_text()
