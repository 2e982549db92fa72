"""The read load of benchmark 6, run as its own process: `concurrency` aiohttp clients in a
closed loop, each GETting random runs for `seconds`; prints one JSON line of results.

    python -m bench.loadgen --url URL --token T --org ORG --runs FILE --seconds S
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from pathlib import Path

import aiohttp


async def main(args: argparse.Namespace) -> dict[str, object]:
    runs = Path(args.runs).read_text().split()
    headers = {"Authorization": f"Bearer {args.token}"}
    lat: list[float] = []
    statuses: dict[int, int] = {}
    rng = random.Random(7)
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(args.url, headers=headers, connector=connector) as http:

        async def one(run: str) -> float:
            t = time.perf_counter()
            async with http.get(f"/api/v1/orgs/{args.org}/runs/{run}") as resp:
                await resp.read()
                statuses[resp.status] = statuses.get(resp.status, 0) + 1
            return time.perf_counter() - t

        warm_until = time.perf_counter() + args.warmup
        warmup = 0
        while time.perf_counter() < warm_until:
            await one(rng.choice(runs))
            warmup += 1
        statuses.clear()

        async def client() -> None:
            while time.perf_counter() < end:
                lat.append(await one(rng.choice(runs)))

        start = time.perf_counter()
        end = start + args.seconds
        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - start
    lat.sort()

    def pct(q: float) -> float:
        k = max(0, min(len(lat) - 1, math.ceil(q / 100 * len(lat)) - 1))
        return lat[k] * 1000 if lat else 0.0

    return {
        "requests": len(lat),
        "warmup_requests": warmup,
        "requests_per_s": len(lat) / elapsed,
        "p50_ms": pct(50),
        "p99_ms": pct(99),
        "max_ms": lat[-1] * 1000 if lat else 0.0,
        "statuses": {str(k): v for k, v in statuses.items()},
        "concurrency": args.concurrency,
    }


def cli() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--token", required=True)
    p.add_argument("--org", required=True)
    p.add_argument("--runs", required=True, help="file of run ids, whitespace separated")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--concurrency", type=int, default=1)
    result = asyncio.run(main(p.parse_args()))
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    cli()
