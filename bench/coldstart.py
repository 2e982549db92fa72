"""Cold start of an api replica: process start to `/readyz` 200, with a snapshot of the
read model in `rp-snapshots` against a full replay of the stream (issue 26, item 6).

    python -m bench.coldstart --events 1000000 [--rounds 3]

A private nats-server gets `events` valid events (bench/history.py: whole runs copied
over 1,000 workspaces); a read model is rebuilt from them (`projections.replay`) and
written as a snapshot (projections/snapshots.py, what an api replica's writer does).
Then `runplane api` processes start on empty data directories, alternating: one with
the deployment's key (it restores the snapshot and tails), one with another key (the
snapshot's manifest does not open: it replays the whole stream, as before snapshots).
Each is timed from its spawn to the first `/readyz` 200 (polled every 20 ms), with its
CPU seconds (utime + stime from /proc) at that moment.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench import history
from bench.common import PY, child_env, connected, cpu_seconds, last_seq, nats_env, private_server
from bench.common import stop_process as stop
from bench.rp import new_key
from infra.crypto import KeyRing
from projections.replay import replay
from projections.snapshots import Snapshots, object_name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _ready(url: str, proc: asyncio.subprocess.Process, limit: float) -> None:
    """Poll `/readyz` until 200 (connection refused while the process starts)."""
    deadline = time.monotonic() + limit
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                raise RuntimeError(f"runplane api exited ({proc.returncode}) before it was ready")
            try:
                async with http.get(f"{url}/readyz") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.02)
    raise TimeoutError(f"not ready within {limit} s")


async def cold_start(server_url: str, key: str, root: Path, limit: float) -> dict[str, Any]:
    """One `runplane api` on an empty data directory: seconds to ready, CPU seconds, and
    what its `snapshot_restored` line said (download, inflate, swap seconds)."""
    data = Path(tempfile.mkdtemp(prefix="api-", dir=root))
    port = _free_port()
    env = {"RUNPLANE_ENCRYPTION_KEY": key, "RUNPLANE_SNAPSHOT_INTERVAL": "0"}
    started = time.perf_counter()
    logs = (root / f"{data.name}.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        PY, "-m", "services.root.cli", "api", "--nats-url", server_url,
        "--data-dir", str(data), "--log-format", "json", "--listen", f"127.0.0.1:{port}",
        env=child_env(**nats_env(server_url), **env),
        stdout=logs, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        await _ready(f"http://127.0.0.1:{port}", proc, limit)
        seconds = time.perf_counter() - started
        cpu = cpu_seconds(proc.pid)
    finally:
        await stop(proc)
        logs.close()
    return {"seconds": seconds, "cpu_s": cpu, **_restored(root / f"{data.name}.log")}


def _restored(log: Path) -> dict[str, Any]:
    for line in log.read_text(errors="replace").splitlines():
        if '"snapshot_restored"' in line:
            said = json.loads(line)
            return {k: said[k] for k in ("download_s", "inflate_s", "swap_s") if k in said}
    return {}


async def coldstart(events: int, rounds: int = 3) -> dict[str, Any]:
    """The figures of module docstring's measurement."""
    key = new_key()
    keyring = KeyRing(base64.b64decode(key))
    with tempfile.TemporaryDirectory(prefix="rpbench-cold-") as tmp:
        root = Path(tmp)
        async with private_server("coldstart") as server, connected(server.url) as nc:
            tpl = await history.capture(nc)
            await history.publish_history(nc, tpl, events=events, workspaces=1000)
            total = await last_seq(nc)
            t = time.perf_counter()
            await replay(nc, root / "seed.sqlite")
            t_write = time.perf_counter()
            manifest = await Snapshots(nc, keyring).write(root / "seed.sqlite", "bench")
            write_s = time.perf_counter() - t_write
            assert manifest is not None
            store = await Snapshots(nc, keyring).store()
            packed = (await store.get_info(object_name(manifest))).size
            limit = 60 + total / 5_000
            snap: list[dict[str, float]] = []
            full: list[dict[str, float]] = []
            for _ in range(rounds):
                snap.append(await cold_start(server.url, key, root, limit))
                full.append(await cold_start(server.url, new_key(), root, limit))
    med = {n: statistics.median(r["seconds"] for r in rs) for n, rs in (("s", snap), ("f", full))}
    return {
        "events_in_stream": total,
        "replay_seed_s": t_write - t,
        "snapshot_write_s": write_s,
        "snapshot_bytes": manifest.size,
        "snapshot_stored_bytes": packed,
        "rounds": rounds,
        "snapshot": snap,
        "full_replay": full,
        "snapshot_median_s": med["s"],
        "full_replay_median_s": med["f"],
        "ratio": med["s"] / med["f"],
    }


def main() -> None:
    p = argparse.ArgumentParser(prog="bench.coldstart", description=__doc__.split("\n")[0])
    p.add_argument("--events", type=int, default=100_000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    print(json.dumps(asyncio.run(coldstart(args.events, args.rounds)), indent=1))


if __name__ == "__main__":
    main()
