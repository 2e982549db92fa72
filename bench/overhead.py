"""overhead: what runplane adds to a plan+apply of 10 null resources, against the same
Terraform run by hand.

Alternating rounds on one workspace (a local git repository): (a) by hand: `git clone`,
`terraform init`, `plan -out`, `apply` of that plan, with the binary and the CLI config
(provider mirror) the executor's jobs use; (b) through runplane: an `apply` run with
`require_approval` off on `runplane up` (a new workspace each round: 10 resources to
create, as by hand), from the create request to `applied` seen by a
50 ms poll of the API. Medians of each and their ratio; the runplane run's steps (from
its step list) say where the rest goes.

    python -m bench.overhead [--rounds N]

`--sandbox`: what the sandbox costs a phase against the uid mode instead (issue 23: at
most +5%): two `runplane up`s, `--isolation user` and `--isolation sandbox`, a plan run of
the same 10 null resources on a new workspace in each, alternated (the order swapped
every round), from the create request to `planned`; medians, their ratio, the median
of each round's own ratio (and its quartiles), and the plan step's own medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "bench"

from executor.worker import default_jobs_dir
from tests.procs import Client, Proc, free_port, wait_healthy

RESOURCES = 10
TOKEN = "bench-overhead-token"
MODES = ("sandbox", "user", "bwrap", "none")  # what `--isolation auto` may turn into
V1 = "/api/v1/orgs/bench"
MAIN_TF = f'resource "null_resource" "r" {{\n  count = {RESOURCES}\n}}\n'
_GIT = {
    "GIT_AUTHOR_NAME": "b",
    "GIT_AUTHOR_EMAIL": "b@example.com",
    "GIT_COMMITTER_NAME": "b",
    "GIT_COMMITTER_EMAIL": "b@example.com",
}


def _repo(path: Path) -> Path:
    path.mkdir(parents=True)
    env = {**os.environ, **_GIT}
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=path, check=True, env=env)
    (path / "main.tf").write_text(MAIN_TF)
    subprocess.run(["git", "add", "main.tf"], cwd=path, check=True, env=env)
    subprocess.run(["git", "commit", "-qm", "ten"], cwd=path, check=True, env=env)
    return path


def _tools(work: Path) -> tuple[Path, Path]:
    """The binary and CLI config the executor's jobs use: published for isolated jobs,
    else the executor's own."""
    published = sorted((default_jobs_dir(work) / "tools").glob("*/terraform.rc"))
    if published:
        return next((published[0].parent / "bin").iterdir()), published[0]
    from executor.terraform import default_binary

    return default_binary(), work / "terraform" / "terraform.rc"


def _by_hand(repo: Path, tools: tuple[Path, Path], scratch: Path) -> dict[str, float]:
    """One plan+apply by hand; seconds per command."""
    tf, rc = tools
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("RUNPLANE_", "TF_"))},
        "TF_CLI_CONFIG_FILE": str(rc),
        "TF_IN_AUTOMATION": "1",
        "TF_INPUT": "0",
        "CHECKPOINT_DISABLE": "1",
    }
    dest = Path(tempfile.mkdtemp(dir=scratch))
    src = dest / "src"
    steps = {
        "clone": ["git", "clone", "-q", "--", str(repo), str(src)],
        "init": [str(tf), "init", "-input=false", "-no-color"],
        "plan": [str(tf), "plan", "-input=false", "-no-color", "-out=plan.tfplan"],
        "apply": [str(tf), "apply", "-input=false", "-no-color", "plan.tfplan"],
    }
    out = {}
    try:
        for name, argv in steps.items():
            t = time.perf_counter()
            cwd = dest if name == "clone" else src
            subprocess.run(argv, cwd=cwd, env=env, check=True, capture_output=True)
            out[name] = time.perf_counter() - t
    finally:
        shutil.rmtree(dest, ignore_errors=True)
    out["total"] = sum(out.values())
    return out


async def _through_runplane(client: Client, repo: Path, ws: str) -> dict[str, Any]:
    """One apply run on a new workspace (fresh state, as by hand: 10 to create)."""
    await client.ok("POST", f"{V1}/workspaces", {"name": ws, "repository": str(repo)})
    await client.ok("PATCH", f"{V1}/workspaces/{ws}/settings", {"require_approval": False})
    t, wall = time.perf_counter(), time.time()
    run = await client.ok("POST", f"{V1}/workspaces/{ws}/runs", {"type": "apply"})
    wanted = {"applied", "failed", "awaiting_approval", "canceled", "discarded", "planned"}
    done = await client.wait_status("bench", run["id"], wanted, timeout=120)
    total = time.perf_counter() - t
    if done["status"] != "applied":
        why = done.get("error_message") or done["status"]
        raise RuntimeError(f"the bench run ended {done['status']}: {why}")
    steps = await client.ok("GET", f"{V1}/runs/{run['id']}/steps")
    events = await client.ok("GET", f"{V1}/runs/{run['id']}/events")
    marks = timeline(events, wall)
    # to the run's last event (`applied`), by the events' own clock: the run's time
    # without the poll's lag (the API stamps them on this machine)
    to_end = marks[-1][1] if marks else total
    return {"total": total, "to_applied": to_end, "steps": steps, "marks": marks}


def timeline(events: Any, start: float) -> list[tuple[str, float]]:
    """Each of the run's events (`type`, with its step) and its time since `start`
    (seconds of the epoch, the create request's)."""
    items = events.get("items", []) if isinstance(events, dict) else events
    out = []
    for e in items or []:
        data = e.get("data") or {}
        name = e["type"].removeprefix("run.")
        if data.get("step"):
            name += f" {data['step']}"
        elif data.get("phase"):
            name += f" {data['phase']}"
        at = datetime.fromisoformat(str(e["at"]).replace("Z", "+00:00")).timestamp()
        out.append((name, at - start))
    return out


def gaps(rounds: list[list[tuple[str, float]]]) -> dict[str, float]:
    """The median time from each event to the next (`a -> b`) over the rounds, in order:
    the run's hand-offs and each step's cost, where its wall time goes."""
    seen: dict[str, list[float]] = {}
    for marks in rounds:
        prev, at = "request", 0.0
        for name, t in marks:
            seen.setdefault(f"{prev} -> {name}", []).append(t - at)
            prev, at = name, t
    return {k: round(statistics.median(v), 4) for k, v in seen.items()}


def tree_cpu(pid: int) -> float:
    """CPU seconds of `pid` and every live descendant, with what each reaped of its own
    children (utime + stime + cutime + cstime from /proc/<pid>/stat)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry.name)] = int(fields[1])
        times[int(entry.name)] = sum(int(x) for x in fields[11:15]) / tick
    tree, todo = {pid}, [pid]
    while todo:
        here = todo.pop()
        for child, parent in parents.items():
            if parent == here and child not in tree:
                tree.add(child)
                todo.append(child)
    return sum(times.get(p, 0.0) for p in tree)


def _children_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _step_seconds(steps: Any, cpu: bool = False) -> dict[str, float]:
    """Seconds per `phase/step` of a run's step list (`duration_ms` of each; `cpu`: the
    CPU seconds its processes used, where measured)."""
    out: dict[str, float] = {}
    items = steps.get("items", []) if isinstance(steps, dict) else steps
    for s in items or []:
        metrics = s.get("metrics") or {}
        value = metrics.get("cpu_seconds") if cpu else s.get("duration_ms")
        if value is not None:
            key = f"{s.get('phase', '')}/{s.get('step', '')}"
            out[key] = out.get(key, 0.0) + (value if cpu else value / 1000)
    return out


async def overhead(rounds: int = 5, isolation: str = "auto") -> dict[str, Any]:
    """The benchmark; its figures (bench/run.py puts them in the table). `isolation`:
    the executor's (`none` measures what isolation itself costs)."""
    scratch = Path(tempfile.mkdtemp(prefix="rp-bench-overhead-"))
    os.chmod(scratch, 0o711)
    data, port = scratch / "data", free_port()
    repo = _repo(scratch / "repo")
    up = await Proc(
        ["up", "--no-demo", "--data-dir", str(data), "--listen", f"127.0.0.1:{port}"],
        scratch / "up.log",
        env={"RUNPLANE_ADMIN_TOKEN": TOKEN, "RUNPLANE_ISOLATION": isolation},
    ).start()
    base = f"http://127.0.0.1:{port}"
    client = Client(base, TOKEN)
    hand: list[dict[str, float]] = []
    ours: list[dict[str, Any]] = []
    try:
        await wait_healthy(base)
        await client.ok("POST", "/api/v1/orgs", {"name": "bench"})
        await _through_runplane(client, repo, "warm")  # the mirror, the tools, page cache
        tools = _tools(data / "work")
        _by_hand(repo, tools, scratch)  # warm the page cache alike
        assert up.proc is not None
        for i in range(rounds):
            cpu = _children_cpu()
            hand.append(await asyncio.to_thread(_by_hand, repo, tools, scratch))
            hand[-1]["cpu"] = _children_cpu() - cpu
            cpu = tree_cpu(up.proc.pid)
            ours.append(await _through_runplane(client, repo, f"net-{i}"))
            ours[-1]["cpu"] = tree_cpu(up.proc.pid) - cpu
        mode = next((m for m in MODES if f'"isolation": "{m}"' in up.output()), "?")
    finally:
        await client.close()
        await up.stop(signal.SIGTERM)
        shutil.copyfile(scratch / "up.log", Path(tempfile.gettempdir()) / "rp-bench-overhead.log")
        shutil.rmtree(scratch, ignore_errors=True)
    a = statistics.median(h["total"] for h in hand)
    b = statistics.median(o["total"] for o in ours)
    per_step: dict[str, list[float]] = {}
    per_step_cpu: dict[str, list[float]] = {}
    for o in ours:
        for k, v in _step_seconds(o["steps"]).items():
            per_step.setdefault(k, []).append(v)
        for k, v in _step_seconds(o["steps"], cpu=True).items():
            per_step_cpu.setdefault(k, []).append(v)
    return {
        "rounds": rounds,
        "resources": RESOURCES,
        "isolation": mode,
        "by_hand_median_s": a,
        "runplane_median_s": b,
        "ratio": b / a,
        # each round's two ran back to back: the median of their ratios keeps the
        # machine's drift out of the comparison (the ratio of medians above does not)
        "paired_ratio_median": statistics.median(
            o["total"] / h["total"] for h, o in zip(hand, ours, strict=True)
        ),
        # CPU seconds: by hand, its commands; runplane, `up` and all below it (nats-server,
        # git, Terraform and the sandbox): what load distorts least
        "by_hand_cpu_median_s": statistics.median(h["cpu"] for h in hand),
        "runplane_cpu_median_s": statistics.median(o["cpu"] for o in ours),
        # the run's time to its last event, by the events' clock (no poll lag)
        "runplane_to_applied_median_s": statistics.median(o["to_applied"] for o in ours),
        "paired_ratio_to_applied_median": statistics.median(
            o["to_applied"] / h["total"] for h, o in zip(hand, ours, strict=True)
        ),
        "runplane_gaps_median_s": gaps([o["marks"] for o in ours]),
        "by_hand_steps_median_s": {
            k: statistics.median(h[k] for h in hand) for k in ("clone", "init", "plan", "apply")
        },
        "runplane_steps_median_s": {k: statistics.median(v) for k, v in per_step.items()},
        "runplane_steps_cpu_median_s": {
            k: round(statistics.median(v), 3) for k, v in per_step_cpu.items()
        },
    }


async def _plan_run(client: Client, repo: Path, ws: str) -> tuple[float, float]:
    """One plan run on a new workspace: (seconds to `planned`, its plan step's seconds)."""
    await client.ok("POST", f"{V1}/workspaces", {"name": ws, "repository": str(repo)})
    t = time.perf_counter()
    run = await client.ok("POST", f"{V1}/workspaces/{ws}/runs", {"type": "plan"})
    done = await client.wait_status("bench", run["id"], {"planned", "failed"}, timeout=120)
    total = time.perf_counter() - t
    if done["status"] != "planned":
        raise RuntimeError(f"the bench plan failed: {done.get('error_message')}")
    steps = _step_seconds(await client.ok("GET", f"{V1}/runs/{run['id']}/steps"))
    return total, steps.get("plan/plan", 0.0)


async def sandbox_overhead(rounds: int = 5) -> dict[str, Any]:
    """A plan in the sandbox against one in the uid mode, alternated (module docstring)."""
    scratch = Path(tempfile.mkdtemp(prefix="rp-bench-sandbox-"))
    os.chmod(scratch, 0o711)
    repo = _repo(scratch / "repo")
    modes = ("user", "sandbox")
    ups: dict[str, Proc] = {}
    clients: dict[str, Client] = {}
    seen: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    try:
        for mode in modes:
            data, port = scratch / mode, free_port()
            ups[mode] = await Proc(
                ["up", "--no-demo", "--data-dir", str(data), "--listen", f"127.0.0.1:{port}"],
                scratch / f"up-{mode}.log",
                env={"RUNPLANE_ADMIN_TOKEN": TOKEN, "RUNPLANE_ISOLATION": mode},
            ).start()
            await wait_healthy(f"http://127.0.0.1:{port}")
            clients[mode] = Client(f"http://127.0.0.1:{port}", TOKEN)
            await clients[mode].ok("POST", "/api/v1/orgs", {"name": "bench"})
            await _plan_run(clients[mode], repo, "warm")
        for i in range(rounds):
            for mode in modes if i % 2 == 0 else modes[::-1]:
                seen[mode].append(await _plan_run(clients[mode], repo, f"p-{i}"))
    finally:
        for client in clients.values():
            await client.close()
        for up in ups.values():
            await up.stop(signal.SIGTERM)
        shutil.rmtree(scratch, ignore_errors=True)
    run = {m: statistics.median(t for t, _ in seen[m]) for m in modes}
    plan = {m: statistics.median(p for _, p in seen[m]) for m in modes}
    paired = [s[0] / u[0] for u, s in zip(seen["user"], seen["sandbox"], strict=True)]
    return {
        "rounds": rounds,
        "resources": RESOURCES,
        "user_plan_run_median_s": run["user"],
        "sandbox_plan_run_median_s": run["sandbox"],
        "ratio": run["sandbox"] / run["user"],
        # each round's two runs ran back to back: the median of their ratios holds the
        # machine's drift out of the comparison (the ratio of medians above does not)
        "paired_ratio_median": statistics.median(paired),
        "paired_ratio_quartiles": [round(q, 3) for q in statistics.quantiles(paired, n=4)],
        "user_plan_step_median_s": plan["user"],
        "sandbox_plan_step_median_s": plan["sandbox"],
        "plan_step_ratio": plan["sandbox"] / plan["user"],
        "runs_s": {m: [round(t, 3) for t, _ in seen[m]] for m in modes},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.overhead", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--isolation", default="auto", choices=("auto", *MODES))
    p.add_argument("--sandbox", action="store_true", help="the sandbox against the uid mode")
    args = p.parse_args(argv)
    from infra import logs

    logs.configure("console", "error")
    if args.sandbox:
        figures = asyncio.run(sandbox_overhead(args.rounds))
    else:
        figures = asyncio.run(overhead(args.rounds, args.isolation))
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
