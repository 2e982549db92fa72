"""A VCS webhook's latency to its runs: 1,000 workspaces bound to one GitHub connection
on one repository, 50 of them matching each push (trigger paths on `modules/**`; the
rest watch their own directories), target p99 <= 100 ms from the webhook request to each
run's `run.created`.

    PYTHONPATH=$PWD python bench/vcs_webhook.py [--workspaces 1000] [--matching 50] [-n 40]

The workspaces are created through the real `App` (the read model folds them as it would
any); each push is GitHub's own example payload (tests/fixtures/vcs/github/push.branch.json)
with its repository, files and commit rewritten, signed, and sent to the real app
(middlewares, signature, replay check, matching in the read model, the push checked
against its branch's head by `git ls-remote`, its claim, `create_run` with derived ids)
over loopback HTTP, one delivery at a time. Each push is a new commit of a local
repository, which git reaches as `https://github.com/acme/net.git` (`url.insteadOf`), so
the head check costs what a local `git ls-remote` does. A core subscription on the runs'
subjects times each `run.created` against the start of its request. Prints one JSON line.
Not a test: it is run by hand (the machine is shared)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from events.values import Workspace
from infra import streams
from infra.crypto import KeyRing
from infra.eventstore import EventStore
from infra.natsserver import EmbeddedNats
from projections.projector import Projector
from services.app.commands import App
from services.app.secrets import SecretStore
from services.processes.vcs import signing
from services.surfaces.api.app import build_app

ADMIN = "bench-admin-token"
ORG = "bench"
SECRET = "bench-webhook-secret"
REPO = "https://github.com/acme/net.git"
FIXTURE = Path(__file__).parent.parent / "tests/fixtures/vcs/github/push.branch.json"


def percentile(times: list[float], p: float) -> float:
    times = sorted(times)
    return round(times[min(len(times) - 1, int(len(times) * p))], 2)


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@example.com"}
    env |= {"GIT_COMMITTER_NAME": "b", "GIT_COMMITTER_EMAIL": "b@example.com"}
    done = subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True)
    return done.stdout.decode().strip()


def repository(root: Path) -> Path:
    """acme/net's master, as git reaches `REPO` from now on in this process."""
    repo = root / "acme-net"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "master")
    os.environ |= {
        "GIT_CONFIG_COUNT": "1",
        "GIT_CONFIG_KEY_0": f"url.{repo.as_uri()}.insteadOf",
        "GIT_CONFIG_VALUE_0": REPO,
    }
    return repo


def pushed(repo: Path, n: int) -> str:
    (repo / "modules").mkdir(exist_ok=True)
    (repo / "modules" / f"m{n}.tf").write_text(f"# {n}\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", f"m{n}")
    return git(repo, "rev-parse", "HEAD")


def payload(n: int, sha: str) -> bytes:
    data = json.loads(FIXTURE.read_text())
    data["repository"].update(
        full_name="acme/net", clone_url=REPO, html_url="https://github.com/acme/net"
    )
    data.update(created=False, after=sha)
    data["head_commit"]["id"] = sha
    data["commits"] = [{**data["commits"][0], "added": [f"modules/m{n}.tf"], "modified": []}]
    return json.dumps(data).encode()


async def workspaces(app: App, connection: str, total: int, matching: int) -> None:
    async def one(i: int) -> None:
        hot = i % (total // matching) == 0 and i // (total // matching) < matching
        cfg = Workspace(
            repository=REPO,
            branch="master",
            directory=f"stacks/s{i}",
            vcs_connection=connection,
            trigger_paths=["modules/**"] if hot else [],
        )
        await app.create_workspace(ORG, f"ws-{i}", cfg, "bench")

    for start in range(0, total, 50):
        await asyncio.gather(*(one(i) for i in range(start, min(total, start + 50))))


async def main(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        async with EmbeddedNats(root / "nats") as server:
            nc = await server.connect()
            await streams.declare(nc, nc.jetstream())
            app = App(EventStore(nc))
            secrets = SecretStore(nc, KeyRing.generate())
            async with Projector(nc, root / "rm.sqlite") as projector:
                made = await app.create_org(ORG, "bench")
                assert await projector.wait_for(made.seq)
                web_app = build_app(
                    app=app, projector=projector, admin_token=ADMIN, secret_store=secrets
                )
                async with TestClient(TestServer(web_app)) as client:
                    hdrs = {"Authorization": f"Bearer {ADMIN}"}
                    body = {"name": "gh", "provider": "github", "webhook_secret": SECRET}
                    r = await client.post(
                        f"/api/v1/orgs/{ORG}/vcs-connections", json=body, headers=hdrs
                    )
                    assert r.status == 201, await r.text()
                    conn = (await r.json())["id"]
                    t = time.perf_counter()
                    await workspaces(app, conn, args.workspaces, args.matching)
                    fill_s = time.perf_counter() - t
                    assert await projector.wait_for(await app.store.last_seq(), timeout=60)
                    repo = repository(root)
                    result = await deliveries(client, nc, conn, args, server.pid, repo)
            await nc.close()
    return {
        "workspaces": args.workspaces,
        "matching": args.matching,
        "deliveries": args.n,
        "fill_s": round(fill_s, 1),
        **result,
    }


def cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system) a process has used, from /proc (0 if unknown)."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def deliveries(
    client: TestClient[Any, Any],
    nc: Any,
    conn: str,
    args: argparse.Namespace,
    nats_pid: int | None,
    repo: Path,
) -> dict[str, Any]:
    created: dict[str, float] = {}

    async def seen(msg: Any) -> None:
        if (msg.headers or {}).get("Rp-Type") == "run.created":
            created[msg.subject.rsplit(".", 1)[1]] = time.perf_counter()

    sub = await nc.subscribe(f"rp.run.{ORG}.>", cb=seen)
    to_run: list[float] = []
    answers: list[float] = []
    for n in range(args.n + 2):  # the first two warm up
        raw = payload(n + 1, pushed(repo, n + 1))  # the commit made before its clock starts
        hdrs = {
            "X-GitHub-Event": "push",
            "X-GitHub-Delivery": str(uuid.uuid4()),
            "X-Hub-Signature-256": signing.github_signature(SECRET, raw),
            "Content-Type": "application/json",
        }
        if n == 2:
            cpu0, nats0 = time.process_time(), cpu_s(nats_pid)
        start = time.perf_counter()
        r = await client.post(f"/api/v1/vcs/{conn}/webhook", data=raw, headers=hdrs)
        body = await r.json()
        answered = time.perf_counter()
        assert r.status == 200 and len(body["runs"]) == args.matching, (r.status, body)
        ids = [x["run_id"] for x in body["runs"]]
        for _ in range(1000):
            if all(i in created for i in ids):
                break
            await asyncio.sleep(0.001)
        if n >= 2:
            answers.append((answered - start) * 1000)
            to_run += [(created[i] - start) * 1000 for i in ids]
    cpu, nats_cpu = time.process_time() - cpu0, cpu_s(nats_pid) - nats0
    await sub.unsubscribe()
    return {
        "cpu_ms_per_delivery": {
            "this_process": round(cpu * 1000 / args.n, 1),  # api, projector, client
            "nats_server": round(nats_cpu * 1000 / args.n, 1),
        },
        "runs": len(to_run),
        "to_run_created": {
            "p50_ms": round(statistics.median(to_run), 2),
            "p99_ms": percentile(to_run, 0.99),
            "max_ms": round(max(to_run), 2),
        },
        "response": {
            "p50_ms": round(statistics.median(answers), 2),
            "p99_ms": percentile(answers, 0.99),
        },
        "target_p99_ms": 100,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--workspaces", type=int, default=1000)
    parser.add_argument("--matching", type=int, default=50)
    parser.add_argument("-n", type=int, default=40)
    print(json.dumps(asyncio.run(main(parser.parse_args()))))
    sys.exit(0)
