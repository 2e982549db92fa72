"""`runplane logs [-f]` against real api, scheduler and executor processes."""

from __future__ import annotations

import asyncio
import base64
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from infra.natsserver import EmbeddedNats
from tests.executor_support import commit
from tests.helpers import eventually
from tests.logs_support import SECRET, TALKING_TF
from tests.procs import ROOT, RUNPLANE, Client, Proc, free_port, wait_healthy

pytestmark = pytest.mark.terraform

TOKEN = "adm-logs"


class Cli:
    """One `runplane logs ...` subprocess, its stdout and stderr read as they come."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        self.out: list[str] = []
        self.err: list[str] = []
        self.code: int | None = None

    async def run(self) -> int:
        proc = await asyncio.create_subprocess_exec(
            *RUNPLANE,
            "logs",
            *self.args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=self.env,
            cwd=str(ROOT),
        )
        assert proc.stdout and proc.stderr
        await asyncio.gather(_read(proc.stdout, self.out), _read(proc.stderr, self.err))
        self.code = await proc.wait()
        return self.code


async def _read(stream: asyncio.StreamReader, into: list[str]) -> None:
    while raw := await stream.readline():
        into.append(raw.decode().rstrip("\n"))


@pytest.fixture
async def stack(tmp_path: Path, nats_server: EmbeddedNats) -> AsyncIterator[Client]:
    """Scheduler, executor and api processes on one nats-server; a client of the api."""
    common = ["--nats-url", nats_server.url, "--data-dir"]
    # The executor seals plans and state with the cluster's key (given, as in production).
    key = base64.b64encode(os.urandom(32)).decode()
    env = {"RUNPLANE_ADMIN_TOKEN": TOKEN, "RUNPLANE_ENCRYPTION_KEY": key}
    port = free_port()
    procs = [
        await Proc(["scheduler", *common, str(tmp_path / "s")], tmp_path / "s.log", env).start(),
        await Proc(["executor", *common, str(tmp_path / "e")], tmp_path / "e.log", env).start(),
        await Proc(
            ["api", *common, str(tmp_path / "a"), "--listen", f"127.0.0.1:{port}"],
            tmp_path / "a.log",
            env,
        ).start(),
    ]
    client = Client(f"http://127.0.0.1:{port}", TOKEN)
    try:
        await wait_healthy(client.base)
        await client.ok("POST", "/api/v1/orgs", {"name": "acme"})
        yield client
    finally:
        await client.close()
        for p in procs:
            await p.stop()


async def _workspace(client: Client, name: str, repo: Path, **variables: str) -> str:
    body = {"name": name, "repository": str(repo), "variables": variables}
    await client.ok("POST", "/api/v1/orgs/acme/workspaces", body)
    run = await client.ok("POST", f"/api/v1/orgs/acme/workspaces/{name}/runs", {"type": "apply"})
    return str(run["id"])


async def test_logs_f_follows_a_run_to_its_end_and_exits_0(
    stack: Client, repo: Path, tmp_path: Path
) -> None:
    """`runplane logs -f` prints lines while the apply runs (before the gate opens),
    stdout and stderr apart, follows until the run is applied and exits 0; the same
    lines print again without -f."""
    gate = tmp_path / "gate"
    commit(repo, TALKING_TF)
    run_id = await _workspace(stack, "net", repo, gate=str(gate))
    cli = Cli("-f", run_id, "--org", "acme", "--url", stack.base, "--token", TOKEN)
    task = asyncio.create_task(cli.run())
    await stack.wait_status("acme", run_id, {"awaiting_approval"})
    await stack.ok("POST", f"/api/v1/orgs/acme/runs/{run_id}/approve", {"acknowledged": []})

    async def began() -> bool:
        return "begin-42" in "\n".join(cli.out)

    await eventually(began, timeout=60, what="the apply's first line printed")
    assert not task.done() and "end-42" not in "\n".join(cli.out)
    gate.touch()
    assert await asyncio.wait_for(task, 60) == 0, cli.err
    out, err = "\n".join(cli.out), "\n".join(cli.err)
    assert "==> plan/checkout <==" in out and "==> apply/apply <==" in out and "end-42" in out
    assert "From " in err and "\nFrom " not in out
    assert SECRET not in out + err and "Traceback" not in err

    again = Cli(run_id, "--org", "acme", "--url", stack.base, env={"RUNPLANE_TOKEN": TOKEN})
    assert await again.run() == 0
    assert (again.out, again.err) == (cli.out, cli.err)


async def test_logs_of_a_failed_run_exit_1(stack: Client, repo: Path, tmp_path: Path) -> None:
    """A run that fails at init: its error lines print on stderr and the exit is 1,
    following or not; the admin token is found in --data-dir."""
    commit(repo, 'resource "null_resource" "x" {\n')
    run_id = await _workspace(stack, "bad", repo)
    data = tmp_path / "cli-data"
    data.mkdir()
    (data / "admin-token").write_text(TOKEN + "\n")
    args = (run_id, "--org", "acme", "--url", stack.base, "--data-dir", str(data))
    followed = Cli("-f", *args)
    assert await asyncio.wait_for(followed.run(), 90) == 1, followed.err
    assert any(line.startswith("Error:") for line in followed.err), followed.err
    assert "==> plan/init <==" in followed.out
    printed = Cli(*args)
    assert await printed.run() == 1
    assert printed.err == followed.err


async def test_logs_refuses_clearly(stack: Client) -> None:
    """An unknown run, a wrong token or no server: one `runplane:` line, exit 2."""
    cases = [
        (("nope", "--org", "acme", "--url", stack.base, "--token", TOKEN), "404"),
        (("nope", "--org", "acme", "--url", stack.base, "--token", "wrong"), "401"),
        (("nope", "--org", "acme", "--url", "http://127.0.0.1:1", "--token", TOKEN), "reach"),
        (("Nope", "--org", "acme", "--token", TOKEN), "not a valid id"),
    ]
    for args, needle in cases:
        cli = Cli(*args)
        assert await cli.run() == 2
        assert len(cli.err) == 1 and cli.err[0].startswith("runplane: ") and needle in cli.err[0]
