"""`terraform plan` through runplane's TFE API against the same plan run locally, and how
soon a line Terraform writes on the executor reaches the CLI's terminal.

    PYTHONPATH=$PWD python bench/tfe_plan.py [--resources 10] [--rounds 3]

One `runplane up --tls` (embedded NATS, one executor) in a temporary directory; the
bundled Terraform 1.0.3 with `backend "remote"` against it, and the same configuration
with the local backend. Plans alternate remote and local `--rounds` times (after one
`init` each); the figure is the ratio of the medians (target: <= 1.5x for 10 null
resources). Log latency: an apply of a chain of null resources whose `local-exec` prints
the executor's clock (`date +%s.%N`) every 0.3 s; each printed stamp is compared with the
moment its line comes out of the CLI here (one machine, one clock; target: <= 1 s).
Prints one JSON line. Not a test: it is run by hand (the machine is shared).

Beside the ratio: where each remote plan's time went, from the API's request log and
the run's events (`breakdown`): the CLI's own sleeps (Terraform's remote backend waits
0.5 s before its first look at the configuration version and 1 s before its first look
at the run, by construction), the executor's pickup, its steps, and the log's end.
`ratio_without_cli_sleeps` takes out the part of those sleeps that lay on the critical
path (the 0.5 s always; the 1 s only as far as it outlasted the executor's plan), so it
is what runplane's side costs against a local plan, not a figure any CLI would show.
`--tree DIR` runs `runplane up` from another checkout (a paired run against the tree
before a change: `git worktree add /tmp/old-bench main`), measured by this script.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import IO, Any

from executor.terraform import TerraformConfig, default_binary, prepare

TOKEN = "bench-admin-token-tfe"
BACKEND = """terraform {{
  {block} {{
    hostname     = "{host}"
    organization = "bench"
    workspaces {{ name = "{ws}" }}
  }}
}}
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Https:
    def __init__(self, base: str, ca: Path) -> None:
        self.base = base
        self.ctx = ssl.create_default_context(cafile=str(ca))

    def call(self, method: str, path: str, body: Any = None, token: str = TOKEN) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {token}")
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, context=self.ctx, timeout=30) as resp:
            raw = resp.read()
            return json.loads(raw) if raw else None


def _wait_up(base: str, ca: Path, deadline: float) -> Https:
    while time.monotonic() < deadline:
        if ca.is_file():
            api = Https(base, ca)
            try:
                api.call("GET", "/readyz")
                return api
            except OSError:
                pass
        time.sleep(0.2)
    raise SystemExit("runplane up --tls did not come up")


CLI = [str(default_binary())]  # the CLI the user runs (`--cli`); the executor's is its own


def _terraform(work: Path, env: dict[str, str], *args: str) -> float:
    started = time.monotonic()
    done = subprocess.run([*CLI, *args], cwd=work, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"terraform {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return time.monotonic() - started


def _chain(n: int) -> str:
    out = []
    for i in range(n):
        dep = f"\n  depends_on = [null_resource.s{i - 1}]" if i else ""
        out.append(
            f'resource "null_resource" "s{i}" {{{dep}\n'
            '  provisioner "local-exec" {\n'
            '    command = "echo STAMP $(date +%s.%N); sleep 0.3"\n'
            "  }\n}\n"
        )
    return "".join(out)


def _latencies(work: Path, env: dict[str, str]) -> list[float]:
    """Seconds from each stamp printed on the executor to its line out of the CLI."""
    proc = subprocess.Popen(
        [*CLI, "apply", "-auto-approve", "-no-color"],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    found: list[float] = []
    for line in proc.stdout:
        now = time.time()
        if "STAMP " in line and "echo" not in line:
            stamp = line.rsplit("STAMP ", 1)[1].strip()
            try:
                found.append(now - float(stamp))
            except ValueError:
                continue
    if proc.wait() != 0:
        raise SystemExit("the latency apply failed")
    return found


# The fixed sleeps of Terraform's remote backend (1.0.3 and 1.11 alike):
# planConfigurationVersionsPollInterval before the first configuration-version read, and
# backoff(1000, 3000, 0) before waitForRun's first run read.
CLI_SLEEPS_S = (0.5, 1.0)


def _seconds(at: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(at.replace("Z", "+00:00")).timestamp()


Request = tuple[float, float, str, str]  # start, end, method, path


def _requests(log: Path, start: float, end: float) -> list[Request]:
    """(start, end, method, path) of each API request logged within [start, end]."""
    found = []
    for line in log.read_text(errors="replace").splitlines():
        if '"request"' not in line:
            continue
        try:
            d = json.loads(line)
            stop = _seconds(d["timestamp"])
            begun = stop - float(d["duration_ms"]) / 1000
        except (ValueError, KeyError):
            continue
        if d.get("event") == "request" and start <= begun and stop <= end:
            found.append((begun, stop, str(d["method"]), str(d["path"])))
    return sorted(found)


def _first(reqs: list[Request], method: str, prefix: str, after: float) -> Request | None:
    return next(
        (r for r in reqs if r[2] == method and r[3].startswith(prefix) and r[0] >= after), None
    )


def _round_breakdown(
    api: Https, log: Path, run: dict[str, Any], span: tuple[float, float]
) -> dict[str, Any]:
    """One remote plan: the CLI's sleeps, the executor's pickup and steps, the log's end
    (seconds; None where the log did not show it)."""
    reqs = _requests(log, *span)
    events = api.call("GET", f"/api/v1/orgs/bench/runs/{run['id']}/events")["items"]
    at: dict[str, float] = {}
    for e in events:
        at.setdefault(e["type"], _seconds(e["at"]))
    steps = api.call("GET", f"/api/v1/orgs/bench/runs/{run['id']}/steps")["items"]
    out: dict[str, Any] = {
        "steps_s": {s["step"]: (s.get("duration_ms") or 0) / 1000 for s in steps}
    }
    put = _first(reqs, "PUT", "/api/v2/capabilities/configuration-versions/", span[0])
    cv_get = put and _first(reqs, "GET", "/api/v2/configuration-versions/", put[1])
    post = _first(reqs, "POST", "/api/v2/runs", span[0])
    logs = [r for r in reqs if r[3].startswith("/api/v2/capabilities/logs/plan/")]
    run_get = post and logs and _after_longest_gap(reqs, post, logs[0])
    finished = at.get("run.plan_finished")
    out["cli_start_to_upload_s"] = put and put[0] - span[0]
    out["cli_sleep_config_s"] = cv_get and put and cv_get[0] - put[1]
    out["cli_sleep_run_s"] = run_get and post and _silence_before(reqs, post, run_get)
    out["create_to_claim_s"] = _gap(at, "run.created", "run.phase_started")
    out["created_to_queued_s"] = _gap(at, "run.created", "run.queued")
    out["queued_to_pinned_s"] = _gap(at, "run.queued", "run.pinned")
    out["pinned_to_claim_s"] = _gap(at, "run.pinned", "run.phase_started")
    out["claim_to_first_step_s"] = _gap(at, "run.phase_started", "run.step_started")
    out["created_to_plan_finished_s"] = _gap(at, "run.created", "run.plan_finished")
    out["plan_finished_to_etx_s"] = finished and logs and logs[-1][1] - finished
    out["etx_to_cli_exit_s"] = logs and span[1] - logs[-1][1]
    # On the critical path: the configuration wait always (nothing else happens), the
    # run wait as far as the CLI was still asleep when the plan had finished.
    run_wait = 0.0
    if run_get and finished:
        run_wait = max(0.0, run_get[0] - finished)
    out["cli_sleep_on_path_s"] = (out["cli_sleep_config_s"] or 0.0) + run_wait
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def _after_longest_gap(reqs: list[Request], post: Request, first_log: Request) -> Request | None:
    """The request after the CLI's longest silence between creating the run and its first
    log read: waitForRun's first look at the run (1.11 reads the run for its task stages
    first, 1.0.3 does not)."""
    between = [post, *(r for r in reqs if post[1] <= r[0] and r[1] <= first_log[0]), first_log]
    pairs = list(itertools.pairwise(between))
    return max(pairs, key=lambda p: p[1][0] - p[0][1])[1] if pairs else None


def _silence_before(reqs: list[Request], post: Request, req: Request) -> float:
    """How long the CLI had said nothing when it sent `req`."""
    before = [r[1] for r in reqs if r[1] <= req[0] and r[0] >= post[0]]
    return req[0] - max(before, default=post[1])


def _gap(at: dict[str, float], a: str, b: str) -> float | None:
    return at[b] - at[a] if a in at and b in at else None


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _median_of(rounds: list[dict[str, Any]], key: str) -> float | None:
    xs = [r[key] for r in rounds if isinstance(r.get(key), (int, float))]
    return round(statistics.median(xs), 3) if xs else None


def _start(root: Path, port: int, tree: Path | None, log: IO[bytes]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "RUNPLANE_ADMIN_TOKEN": TOKEN}
    if tree is not None:  # that checkout's runplane, this script's measurement
        env["PYTHONPATH"] = str(tree.resolve())
    argv = ["up", "--tls", "--no-demo", "--data-dir", str(root / "data")]
    return subprocess.Popen(
        [sys.executable, "-m", "services.root.cli", *argv, "--listen", f"127.0.0.1:{port}"],
        env=env,
        cwd=tree or None,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _backend(args: argparse.Namespace, host: str, ws: str) -> str:
    """`backend "remote"` (Terraform 1.0.3), or the `cloud` block of a CLI >= 1.1."""
    return BACKEND.format(block="cloud" if args.cli else 'backend "remote"', host=host, ws=ws)


def _same_terraform(api: Https, args: argparse.Namespace, ws: str) -> None:
    """With `--cli`, the workspace's runs use it too (Terraform 1.0.3 cannot read a
    `cloud` block): the remote plan is the same Terraform as the local one."""
    if args.cli:
        body = {"terraform_binary": str(args.cli), "require_approval": False}
        api.call("PATCH", f"/api/v1/orgs/bench/workspaces/{ws}/settings", body)


def measure(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    port = _port()
    host = f"localhost:{port}"
    log = (root / "up.log").open("wb")
    up = _start(root, port, args.tree, log)
    try:
        ca = (root / "data").resolve() / "tls" / "ca.pem"
        api = _wait_up(f"https://{host}", ca, time.monotonic() + 90)
        api.call("POST", "/api/v1/orgs", {"name": "bench"})
        issued = api.call("POST", "/api/v1/orgs/bench/tokens", {"user": "b", "role": "admin"})
        local_tf = prepare(TerraformConfig(), root / "cli-terraform")
        rc = local_tf.cli_config
        creds = f'\ncredentials "{host}" {{\n  token = "{issued["token"]}"\n}}\n'
        rc.write_text(rc.read_text() + creds)
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(root),
            "TF_CLI_CONFIG_FILE": str(rc),
            "SSL_CERT_FILE": str(ca),
            "TF_IN_AUTOMATION": "1",
            "CHECKPOINT_DISABLE": "1",
        }
        body = "".join(f'resource "null_resource" "r{i}" {{}}\n' for i in range(args.resources))
        remote, local = root / "remote", root / "local"
        for work, head in ((remote, _backend(args, host, "plan")), (local, "")):
            work.mkdir()
            (work / "main.tf").write_text(head + body)
            _terraform(work, env, "init", "-input=false", "-no-color")
        _same_terraform(api, args, "plan")
        _terraform(remote, env, "plan", "-no-color")  # warm-up: the executor's tools
        remote_s, local_s, spans = [], [], []
        for _ in range(args.rounds):
            begun = time.time()
            remote_s.append(_terraform(remote, env, "plan", "-no-color"))
            spans.append((begun, time.time()))
            local_s.append(_terraform(local, env, "plan", "-no-color", "-input=false"))
        runs = api.call("GET", f"/api/v1/orgs/bench/workspaces/plan/runs?limit={args.rounds}")
        ordered = sorted(runs["items"], key=lambda r: r["id"])  # ULIDs: creation order
        rounds = [
            _round_breakdown(api, root / "up.log", run, span)
            for run, span in zip(ordered, spans, strict=True)
        ]
        chain = root / "chain"
        chain.mkdir()
        (chain / "main.tf").write_text(_backend(args, host, "latency") + _chain(args.chain))
        _terraform(chain, env, "init", "-input=false", "-no-color")
        _same_terraform(api, args, "latency")
        lat = _latencies(chain, env)
    finally:
        up.terminate()
        up.wait(timeout=60)
        log.close()
    return _report(args, remote_s, local_s, rounds, lat)


def _report(
    args: argparse.Namespace,
    remote_s: list[float],
    local_s: list[float],
    rounds: list[dict[str, Any]],
    lat: list[float],
) -> dict[str, Any]:
    remote_med, local_med = statistics.median(remote_s), statistics.median(local_s)
    first, lat = (lat[0] if lat else None), sorted(lat)
    on_path = _median_of(rounds, "cli_sleep_on_path_s") or 0.0
    floor = (_median_of(rounds, "cli_start_to_upload_s") or 0.0) + sum(CLI_SLEEPS_S)
    keys = [k for k in rounds[0] if k != "steps_s"] if rounds else []
    steps = sorted({name for r in rounds for name in r["steps_s"]})
    return {
        "benchmark": "tfe_plan",
        "tree": str(args.tree or "this"),
        "cli": CLI[0],
        "resources": args.resources,
        "rounds": args.rounds,
        "remote_plan_s": [round(x, 2) for x in remote_s],
        "local_plan_s": [round(x, 2) for x in local_s],
        "remote_median_s": round(remote_med, 3),
        "local_median_s": round(local_med, 3),
        "ratio_of_medians": round(remote_med / local_med, 2),
        "target_ratio": 1.5,
        "cli_fixed_sleeps_s": sum(CLI_SLEEPS_S),
        # The CLI's own start and upload, then its two sleeps: no remote plan is faster.
        "cli_floor_s": round(floor, 3),
        "cli_floor_ratio": round(floor / local_med, 2),
        "cli_sleep_on_path_median_s": on_path,
        "ratio_without_cli_sleeps": round((remote_med - on_path) / local_med, 2),
        "breakdown_median_s": {k: _median_of(rounds, k) for k in keys},
        "steps_median_s": {
            name: round(statistics.median(r["steps_s"].get(name, 0.0) for r in rounds), 3)
            for name in steps
        },
        "log_lines_measured": len(lat),
        "log_latency_p50_s": _round(_pct(lat, 0.5)),
        "log_latency_p99_s": _round(_pct(lat, 0.99)),
        "log_latency_max_s": _round(lat[-1] if lat else None),
        # The apply's first line may be written before the CLI's first look at the run
        # (waitForRun sleeps 1 s first): it waits in the log until the CLI reads.
        "log_latency_first_line_s": _round(first),
        "target_latency_s": 1.0,
        "load_average": round(os.getloadavg()[0], 2),
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--resources", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chain", type=int, default=20, help="resources of the latency apply")
    parser.add_argument("--tree", type=Path, help="run `runplane up` from this checkout")
    parser.add_argument("--cli", type=Path, help="the user's Terraform (>= 1.1: `cloud` block)")
    args = parser.parse_args()
    if args.cli:
        CLI[:] = [str(args.cli)]
    with tempfile.TemporaryDirectory(prefix="rp-bench-tfe-") as tmp:
        print(json.dumps(measure(args, Path(tmp))))


if __name__ == "__main__":
    main()
