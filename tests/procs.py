"""Helpers to run runplane processes as real subprocesses in tests."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

from tests.helpers import eventually

RUNPLANE = [sys.executable, "-m", "services.root.cli"]
TEST_KEY = base64.b64encode(bytes(range(32))).decode()  # tests only
ROOT = Path(__file__).resolve().parent.parent


_GIVEN: set[int] = set()  # ports this process handed out already


def free_port() -> int:
    """A port free now and never handed out before by this process: the kernel may give
    the same ephemeral port to two binds in a row once the first socket is closed (CI saw
    a cluster node's client and route ports equal, and the node exit on its route bind)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port
    raise RuntimeError("no fresh free port in 100 tries")


class Proc:
    """A runplane subprocess with its output captured to a file."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.log = log
        self.env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            # One key for every process of a test, as one deployment shares one.
            "RUNPLANE_ENCRYPTION_KEY": TEST_KEY,
            # Tests keep their repositories in local temporary directories.
            "RUNPLANE_ALLOWED_REPOS": f"https://,ssh://,{tempfile.gettempdir()}/",
            **(env or {}),
        }
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> Proc:
        out = open(self.log, "ab")  # kept open for the child's lifetime
        self.proc = await asyncio.create_subprocess_exec(
            *RUNPLANE,
            *self.args,
            stdout=out,
            stderr=out,
            env=self.env,
            cwd=str(ROOT),
            start_new_session=True,
        )
        out.close()
        return self

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    async def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 30) -> int:
        assert self.proc
        if self.proc.returncode is None:
            self.proc.send_signal(sig)
        return await asyncio.wait_for(self.proc.wait(), timeout)

    def kill(self) -> None:
        assert self.proc
        if self.proc.returncode is None:
            self.proc.kill()


class Client:
    """A tiny JSON client for the runplane API."""

    def __init__(self, base: str, token: str) -> None:
        self.base = base
        self.headers = {"Authorization": f"Bearer {token}"}
        self.session = aiohttp.ClientSession()

    async def close(self) -> None:
        await self.session.close()

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body)
        async with self.session.request(
            method, self.base + path, data=data, headers=self.headers
        ) as resp:
            text = await resp.text()
            return resp.status, (json.loads(text) if text else None)

    async def ok(self, method: str, path: str, body: Any = None) -> Any:
        status, payload = await self.call(method, path, body)
        assert 200 <= status < 300, (status, payload)
        return payload

    async def wait_status(
        self, org: str, run: str, wanted: set[str], timeout: float = 60
    ) -> dict[str, Any]:
        async def probe() -> dict[str, Any] | None:
            try:
                status, r = await self.call("GET", f"/api/v1/orgs/{org}/runs/{run}")
            except aiohttp.ClientError:
                return None
            if status == 200 and r["status"] in wanted:
                return r  # type: ignore[no-any-return]
            return None

        return await eventually(
            probe, timeout=timeout, interval=0.1, what=f"run {run} to reach {wanted}"
        )


async def wait_healthy(base: str, timeout: float = 60) -> None:
    """Until the api at `base` is ready (/readyz: caught up, and `up`'s components started)."""

    async def probe() -> bool:
        try:
            async with aiohttp.ClientSession() as s, s.get(base + "/readyz") as r:
                return r.status == 200
        except aiohttp.ClientError:
            return False

    await eventually(probe, timeout=timeout, interval=0.1, what=f"{base}/readyz")


def pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


__all__ = ["Client", "Proc", "free_port", "pids_alive", "signal", "wait_healthy"]


def descendants(pid: int) -> list[int]:
    """The process and everything it started (Terraform runs in sessions of its own)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return found


def nats_servers_using(path: Path) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "nats-server" in cmd and str(path) in cmd:
            found.append(int(proc.name))
    return found
