"""`?as_of=`'s answer time on an organization of ~2,000 whole runs over 40 workspaces.

    .venv/bin/python -m bench.as_of --runs 2000 [--cold 10] [--cold-org 3] [--cached 300]

- cold workspace: no scratch model cached; what the api does for `GET .../runs/{run}`,
  `GET .../workspaces/{ws}` and `GET .../workspaces/{ws}/runs` as of S: the run's
  workspace looked up at the leader (`PastModels.run_workspace`), that workspace's history
  folded (projections/asof.py `subjects(org, ws)`), the three read;
- cold organization: `GET .../runs?as_of=S` (every workspace's runs: the organization's
  whole history folded);
- moved forward: a cached workspace model advanced by one run's events;
- cached: a workspace model at the very sequence, asked by sequence and by time (one
  STREAM.MSG.GET `start_time` more).

The history is one real run driven through the `App`, its events copied for every run
(bench/history.py) over 40 workspaces of one organization, published pipelined into a
private nats-server. No HTTP around it: `PastModels` and the live answer's read
functions, as services/surfaces/api/asof.py calls them. The per-request cap is lifted.
Times in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from datetime import UTC, datetime
from typing import Any

from projections.asof import PastModels

from . import history
from .common import connected, last_seq, private_server

WORKSPACES = 40


def _stats(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        "n": len(ordered),
        "p50_ms": round(statistics.median(ordered) * 1000, 2),
        "p99_ms": round(p99 * 1000, 2),
        "max_ms": round(ordered[-1] * 1000, 2),
    }


async def _workspace(past: PastModels, as_of: str, run_id: str) -> float:
    """A run, its workspace and a page of its runs as of `as_of`; the seconds it took."""
    started = time.perf_counter()
    seq = await past.resolve(as_of)
    ws = await past.run_workspace(history.ORG, run_id, seq)
    assert ws is not None
    async with past.at(history.ORG, seq, ws) as read:
        assert await read.runs.get(history.ORG, run_id) is not None
        await read.workspaces.get(history.ORG, ws)
        await read.runs.find(history.ORG, workspace=ws, limit=100)
    return time.perf_counter() - started


async def _org_list(past: PastModels, as_of: str) -> float:
    """A page of the organization's runs as of `as_of`; the seconds it took."""
    started = time.perf_counter()
    seq = await past.resolve(as_of)
    async with past.at(history.ORG, seq) as read:
        await read.runs.find(history.ORG, limit=100)
    return time.perf_counter() - started


async def _cold(nc: Any, n: int, answer: Any) -> list[float]:
    """`n` answers, each from a new cache (the history folded from sequence 1)."""
    out = []
    for _ in range(n):
        past = PastModels(nc, max_events=10**9)
        try:
            out.append(await answer(past))
        finally:
            await past.close()
    return out


async def main(runs: int, cold: int, cold_org: int, cached: int) -> dict[str, Any]:
    async with private_server("asof") as server, connected(server.url) as nc:
        tpl = await history.capture(nc)
        per_run = len(tpl.run_msgs(history.ws_name(0), history.run_id_for(0)))
        t = time.perf_counter()
        published, made = await history.publish_history(
            nc, tpl, events=runs * per_run, workspaces=WORKSPACES
        )
        build_s = time.perf_counter() - t
        last = await last_seq(nc)
        # a run made before any S asked (runs go to the workspaces round robin: those
        # after it in its workspace are WORKSPACES runs apart)
        some_run = history.run_id_for(made - 1 - WORKSPACES * (cached // 10 + 2))
        rng = random.Random(25)

        def at() -> str:
            return str(rng.randint(last - per_run, last))

        cold_ws = await _cold(nc, cold, lambda past: _workspace(past, at(), some_run))
        cold_org_s = await _cold(nc, cold_org, lambda past: _org_list(past, at()))
        past = PastModels(nc, max_events=10**9)
        try:
            # the workspace's runs come every WORKSPACES runs: move on by one of them
            step = per_run * WORKSPACES
            start = last - (cached // 10 + 1) * step
            await _workspace(past, str(start), some_run)
            forward_s = [
                await _workspace(past, str(start + i * step), some_run)
                for i in range(1, cached // 10 + 1)
            ]
            cached_s = [await _workspace(past, str(last), some_run) for _ in range(cached)]
            when = datetime.now(UTC).isoformat()
            by_time_s = [await _workspace(past, when, some_run) for _ in range(cached)]
        finally:
            await past.close()
    return {
        "runs": made,
        "events": published,
        "events_per_run": per_run,
        "workspaces": WORKSPACES,
        "build_s": round(build_s, 2),
        "cold_workspace": _stats(cold_ws),
        "cold_org_list": _stats(cold_org_s),
        "cold_org_events_per_s": round(published / statistics.median(cold_org_s)),
        "moved_forward_one_run": _stats(forward_s),
        "cached": _stats(cached_s),
        "cached_by_time": _stats(by_time_s),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--cold", type=int, default=10)
    parser.add_argument("--cold-org", type=int, default=3)
    parser.add_argument("--cached", type=int, default=300)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args.runs, args.cold, args.cold_org, args.cached))))
