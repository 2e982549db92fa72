"""Processes that need the encryption key refuse to start without one, in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from infra import options
from infra.crypto import KEY_FILE
from infra.options import ConfigError, Options
from tests.procs import ROOT


def runplane(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RUNPLANE_CONNECT_TIMEOUT": "2", "RUNPLANE_ENCRYPTION_KEY": ""}
    return subprocess.run(
        [sys.executable, "-m", "services.root.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        env=env,
    )


@pytest.mark.parametrize("command", ["executor", "api", "scheduler"])
def test_a_process_without_a_key_says_how_to_give_one(command: str, tmp_path: Path) -> None:
    done = runplane(command, "--nats-url", "nats://127.0.0.1:1", "--data-dir", str(tmp_path))
    assert done.returncode == 2
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("runplane:")]
    assert len(lines) == 1 and "no encryption key" in lines[0], done.stderr
    assert "RUNPLANE_ENCRYPTION_KEY" in lines[0] and str(tmp_path / KEY_FILE) in lines[0]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / KEY_FILE).exists(), "only `runplane up` makes a key"


def test_a_malformed_key_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="32 bytes"):
        options.keyring(Options(encryption_key="c2hvcnQ="))


def test_up_makes_the_key_once_and_the_others_read_it(tmp_path: Path) -> None:
    made = options.keyring(Options(data_dir=tmp_path), create=True)
    assert options.keyring(Options(data_dir=tmp_path)) == made
    assert (tmp_path / KEY_FILE).stat().st_mode & 0o777 == 0o600
