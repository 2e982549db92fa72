"""Caps per job (issue 23, item 2): a job over its memory, processes, CPU time, disk or
tmpfs cap fails its run with that reason, and leaves the host as it found it: no process
of a job uid, no control group, no SysV IPC object, no file. The executor goes on: a run
after the attacks plans. In the sandbox and in the uid mode (tmpfs: the sandbox only;
the uid mode has none of its own). These tests run as root, as CI does."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from executor.caps import JobCaps, disk_usage
from executor.errors import IsolationError
from executor.isolation import Isolation
from infra.sizes import parse_size, say_size
from tests.caps_support import (
    NO_SANDBOX,
    SMALL,
    V1,
    custom_run,
    job_files,
    job_ipc,
    job_pids,
    phase_groups,
    running_up,
)
from tests.helpers import eventually

pytestmark = [
    pytest.mark.terraform,
    pytest.mark.skipif(os.geteuid() != 0, reason="job isolation needs root"),
]

MODES = [
    # the fallback's caps (~15 s) in the slow suite; the sandbox's, the default, here
    pytest.param("user", marks=pytest.mark.slow),
    pytest.param(
        "sandbox", marks=pytest.mark.skipif(bool(NO_SANDBOX), reason=f"no sandbox: {NO_SANDBOX}")
    ),
]

# cap -> the attack (a custom step's shell command), each over its cap of SMALL
ATTACKS = {
    "memory 64 MiB": 'python3 -c "x = bytearray(200 * 1024 * 1024)"; echo shrugged off',
    "processes 32": "for i in $(seq 64); do sleep 5 & done; wait",
    "cpu 2 s": "while :; do :; done",
    "disk 16 MiB": "head -c 12M /dev/zero > a && head -c 12M /dev/zero > b && sleep 30",
    "tmpfs 8 MiB": "head -c 20M /dev/zero > /tmp/fill; echo shrugged off",
}


@pytest.mark.parametrize("mode", MODES)
async def test_a_job_over_each_cap_fails_with_its_reason_and_leaves_the_host_as_it_found_it(
    tmp_path: Path, repo: Path, mode: str
) -> None:
    """Attack F5's "no caps" (a 1.5 GB allocation, 300 processes, a 1 GB file all
    succeeded): each attack's run fails `resource_limit_exceeded: <cap>`, promptly."""
    pids, ipc = job_pids(), job_ipc()
    flags = [x for kv in SMALL.items() for x in kv]
    async with running_up(tmp_path, mode, *flags) as up:
        assert '"job_caps"' in up.proc.output(), "the executor says which mechanism holds each"
        for said, command in ATTACKS.items():
            if said.startswith("tmpfs") and mode != "sandbox":
                continue
            name = said.split()[0]
            run = await custom_run(up, repo, f"cap-{name}", command)
            assert run["status"] == "failed", (said, run)
            assert run["reason"] == "resource_limit_exceeded", (said, run)
            assert run["error_message"].startswith(f"resource_limit_exceeded: {said}"), run

            async def as_found() -> bool:
                assert job_pids() - pids == set(), "a job process outlived its phase"
                assert phase_groups(up.data) == [], "a phase's control group was left"
                assert job_ipc() - ipc == set()
                assert job_files() == []
                assert not [p for p in up.jobs.iterdir()], "a job's directory was left"
                return True

            await eventually(as_found, timeout=20, what=f"the host as found after {said}")
        ok = await custom_run(up, repo, "after", "echo fine")
        assert ok["status"] == "planned", ok


def test_the_uid_mode_refuses_a_network_of_none_rather_than_allow_it() -> None:
    with pytest.raises(IsolationError, match="--job-network none needs"):
        Isolation.choose("user", network="none")


@pytest.mark.skipif(bool(NO_SANDBOX), reason=f"no sandbox: {NO_SANDBOX}")
@pytest.mark.parametrize("network", ["allowed", "none"])
async def test_a_job_without_a_network_reaches_no_listener_of_the_host_and_still_plans(
    tmp_path: Path, repo: Path, network: str
) -> None:
    """`--job-network none`: a job cannot connect to a TCP listener on the host's
    loopback (here the embedded NATS server's port), and its plan still reaches the
    phase's state backend (carried by its init over a unix socket); `allowed` reaches
    it."""
    async with running_up(tmp_path, "sandbox", "--job-network", network) as up:
        port = int((up.data / "nats" / "url").read_text().strip().rsplit(":", 1)[1])
        probe = (
            "python3 -c \"import socket; socket.create_connection(('127.0.0.1', "
            f"{port}), 3); print('REACHED')\" || echo NOT-REACHED"
        )
        run = await custom_run(up, repo, "net", probe)
        assert run["status"] == "planned", run
        logs = await up.client.ok("GET", f"{V1}/runs/{run['id']}/logs?phase=custom-50")
        lines = [str(item["text"]).strip() for item in logs["items"]]
        wanted = "REACHED" if network == "allowed" else "NOT-REACHED"
        assert wanted in lines, lines


def test_sizes_are_read_as_people_write_them() -> None:
    assert parse_size("2GiB") == 2 * 1024**3 == parse_size("2G")
    assert parse_size("64 MiB") == 64 * 1024**2
    assert parse_size("1000") == 1000 and parse_size("1kb") == 1000
    for bad in ("", "x", "2 parsecs", "-1M"):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert say_size(2 * 1024**3) == "2 GiB" and say_size(1536 * 1024**2) == "1536 MiB"
    assert JobCaps().said("memory") == "memory 2 GiB"


def test_disk_usage_counts_a_hard_link_once_and_follows_no_link(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"x" * 1024 * 1024)
    os.link(tmp_path / "a", tmp_path / "b")
    (tmp_path / "c").symlink_to("/usr")
    used = disk_usage([tmp_path])
    assert 1024 * 1024 <= used < 2 * 1024 * 1024, used
