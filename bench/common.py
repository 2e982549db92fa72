"""Shared pieces of the benchmarks: a private nats-server, timing, percentiles, fast
publishing of valid runplane events, subprocess helpers."""

from __future__ import annotations

import asyncio
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from infra import streams
from infra.natsclient import NatsAuth, client_env
from infra.natsserver import EmbeddedNats

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


@dataclass
class Sizes:
    """How big each benchmark is; `--quick` and `--smoke` shrink them."""

    sync_msgs: int = 5_000
    pipe_subjects: int = 500
    pipe_msgs: int = 100_000
    replay_events: int = 1_000_000
    append_runs: int = 2_000
    append_concurrency: int = 500
    lifecycle_workspaces: int = 1_000
    lifecycle_executors: int = 4
    latency_rate: float = 50.0
    latency_seconds: float = 20.0
    admission_counts: tuple[int, ...] = (100, 1_000, 10_000)
    read_runs: int = 100_000
    read_seconds: float = 10.0
    read_concurrency: int = 1

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            sync_msgs=2_000,
            pipe_msgs=30_000,
            replay_events=100_000,
            append_runs=500,
            lifecycle_workspaces=200,
            latency_seconds=8.0,
            read_runs=10_000,
            read_seconds=4.0,
        )

    @classmethod
    def smoke(cls) -> Sizes:
        return cls(
            sync_msgs=200,
            pipe_subjects=50,
            pipe_msgs=2_000,
            replay_events=5_000,
            append_runs=40,
            append_concurrency=20,
            lifecycle_workspaces=10,
            lifecycle_executors=1,
            latency_seconds=1.0,
            admission_counts=(10, 20, 40),
            read_runs=300,
            read_seconds=1.0,
        )


@dataclass
class Result:
    """One line of the table: a figure, the raw reference it is compared with, the target."""

    name: str
    figure: float | None
    unit: str
    raw: float | None = None
    raw_name: str = ""
    ratio: float | None = None
    target: str = ""
    passed: bool | None = None
    note: str = ""
    details: dict[str, Any] = field(default_factory=dict)


def percentile(values: Iterable[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); 0.0 for no values."""
    data = sorted(values)
    if not data:
        return 0.0
    k = max(0, min(len(data) - 1, math.ceil(q / 100 * len(data)) - 1))
    return data[k]


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


# The credentials of each private server by URL: it takes no connection without them.
_AUTH: dict[str, NatsAuth] = {}


def nats_env(url: str) -> dict[str, str]:
    """What a runplane process needs in its environment to authenticate to `url`."""
    return client_env(_AUTH.get(url, NatsAuth()))


@asynccontextmanager
async def private_server(tag: str) -> AsyncIterator[EmbeddedNats]:
    """A nats-server of its own (port 0, temporary store), as runplane embeds it."""
    with tempfile.TemporaryDirectory(prefix=f"rpbench-{tag}-") as tmp:
        async with EmbeddedNats(Path(tmp) / "nats") as server:
            _AUTH[server.url] = server.auth
            yield server


@asynccontextmanager
async def connected(url: str, *, declare: bool = True) -> AsyncIterator[NATS]:
    auth = _AUTH.get(url, NatsAuth()).connect_options()
    nc = await nats.connect(url, pending_size=64 * 1024 * 1024, max_reconnect_attempts=2, **auth)
    try:
        if declare:
            await streams.declare(nc, nc.jetstream())
        yield nc
    finally:
        await nc.close()


async def last_seq(nc: NATS, stream: str = streams.EVENTS) -> int:
    info = await nc.jetstream().stream_info(stream)
    return int(info.state.last_seq)


class Firehose:
    """Publish as fast as the server acknowledges, with a bounded window of unacknowledged
    messages (the acks come back on one wildcard inbox). No expectation headers: this is
    how the benchmarks fill a stream with events before measuring something else."""

    def __init__(self, nc: NATS, window: int = 4_000) -> None:
        self.nc = nc
        self.window = window
        self.sent = 0
        self.acked = 0
        self.errors = 0
        self._prefix = nc.new_inbox()
        self._room = asyncio.Semaphore(window)
        self._sub: Any = None

    async def __aenter__(self) -> Firehose:
        async def on_ack(msg: Msg) -> None:
            if b'"error"' in msg.data:
                self.errors += 1
            self.acked += 1
            self._room.release()

        self._sub = await self.nc.subscribe(self._prefix + ".*", cb=on_ack)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.drain()
        await self._sub.unsubscribe()

    async def put(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> None:
        await self._room.acquire()
        self.sent += 1
        await self.nc.publish(subject, data, reply=f"{self._prefix}.a", headers=headers)

    async def drain(self, timeout: float = 120) -> None:
        await self.nc.flush()
        deadline = time.monotonic() + timeout
        while self.acked < self.sent:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.sent - self.acked} publishes never acknowledged")
            await asyncio.sleep(0.005)
        if self.errors:
            raise RuntimeError(f"{self.errors} publishes refused")


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_kb = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_kb = int(line.split()[1])
    except OSError:
        pass
    import msgspec

    from infra.natsserver import server_binary

    return {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "memory_mb": mem_kb // 1024,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "nats_py": _version("nats-py"),
        "msgspec": msgspec.__version__,
        "aiohttp": _version("aiohttp"),
        "nats_server": _server_version(server_binary()),
        "loadavg_at_start": list(os.getloadavg()),
    }


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return ""


def _server_version(binary: str) -> str:
    import subprocess

    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def rss_kb(pid: int) -> tuple[int, int]:
    """Current and peak resident set size of a process, in KiB (VmRSS, VmHWM)."""
    rss = hwm = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1])
        elif line.startswith("VmHWM:"):
            hwm = int(line.split()[1])
    return rss, hwm


def cpu_seconds(pid: int, *, children_only: bool = False) -> float:
    """CPU time of a process and of its children it has waited for (user + system);
    `children_only`: of those children alone."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # utime, stime, cutime, cstime
    ticks = sum(int(f) for f in fields[13 if children_only else 11 : 15])
    return ticks / os.sysconf("SC_CLK_TCK")


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RUNPLANE_", "NATS_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


async def stop_process(proc: asyncio.subprocess.Process, timeout: float = 10) -> None:
    if proc.returncode is not None:
        return
    proc.terminate()
    try:
        await asyncio.wait_for(proc.wait(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
