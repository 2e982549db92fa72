"""The CLI answers bad input with one line and a non-zero exit, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.procs import ROOT, TEST_KEY


def runplane(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.root.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        env={**os.environ, "RUNPLANE_CONNECT_TIMEOUT": "2", "RUNPLANE_ENCRYPTION_KEY": TEST_KEY},
    )


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["up", "--listen", "nowhere"], "--listen wants HOST:PORT"),
        (["api"], "needs --nats-url"),
        (["scheduler"], "needs --nats-url"),
        (["executor", "--nats-url", "nats://127.0.0.1:1"], "cannot reach NATS"),
    ],
)
def test_bad_input_gets_one_line_and_a_nonzero_exit(args: list[str], needle: str) -> None:
    done = runplane(*args)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("runplane:")]
    assert len(lines) == 1 and needle in lines[0], done.stderr
