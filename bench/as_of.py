"""`?as_of=`'s answer time on an organization of ~2,000 whole runs: cold (no scratch model
cached: the organization's events folded from sequence 1), moved forward (a cached model
at S advanced by one run's events) and cached (a model at the very sequence).

    .venv/bin/python -m bench.as_of --runs 2000 [--cold 10] [--cached 300]   # JSON on stdout

The history is one real run driven through the `App`, its events copied for every run
(bench/history.py) over 20 workspaces of one organization, published pipelined into a
private nats-server. An answer is what the api does for `GET .../runs/{run}?as_of=S` and
`GET .../runs?as_of=S` (services/surfaces/api/asof.py) without the HTTP around it:
`PastModels.resolve` (a sequence, or a time: one STREAM.MSG.GET at the leader), the
organization's model at S (`PastModels.at`), and the same read functions the live answer
uses. Times in milliseconds.
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

WORKSPACES = 20


def _stats(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        "n": len(ordered),
        "p50_ms": round(statistics.median(ordered) * 1000, 2),
        "p99_ms": round(p99 * 1000, 2),
        "max_ms": round(ordered[-1] * 1000, 2),
    }


async def _answer(past: PastModels, as_of: str, run_id: str) -> float:
    """One run and one page of runs as of `as_of`; the seconds it took."""
    started = time.perf_counter()
    seq = await past.resolve(as_of)
    async with past.at(history.ORG, seq) as read:
        await read.runs.get(history.ORG, run_id)
        await read.runs.find(history.ORG, limit=100)
    return time.perf_counter() - started


async def main(runs: int, cold: int, cached: int) -> dict[str, Any]:
    async with private_server("asof") as server, connected(server.url) as nc:
        tpl = await history.capture(nc)
        per_run = len(tpl.run_msgs(history.ws_name(0), history.run_id_for(0)))
        t = time.perf_counter()
        published, made = await history.publish_history(
            nc, tpl, events=runs * per_run, workspaces=WORKSPACES
        )
        build_s = time.perf_counter() - t
        last = await last_seq(nc)
        some_run = history.run_id_for(made - 1)
        rng = random.Random(25)
        cold_s = []
        for _ in range(cold):  # a new cache each time: the whole history folded
            past = PastModels(nc, max_events=10**9)
            try:
                cold_s.append(await _answer(past, str(rng.randint(last - per_run, last)), some_run))
            finally:
                await past.close()
        past = PastModels(nc, max_events=10**9)
        try:
            start = last - (cached // 10 + 1) * per_run
            await _answer(past, str(start), some_run)
            forward_s = [  # each one run's events on
                await _answer(past, str(start + i * per_run), some_run)
                for i in range(1, cached // 10 + 1)
            ]
            cached_s = [await _answer(past, str(last), some_run) for _ in range(cached)]
            when = datetime.now(UTC).isoformat()
            by_time_s = [await _answer(past, when, some_run) for _ in range(cached)]
        finally:
            await past.close()
    return {
        "runs": made,
        "events": published,
        "events_per_run": per_run,
        "build_s": round(build_s, 2),
        "cold": _stats(cold_s),
        "cold_events_per_s": round(published / statistics.median(cold_s)),
        "moved_forward_one_run": _stats(forward_s),
        "cached": _stats(cached_s),
        "cached_by_time": _stats(by_time_s),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--cold", type=int, default=10)
    parser.add_argument("--cached", type=int, default=300)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args.runs, args.cold, args.cached))))
