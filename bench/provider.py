"""provider: `terraform init` of a large provider through runplane, the first run of a
lock file against the second (issue 26, item 2).

The provider is the null provider the tests use with `--padding-mib` (default 200) MiB of
random bytes appended (a Go binary runs with data appended), packed (zip layout) under
its own source address `registry.example/bench/big` in a filesystem mirror, with its
`h1:` and `zh:` hashes in the workspace's `.terraform.lock.hcl`. The configuration
requires it as `null`; one `null_resource` whose trigger is `timestamp()`, so that every
apply run has a plan and an apply phase.

Each round: a fresh `runplane up` (`--isolation`, default sandbox) with that mirror
(RUNPLANE_PROVIDER_MIRRORS) and an empty provider cache of its own
(RUNPLANE_PROVIDER_CACHE; a tree without the cache ignores it), then two apply runs of
the same commit: the steps' `init` seconds of each phase and the CPU seconds of their job
processes (the step's `cpu_seconds`, from the phase's control group: Terraform, not the
executor's own unpacking), and the CPU seconds of `up` and what it waited for
(`/proc/<pid>/stat`) per run. By hand, beside it: `terraform init`
of the same configuration from the packed mirror in a fresh directory (what a cold init
costs Terraform alone).

    python -m bench.provider [--rounds 3] [--padding-mib 200] [--tree /work/before]

`--tree DIR` runs `runplane up` from that checkout (the tree before a change), measured by
this script; alternate runs with and without it for a paired figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "bench"

from bench.overhead import _step_seconds
from executor.terraform import default_binary
from tests.procs import RUNPLANE, Client, free_port, wait_healthy
from tests.provider_cache_support import Packed, packed_provider

TOKEN = "bench-provider-token"
V1 = "/api/v1/orgs/bench"
SOURCE = "registry.example/bench/big"
_GIT = {
    "GIT_AUTHOR_NAME": "b",
    "GIT_AUTHOR_EMAIL": "b@example.com",
    "GIT_COMMITTER_NAME": "b",
    "GIT_COMMITTER_EMAIL": "b@example.com",
}


def _main_tf(packed: Packed) -> str:
    return (
        "terraform {\n  required_providers {\n"
        f'    null = {{ source = "{packed.source}", version = "{packed.version}" }}\n'
        "  }\n}\n"
        'resource "null_resource" "r" {\n  triggers = { at = timestamp() }\n}\n'
    )


def _repo(path: Path, packed: Packed) -> Path:
    path.mkdir(parents=True)
    env = {**os.environ, **_GIT}
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=path, check=True, env=env)
    (path / "main.tf").write_text(_main_tf(packed))
    (path / ".terraform.lock.hcl").write_text(packed.lock())
    subprocess.run(["git", "add", "-A"], cwd=path, check=True, env=env)
    subprocess.run(["git", "commit", "-qm", "big"], cwd=path, check=True, env=env)
    return path


def _cpu_s(pid: int) -> float:
    """utime + stime of `pid` and of the children it waited for, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _by_hand(packed: Packed, scratch: Path) -> float:
    """`terraform init` from the packed mirror in a fresh directory: seconds."""
    work = Path(tempfile.mkdtemp(dir=scratch))
    rc = work / "terraform.rc"
    rc.write_text(
        "provider_installation {\n  filesystem_mirror {\n"
        f'    path = "{packed.mirror}"\n    include = ["registry.example/*/*"]\n  }}\n'
        '  direct {\n    exclude = ["registry.example/*/*"]\n  }\n}\n'
    )
    (work / "main.tf").write_text(_main_tf(packed))
    (work / ".terraform.lock.hcl").write_text(packed.lock())
    env = {"PATH": os.environ["PATH"], "TF_CLI_CONFIG_FILE": str(rc), "CHECKPOINT_DISABLE": "1"}
    t = time.perf_counter()
    subprocess.run(
        [str(default_binary()), "init", "-input=false", "-no-color"],
        cwd=work,
        env=env,
        check=True,
        capture_output=True,
    )
    took = time.perf_counter() - t
    shutil.rmtree(work, ignore_errors=True)
    return took


async def _apply(client: Client, pid: int) -> dict[str, float]:
    """One apply run: each phase's init seconds, the run's seconds and CPU seconds."""
    cpu, t = _cpu_s(pid), time.perf_counter()
    run = await client.ok("POST", f"{V1}/workspaces/big/runs", {"type": "apply"})
    wanted = {"applied", "failed", "awaiting_approval", "canceled", "planned", "no_changes"}
    done = await client.wait_status("bench", run["id"], wanted, timeout=600)
    took, used = time.perf_counter() - t, _cpu_s(pid) - cpu
    if done["status"] != "applied":
        raise RuntimeError(f"the bench run ended {done['status']}: {done.get('error_message')}")
    listed = await client.ok("GET", f"{V1}/runs/{run['id']}/steps")
    steps, job = _step_seconds(listed), _job_cpu(listed)
    return {
        "plan_init_s": steps["plan/init"],
        "apply_init_s": steps["apply/init"],
        "plan_init_job_cpu_s": job.get("plan/init", -1.0),
        "apply_init_job_cpu_s": job.get("apply/init", -1.0),
        "run_s": took,
        "cpu_s": used,
    }


def _job_cpu(steps: Any) -> dict[str, float]:
    """CPU seconds of each `phase/step`'s job processes (its control group), where measured."""
    items = steps.get("items", []) if isinstance(steps, dict) else steps
    out: dict[str, float] = {}
    for s in items or []:
        cpu = (s.get("metrics") or {}).get("cpu_seconds")
        if cpu is not None:
            out[f"{s.get('phase', '')}/{s.get('step', '')}"] = float(cpu)
    return out


async def _round(packed: Packed, scratch: Path, tree: Path | None, isolation: str) -> Any:
    data, cache, port = scratch / "data", scratch / "cache", free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str((tree or Path(__file__).resolve().parent.parent).resolve()),
        "RUNPLANE_ADMIN_TOKEN": TOKEN,
        "RUNPLANE_ISOLATION": isolation,
        "RUNPLANE_PROVIDER_MIRRORS": str(packed.mirror),
        "RUNPLANE_PROVIDER_CACHE": str(cache),
        "RUNPLANE_ALLOWED_REPOS": f"https://,ssh://,{tempfile.gettempdir()}/",
    }
    args = ["up", "--no-demo", "--data-dir", str(data), "--listen", f"127.0.0.1:{port}"]
    with open(scratch / "up.log", "ab") as log:
        up = await asyncio.create_subprocess_exec(
            *RUNPLANE,
            *args,
            cwd=str(tree.resolve()) if tree else None,
            env=env,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    client = Client(base, TOKEN)
    try:
        await wait_healthy(base, timeout=60)
        await client.ok("POST", "/api/v1/orgs", {"name": "bench"})
        repo = str(_repo(scratch / "repo", packed))
        await client.ok("POST", f"{V1}/workspaces", {"name": "big", "repository": repo})
        await client.ok("PATCH", f"{V1}/workspaces/big/settings", {"require_approval": False})
        first = await _apply(client, up.pid)
        second = await _apply(client, up.pid)
    finally:
        await client.close()
        up.send_signal(signal.SIGTERM)
        await asyncio.wait_for(up.wait(), 60)
    return {"first": first, "second": second}


async def provider(
    rounds: int = 3, padding_mib: int = 200, tree: Path | None = None, isolation: str = "sandbox"
) -> dict[str, Any]:
    """The benchmark's figures (module docstring)."""
    scratch = Path(tempfile.mkdtemp(prefix="rp-bench-provider-"))
    os.chmod(scratch, 0o711)
    try:
        packed = await asyncio.to_thread(
            packed_provider, scratch / "mirror", source=SOURCE, padding=padding_mib * 1024**2
        )
        size = sum(f.stat().st_size for f in packed.mirror.rglob("*.zip"))
        hand = [await asyncio.to_thread(_by_hand, packed, scratch) for _ in range(rounds)]
        seen = []
        for i in range(rounds):
            (scratch / f"r{i}").mkdir(mode=0o711)
            seen.append(await _round(packed, scratch / f"r{i}", tree, isolation))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    def med(run: str, key: str) -> float:
        return statistics.median(r[run][key] for r in seen)

    cold = med("first", "plan_init_s")
    return {
        "tree": str(tree or "this"),
        "isolation": isolation,
        "rounds": rounds,
        "package_zip_mib": round(size / 1024**2, 1),
        "by_hand_init_from_packed_median_s": statistics.median(hand),
        "first_run_plan_init_median_s": cold,
        "first_run_apply_init_median_s": med("first", "apply_init_s"),
        "second_run_plan_init_median_s": med("second", "plan_init_s"),
        "second_run_apply_init_median_s": med("second", "apply_init_s"),
        # the target: each phase's init of the second run at most 10% of the first's cold one
        "second_plan_init_over_first": med("second", "plan_init_s") / cold,
        "second_apply_init_over_first": med("second", "apply_init_s") / cold,
        "per_round_ratios": [
            [
                round(r["second"][k] / r["first"]["plan_init_s"], 3)
                for k in ("plan_init_s", "apply_init_s")
            ]
            for r in seen
        ],
        "first_run_s": med("first", "run_s"),
        "second_run_s": med("second", "run_s"),
        "first_run_plan_init_job_cpu_s": med("first", "plan_init_job_cpu_s"),
        "second_run_plan_init_job_cpu_s": med("second", "plan_init_job_cpu_s"),
        "second_run_apply_init_job_cpu_s": med("second", "apply_init_job_cpu_s"),
        "first_run_cpu_s": med("first", "cpu_s"),
        "second_run_cpu_s": med("second", "cpu_s"),
        "runs": seen,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.provider", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--padding-mib", type=int, default=200)
    p.add_argument("--tree", type=Path, help="run `runplane up` from this checkout")
    p.add_argument("--isolation", default="sandbox", choices=("sandbox", "user", "auto", "none"))
    args = p.parse_args(argv)
    from infra import logs

    logs.configure("console", "error")
    figures = asyncio.run(provider(args.rounds, args.padding_mib, args.tree, args.isolation))
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
