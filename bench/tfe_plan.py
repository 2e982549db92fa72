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
"""

from __future__ import annotations

import argparse
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
from typing import Any

from executor.terraform import TerraformConfig, default_binary, prepare

TOKEN = "bench-admin-token-tfe"
BACKEND = """terraform {{
  backend "remote" {{
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
                api.call("GET", "/healthz")
                return api
            except OSError:
                pass
        time.sleep(0.2)
    raise SystemExit("runplane up --tls did not come up")


def _terraform(work: Path, env: dict[str, str], *args: str) -> float:
    started = time.monotonic()
    done = subprocess.run(
        [str(default_binary()), *args], cwd=work, env=env, capture_output=True, text=True
    )
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
        [str(default_binary()), "apply", "-auto-approve", "-no-color"],
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


def _breakdown(api: Https) -> dict[str, Any]:
    """Where the last remote plan's time went: its events' times and its steps."""
    (run,) = api.call("GET", "/api/v1/orgs/bench/workspaces/plan/runs?limit=1")["items"]
    events = api.call("GET", f"/api/v1/orgs/bench/runs/{run['id']}/events")["items"]
    first = _seconds(events[0]["at"])
    out: dict[str, Any] = {e["type"]: round(_seconds(e["at"]) - first, 3) for e in events}
    steps = api.call("GET", f"/api/v1/orgs/bench/runs/{run['id']}/steps")["items"]
    out["steps_ms"] = {s["step"]: s.get("duration_ms") for s in steps}
    return out


def _seconds(at: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(at.replace("Z", "+00:00")).timestamp()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--resources", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chain", type=int, default=8, help="resources of the latency apply")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rp-bench-tfe-") as tmp:
        root = Path(tmp)
        port = _port()
        host = f"localhost:{port}"
        data = root / "data"
        log = (root / "up.log").open("w")
        argv = ["up", "--tls", "--no-demo", "--data-dir", str(data)]
        up = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *argv, "--listen", f"127.0.0.1:{port}"],
            env={**os.environ, "RUNPLANE_ADMIN_TOKEN": TOKEN},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            ca = data.resolve() / "tls" / "ca.pem"
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
            for work, head in ((remote, BACKEND.format(host=host, ws="plan")), (local, "")):
                work.mkdir()
                (work / "main.tf").write_text(head + body)
                _terraform(work, env, "init", "-input=false", "-no-color")
            remote_s, local_s = [], []
            for _ in range(args.rounds):
                remote_s.append(_terraform(remote, env, "plan", "-no-color"))
                local_s.append(_terraform(local, env, "plan", "-no-color", "-input=false"))
            breakdown = _breakdown(api)
            chain = root / "chain"
            chain.mkdir()
            (chain / "main.tf").write_text(
                BACKEND.format(host=host, ws="latency") + _chain(args.chain)
            )
            _terraform(chain, env, "init", "-input=false", "-no-color")
            lat = sorted(_latencies(chain, env))
        finally:
            up.terminate()
            up.wait(timeout=60)
            log.close()
    remote_med, local_med = statistics.median(remote_s), statistics.median(local_s)
    print(
        json.dumps(
            {
                "benchmark": "tfe_plan",
                "resources": args.resources,
                "rounds": args.rounds,
                "remote_plan_s": [round(x, 2) for x in remote_s],
                "local_plan_s": [round(x, 2) for x in local_s],
                "ratio_of_medians": round(remote_med / local_med, 2),
                "target_ratio": 1.5,
                "last_remote_plan": breakdown,
                "log_lines_measured": len(lat),
                "log_latency_p50_s": round(statistics.median(lat), 3) if lat else None,
                "log_latency_max_s": round(lat[-1], 3) if lat else None,
                "target_latency_s": 1.0,
                "load_average": os.getloadavg()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
