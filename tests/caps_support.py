"""`runplane up` with small job caps, and what a test checks of the host after a job:
the job uids' processes, the phases' control groups, SysV IPC objects and files."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from executor import isolation, uids
from executor.cgroups import TOP, find
from executor.isolation import sandbox_problem
from executor.uids import DEFAULT_UIDS
from executor.worker import default_jobs_dir
from tests.executor_support import commit
from tests.procs import Client, Proc, free_port, wait_healthy

TOKEN = "admin-caps-7c1e"
V1 = "/api/v1/orgs/acme"
NO_SANDBOX = sandbox_problem(DEFAULT_UIDS[-1]) if os.geteuid() == 0 else "not root"
# The job uids of this module's `up`s: their own, so that another suite's jobs running
# on this machine meanwhile (in the default range) are not taken for theirs.
UIDS = range(
    1_600_000_000 + (os.getpid() % 10_000) * 16, 1_600_000_000 + (os.getpid() % 10_000) * 16 + 16
)
# Small caps: each attack is over one quickly.
SMALL = {
    "--job-memory": "64MiB",
    "--job-processes": "32",
    "--job-cpu-seconds": "2",
    "--job-disk": "16MiB",
    "--job-tmpfs": "8MiB",
}


@dataclass
class Up:
    proc: Proc
    client: Client
    data: Path
    mode: str  # the jobs' isolation

    @property
    def pid(self) -> int:
        assert self.proc.proc is not None
        return self.proc.proc.pid

    def key(self) -> str:
        return (self.data / "encryption.key").read_text().strip()

    def work(self) -> Path:
        return self.data / "work"

    @property
    def jobs(self) -> Path:
        return default_jobs_dir(self.work()) / "jobs"


@asynccontextmanager
async def running_up(
    tmp: Path, mode: str, *extra: str, token: str = TOKEN, env: dict[str, str] | None = None
) -> AsyncIterator[Up]:
    """`runplane up --isolation mode` with `extra` flags, the admin `token` and `env` in
    its environment (by default this module's job uids), and an organization `acme`."""
    data, port = tmp / "data", free_port()
    args = ["up", "--no-demo", "--data-dir", str(data), "--listen", f"127.0.0.1:{port}"]
    uids = {"RUNPLANE_JOB_UIDS": f"{UIDS[0]}-{UIDS[-1]}"}
    proc = await Proc(
        [*args, "--isolation", mode, *extra],
        tmp / "up.log",
        env={"RUNPLANE_ADMIN_TOKEN": token, **(uids if env is None else env)},
    ).start()
    base = f"http://127.0.0.1:{port}"
    client = Client(base, token)
    try:
        await wait_healthy(base)
        await client.ok("POST", "/api/v1/orgs", {"name": "acme"})
        yield Up(proc, client, data, mode)
    finally:
        await client.close()
        await proc.stop(signal.SIGTERM)


async def custom_run(up: Up, repo: Path, name: str, command: str) -> dict[str, Any]:
    """A workspace `name` whose template's custom step runs `command` (then a plan);
    its plan run, ended."""
    steps = [
        {"number": 50, "kind": "custom", "name": "attack", "command": command},
        {"number": 100, "kind": "plan"},
    ]
    await up.client.ok("PUT", f"{V1}/templates/{name}", {"steps": steps})
    if not (repo / "main.tf").exists():
        commit(repo, 'resource "null_resource" "a" {}\n')
    await up.client.ok("POST", f"{V1}/workspaces", {"name": name, "repository": str(repo)})
    run = await up.client.ok(
        "POST", f"{V1}/workspaces/{name}/runs", {"type": "plan", "template": name}
    )
    ended = {"failed", "planned", "awaiting_approval", "no_changes"}
    done: dict[str, Any] = await up.client.wait_status("acme", run["id"], ended, timeout=120)
    return done


def job_pids() -> set[int]:
    """The processes of this module's job uids now."""
    jobs, out = UIDS, set()
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and os.stat(f"/proc/{d}").st_uid in jobs:
                out.add(int(d))
        except OSError:
            continue
    return out


def phase_groups(data: Path) -> list[Path]:
    """The phase control groups of the executor on `data` now (those of its jobs root)."""
    scope = default_jobs_dir(data / "work").name
    return [g for h in find().values() for g in (h.base / TOP / scope).glob("*") if g.is_dir()]


def job_ipc() -> set[str]:
    """The SysV IPC objects (any table) of this module's job uids."""
    jobs, out = UIDS, set()
    for table in ("shm", "sem", "msg"):
        head, *rows = Path(f"/proc/sysvipc/{table}").read_text().splitlines()
        at = head.split().index("uid")
        out |= {f"{table}:{r.split()[1]}" for r in rows if int(r.split()[at]) in jobs}
    return out


def job_files() -> list[str]:
    """Files of this module's job uids left in the shared temporary directories."""
    jobs, out = UIDS, []
    for place in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"):
        for entry in os.scandir(place):
            try:
                if entry.stat(follow_symlinks=False).st_uid in jobs:
                    out.append(entry.path)
            except OSError:
                continue
    return out


def kill_uid_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The uids `kill_uid` is called for from now on (it still kills)."""
    calls: list[int] = []
    real = uids.kill_uid

    def counted(uid: int) -> None:
        calls.append(uid)
        real(uid)

    monkeypatch.setattr(isolation, "kill_uid", counted)
    return calls


def live_pids_of(uid: int) -> list[int]:
    """The live processes (not zombies) of `uid`, anywhere on the host."""
    found = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and os.stat(f"/proc/{name}").st_uid == uid:
                if "State:\tZ" not in Path(f"/proc/{name}/status").read_text():
                    found.append(int(name))
        except OSError:
            continue
    return found
