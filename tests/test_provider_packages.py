"""The fake test provider runs as a job's uid even when this checkout (and its virtual
environment) lies under a private directory, as a CI clone under /root might."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

import tests.provider as provider


@pytest.mark.skipif(os.geteuid() != 0, reason="jobs run as uids of their own only as root")
def test_private_site_packages_are_copied_where_any_uid_reads_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = provider._open_to_all
    monkeypatch.setattr(
        provider,
        "_open_to_all",
        lambda path: "-packages" not in str(path) and real(path),
    )
    [copy] = provider._packages_open_to_all()
    assert Path(copy).is_dir() and copy not in provider.site.getsitepackages()
    check = "from tf import runner, schema, types; from tf.utils import Diagnostics"
    done = subprocess.run(
        [provider.interpreter(), "-c", check],
        env={"PYTHONPATH": copy},
        cwd="/",
        user=65534,
        group=65534,
        extra_groups=[],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
