"""runplane's side of the benchmarks: each starts its own nats-server and measures one
thing the issue names (append, replay, admission, reads; create-to-queued latency is
bench/latency.py)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import math
import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from events.run import Workspace
from infra import streams
from infra.eventstore import EventStore
from projections.replay import replay
from services.app.commands import App
from services.app.openruns import Limits, OpenRuns

from . import history, raw
from .common import (
    PY,
    ROOT,
    Firehose,
    Sizes,
    child_env,
    connected,
    cpu_seconds,
    last_seq,
    nats_env,
    private_server,
    rss_kb,
    stop_process,
)
from .history import ORG, run_id_for, ws_name


def make_repo(where: Path) -> Path:
    """A local git repository with one commit on `main`: what the scheduler's admission
    snapshot resolves with `git ls-remote`."""
    repo = where / "repo"
    repo.mkdir(parents=True)
    git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@example.com"]
    subprocess.run([*git, "init", "-q", "-b", "main", str(repo)], check=True)
    (repo / "main.tf").write_text('resource "null_resource" "a" {}\n')
    subprocess.run([*git, "-C", str(repo), "add", "."], check=True)
    subprocess.run([*git, "-C", str(repo), "commit", "-q", "-m", "init"], check=True)
    return repo


def new_key() -> str:
    return base64.b64encode(os.urandom(32)).decode()


async def gather_limited(n: int, limit: int, make: Any) -> list[Any]:
    sem = asyncio.Semaphore(limit)

    async def one(i: int) -> Any:
        async with sem:
            return await make(i)

    return list(await asyncio.gather(*(one(i) for i in range(n))))


class Watch:
    """Note when events of one type appear on run subjects (core subscription: a
    subscriber sees a message as the stream stores it)."""

    def __init__(self, nc: NATS, rp_type: str) -> None:
        self.nc = nc
        self.rp_type = rp_type
        self.seen: dict[str, float] = {}
        self._sub: Any = None
        self.changed = asyncio.Event()

    async def __aenter__(self) -> Watch:
        async def on_msg(msg: Msg) -> None:
            if msg.headers and msg.headers.get("Rp-Type") == self.rp_type:
                self.seen.setdefault(msg.subject.rsplit(".", 1)[1], time.perf_counter())
                self.changed.set()

        self._sub = await self.nc.subscribe("rp.run.>", cb=on_msg)
        await self.nc.flush()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._sub.unsubscribe()

    async def until(self, count: int, keys: set[str] | None, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            have = len(self.seen) if keys is None else len(keys & self.seen.keys())
            if have >= count:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), min(left, 1.0))
            except TimeoutError:
                pass


_profiled = itertools.count()
PROFILED: dict[int, str] = {}  # pid -> its bench/profiled.py output, without suffix


def profiled(command: str) -> tuple[str, str] | None:
    """(the output's path without suffix, `count` or `cprofile`) if `command`'s process
    runs under bench/profiled.py (`RP_BENCH_PROFILE`), else None."""
    mode = os.environ.get("RP_BENCH_PROFILE", "")
    if mode not in ("count", "cprofile"):
        return None
    if command not in os.environ.get("RP_BENCH_PROFILE_OF", "executor").split(","):
        return None
    where = Path(os.environ.get("RP_BENCH_PROFILE_DIR", "") or tempfile.gettempdir())
    where.mkdir(parents=True, exist_ok=True)
    return str(where / f"{command}-{os.getpid()}-{next(_profiled)}"), mode


async def profile_window(pids: list[int], outs: list[str], runs: int) -> dict[str, Any]:
    """End the window of processes under bench/profiled.py (SIGUSR2) and sum what they
    counted: messages per run by kind, sent and received, and their CPU per run."""
    for pid in pids:
        os.kill(pid, signal.SIGUSR2)
    sent: dict[str, float] = {}
    received: dict[str, float] = {}
    cpu = user = system = 0.0
    gc_s = [0.0, 0.0, 0.0]
    gc_n = [0, 0, 0]
    for out in outs:
        path = Path(out + ".json")
        for _ in range(100):
            if path.exists():
                break
            await asyncio.sleep(0.05)
        body = json.loads(path.read_text())
        path.unlink()
        cpu += body["cpu_s"]
        user += body["user_s"]
        system += body["system_s"]
        for g in range(3):
            gc_s[g] += body["gc_s"][g]
            gc_n[g] += body["gc_collections"][g]
        for mine, theirs in ((sent, body["sent"]), (received, body["received"])):
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0.0) + v / runs
    return {
        "sent_per_run": dict(sorted(sent.items(), key=lambda kv: -kv[1])),
        "received_per_run": dict(sorted(received.items(), key=lambda kv: -kv[1])),
        "sent_total_per_run": sum(sent.values()),
        "received_total_per_run": sum(received.values()),
        "cpu_ms_per_run": cpu * 1000 / runs,
        "user_ms_per_run": user * 1000 / runs,
        "system_ms_per_run": system * 1000 / runs,
        "gc_ms_per_run_by_generation": [t * 1000 / runs for t in gc_s],
        "gc_collections": gc_n,
        "profiles": [o + ".prof" for o in outs if Path(o + ".prof").exists()],
    }


@asynccontextmanager
async def runplane_process(
    command: str, url: str, data_dir: Path, ready: str, env: dict[str, str], *extra: str
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    """`python -m services.root.cli <command>` against our server, until it prints `ready`.

    `RP_BENCH_TREE`: the runplane tree the process runs (default this one: a paired
    benchmark runs the tree before under the same harness). `RP_BENCH_PROFILE`
    (`count` or `cprofile`) with `RP_BENCH_PROFILE_OF` (default `executor`): such
    processes run under bench/profiled.py, their output in `RP_BENCH_PROFILE_DIR`."""
    tree = os.environ.get("RP_BENCH_TREE", "") or str(ROOT)
    argv = [PY, "-m", "services.root.cli"]
    how = profiled(command)
    if how is not None:
        argv = [PY, str(ROOT / "bench" / "profiled.py"), how[0], how[1], "services.root.cli"]
    proc = await asyncio.create_subprocess_exec(
        *argv,
        command,
        "--nats-url",
        url,
        "--data-dir",
        str(data_dir),
        "--log-format",
        "json",
        *extra,
        env=child_env(**nats_env(url), **env, PYTHONPATH=tree),
        cwd=tree,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    if how is not None:
        PROFILED[proc.pid] = how[0]
    try:
        line = ""
        async with asyncio.timeout(60):
            while ready not in line:
                raw_line = await proc.stdout.readline()
                if not raw_line:
                    raise RuntimeError(f"runplane {command} exited before it was ready")
                line = raw_line.decode()
        yield proc, line.strip()
    finally:
        await stop_process(proc)


# ---------------------------------------------------------------- raw limits


async def raw_limits(sizes: Sizes) -> dict[str, Any]:
    async with private_server("raw") as server, connected(server.url) as nc:
        sync = await raw.sync_publish(nc, sizes.sync_msgs)
        pipe = await raw.pipelined_publish(nc, sizes.pipe_subjects, sizes.pipe_msgs)
        batches: dict[str, Any]
        try:
            batches = await raw.pipelined_batches(nc, sizes.pipe_subjects, sizes.pipe_msgs // 50)
        except nats.errors.TimeoutError as e:
            # A reference only (no ratio uses it): on a loaded machine a batch's ack can
            # take longer than its 10 s, which must not cost every benchmark of the run.
            batches = {"error": f"timed out: {e}"}
    return {"sync_publish": sync, "pipelined_publish": pipe, "pipelined_atomic_batches": batches}


# ---------------------------------------------------------------- 1. append


async def append(sizes: Sizes) -> dict[str, Any]:
    """Whole runs through the App (load, decide, append with the expected sequence), one
    workspace per concurrent writer so the runs proceed in parallel."""
    c = sizes.append_concurrency
    per = max(1, math.ceil(sizes.append_runs / c))
    async with private_server("append") as server, connected(server.url) as nc:
        app = App(EventStore(nc))
        await app.create_org(ORG, "admin")
        config = Workspace(repository="/repo", variables={"region": "eu-west-1"})
        await gather_limited(
            c, 100, lambda i: app.create_workspace(ORG, ws_name(i), config, "alice")
        )
        first = await last_seq(nc)

        async def writer(i: int) -> None:
            for _ in range(per):
                await history.full_run(app, ORG, ws_name(i))

        start = time.perf_counter()
        await asyncio.gather(*(writer(i) for i in range(c)))
        elapsed = time.perf_counter() - start
        events = await last_seq(nc) - first
    runs = per * c
    commands = runs * 17  # create, admit, 2 x (claim + 3 x start/finish), finish plan/apply
    return {
        "runs": runs,
        "concurrency": c,
        "events": events,
        "seconds": elapsed,
        "events_per_s": events / elapsed,
        "commands_per_s": commands / elapsed,
    }


# ---------------------------------------------------------------- 2. replay


async def rebuild(sizes: Sizes) -> dict[str, Any]:
    """Fill a stream with valid whole-run histories, then read it raw and rebuild the
    SQLite read model from it with `projections.replay.replay` (what `runplane replay`
    runs)."""
    async with private_server("replay") as server, connected(server.url) as nc:
        tpl = await history.capture(nc)
        t = time.perf_counter()
        published, runs = await history.publish_history(
            nc, tpl, events=sizes.replay_events, workspaces=1000
        )
        gen_s = time.perf_counter() - t
        total = await last_seq(nc)
        raw_push = await raw.push_replay(nc, total)
        raw_ordered = await raw.ordered_replay(nc, total)
        with tempfile.TemporaryDirectory(prefix="rpbench-rm-") as tmp:
            t = time.perf_counter()
            applied = await replay(nc, Path(tmp) / "readmodel.sqlite")
            elapsed = time.perf_counter() - t
            size = (Path(tmp) / "readmodel.sqlite").stat().st_size
    return {
        "events_in_stream": total,
        "runs": runs,
        "generated_per_s": published / gen_s,
        "raw_push_replay": raw_push,
        "raw_nats_py_ordered_replay": raw_ordered,
        "applied": applied,
        "seconds": elapsed,
        "events_per_s": applied / elapsed,
        "sqlite_bytes": size,
    }


def counted_app(nc: NATS) -> App:
    """An App whose creates reserve their runs in the open-runs ledger, as every
    process that starts runs does (services/root/bootstrap.py), with limits the
    benchmark's runs stay under."""
    app = App(EventStore(nc))
    app.open_runs = OpenRuns(nc.jetstream(), Limits(org=5_000, workspace=100), app.run_is_open)
    return app


# ---------------------------------------------------------------- 5. admission


_PENDING = frozenset({"run.created", "ws.run_enqueued"})


async def scheduler_idle(nc: NATS, timeout: float = 600) -> None:
    """Wait until the scheduler's consumer has nothing pending or unacknowledged."""
    js = nc.jetstream()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            info = await js.consumer_info(streams.EVENTS, streams.SCHEDULER_CONSUMER)
        except nats.js.errors.NotFoundError:
            info = None
        if info is not None and info.num_pending == 0 and info.num_ack_pending == 0:
            return
        await asyncio.sleep(0.02)
    raise TimeoutError("the scheduler never caught up")


async def admission_at(workspaces: int) -> dict[str, Any]:
    """`workspaces` locked workspaces, each with one pending run; the scheduler (its own
    process) reads that backlog, then every workspace is unlocked at once: runs admitted
    per second, from the first unlock to the last `run.queued`. The scheduler's resident
    memory is read from /proc/<pid>/status once it is done."""
    with tempfile.TemporaryDirectory(prefix="rpbench-adm-") as tmp:
        repo = make_repo(Path(tmp))
        async with private_server("admission") as server, connected(server.url) as nc:
            tpl = await history.capture(nc, repository=str(repo))
            runs = {run_id_for(j) for j in range(workspaces)}
            async with Firehose(nc) as hose:
                for j in range(workspaces):
                    ws = ws_name(j)
                    msgs = tpl.workspace_msgs(ws) + tpl.lock_msgs(ws)
                    for subject, data, hdrs in msgs + tpl.run_msgs(ws, run_id_for(j), _PENDING):
                        await hose.put(subject, data, hdrs)
            env = {"RUNPLANE_ENCRYPTION_KEY": new_key()}
            async with (
                Watch(nc, "run.queued") as watch,
                runplane_process(
                    "scheduler", server.url, Path(tmp) / "sched", "scheduler running", env
                ) as (proc, _),
            ):
                t = time.perf_counter()
                await scheduler_idle(nc)
                backlog_s = time.perf_counter() - t
                idle_rss, _ = rss_kb(proc.pid)
                server_pid = server.pid or proc.pid
                cpu0 = cpu_seconds(proc.pid), cpu_seconds(server_pid)
                t_start = time.perf_counter()
                async with Firehose(nc) as hose:
                    for j in range(workspaces):
                        for subject, data, hdrs in tpl.unlock_msgs(ws_name(j)):
                            await hose.put(subject, data, hdrs)
                unlock_s = time.perf_counter() - t_start
                ok = await watch.until(workspaces, runs, timeout=900)
                await scheduler_idle(nc)  # its dispatches and deadline markers too
                t_idle = time.perf_counter()
                cpu1 = cpu_seconds(proc.pid), cpu_seconds(server_pid)
                rss, hwm = rss_kb(proc.pid)
            times = sorted(watch.seen[r] for r in runs if r in watch.seen)
    span = (times[-1] - t_start) if times else 0.0
    settled = t_idle - t_start
    return {
        "workspaces": workspaces,
        "admitted": len(times),
        "all_admitted": ok,
        # Headline: every admission and all it causes (dispatch, deadline and dispatch
        # markers) done, the scheduler's consumer empty again. The rate to the last
        # `run.queued` alone flatters small counts, whose dispatches all come after it.
        "admitted_per_s": len(times) / settled if settled > 0 else 0.0,
        "queued_per_s": len(times) / span if span > 0 else 0.0,
        "seconds_unlock_to_last_queued": span,
        "seconds_publishing_unlocks": unlock_s,
        "seconds_until_idle": t_idle - t_start,
        "backlog_seconds": backlog_s,
        "scheduler_cpu_ms_per_run": (cpu1[0] - cpu0[0]) * 1000 / workspaces,
        "server_cpu_ms_per_run": (cpu1[1] - cpu0[1]) * 1000 / workspaces,
        "rss_mb_idle_before": idle_rss / 1024,
        "rss_mb": rss / 1024,
        "peak_rss_mb": hwm / 1024,
        "rss_measured": "VmRSS/VmHWM of the `runplane scheduler` process",
    }


async def admission(sizes: Sizes) -> dict[str, Any]:
    out = {}
    for n in sizes.admission_counts:
        out[str(n)] = await admission_at(n)
    return {"by_workspaces": out}


# ---------------------------------------------------------------- 6. reads


async def reads(sizes: Sizes) -> dict[str, Any]:
    """`GET /api/v1/orgs/{org}/runs/{run}` against a read model of `read_runs` runs (one in
    ten a whole run with steps, the rest pending), the API in its own process and the load
    from another (`bench/loadgen.py`)."""
    full = max(1, sizes.read_runs // 10)
    with tempfile.TemporaryDirectory(prefix="rpbench-read-") as tmp:
        data = Path(tmp) / "api"
        data.mkdir()
        async with private_server("reads") as server, connected(server.url) as nc:
            tpl = await history.capture(nc)
            wss = 1000
            async with Firehose(nc) as hose:
                for j in range(wss):
                    for subject, body, hdrs in tpl.workspace_msgs(ws_name(j)):
                        await hose.put(subject, body, hdrs)
                for k in range(sizes.read_runs):
                    types = None if k < full else _PENDING
                    msgs = tpl.run_msgs(ws_name(k % wss), run_id_for(k), types)
                    for subject, body, hdrs in msgs:
                        await hose.put(subject, body, hdrs)
            events = await last_seq(nc)
            t = time.perf_counter()
            await replay(nc, data / "readmodel.sqlite")
            fill_s = time.perf_counter() - t
            token = "rp_admin_bench_" + base64.b32encode(os.urandom(10)).decode().lower()
            env = {"RUNPLANE_ENCRYPTION_KEY": new_key(), "RUNPLANE_ADMIN_TOKEN": token}
            runs_file = Path(tmp) / "runs.txt"
            runs_file.write_text("\n".join(run_id_for(k) for k in range(sizes.read_runs)))
            async with runplane_process(
                "api", server.url, data, "listening at", env, "--listen", "127.0.0.1:0"
            ) as (api, line):
                m = re.search(r"(http://\S+)", line)
                assert m, line
                token = await _reads_token(m.group(1), token)
                api_cpu = cpu_seconds(api.pid)
                proc = await asyncio.create_subprocess_exec(
                    PY,
                    "-m",
                    "bench.loadgen",
                    "--url",
                    m.group(1),
                    "--token",
                    token,
                    "--org",
                    ORG,
                    "--runs",
                    str(runs_file),
                    "--seconds",
                    str(sizes.read_seconds),
                    "--warmup",
                    str(min(1.0, sizes.read_seconds)),
                    "--concurrency",
                    str(sizes.read_concurrency),
                    env=child_env(),
                    stdout=asyncio.subprocess.PIPE,
                )
                out, _ = await proc.communicate()
                api_cpu = cpu_seconds(api.pid) - api_cpu
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    # The api process's CPU (utime + stime, /proc) per request, warm-up included: the
    # figure the machine's load moves least.
    served = result["requests"] + result.get("warmup_requests", 0)
    result["api_cpu_ms_per_request"] = api_cpu * 1000 / served if served else None
    result.update({"runs": sizes.read_runs, "events": events, "fill_seconds": fill_s})
    return result


async def _reads_token(url: str, admin: str) -> str:
    """The token the reads load uses: `RP_BENCH_READS_AS` "admin" (the default: the
    deployment's admin token, which reads no organization), "viewer" (an organization
    token: the leader's sequence and the organization's access on every request), or
    "member" (a person's token whose team holds read on every workspace one by one: the
    access check's worst case, a run's workspace looked up per request)."""
    import aiohttp

    who = os.environ.get("RP_BENCH_READS_AS", "admin")
    if who == "admin":
        return admin
    base, auth = f"{url}/api/v1/orgs/{ORG}", {"Authorization": f"Bearer {admin}"}
    async with aiohttp.ClientSession(headers=auth) as http:
        if who == "viewer":
            async with http.post(f"{base}/tokens", json={"user": "bench", "role": "viewer"}) as r:
                return str((await r.json())["token"])
        async with http.post(f"{base}/users", json={"email": "bench@example.com"}) as r:
            user_id = (await r.json())["id"]
        await http.post(f"{base}/teams", json={"name": "readers"})
        await http.put(f"{base}/teams/readers/members", json={"members": [user_id]})
        for j in range(1000):
            grant = {"team": "readers", "level": "read"}
            await http.put(f"{base}/workspaces/{ws_name(j)}/access", json=grant)
        async with http.post(f"{base}/tokens", json={"kind": "user", "user_id": user_id}) as r:
            return str((await r.json())["token"])


# ---------------------------------------------------------------- 3. lifecycle


class NotRun(Exception):
    """A benchmark that cannot run here; the message says why."""


TEMPLATE = "noop"
_TERMINAL_RELEASE = "ws.run_released"


def _template_api() -> tuple[Any, Any]:
    """`SaveTemplate` and `TemplateStep`, or NotRun while templates do not exist."""
    try:
        from events import templates
    except ImportError as e:
        raise NotRun("templates missing (no events/templates.py)") from e
    save = getattr(templates, "SaveTemplate", None)
    step = getattr(templates, "TemplateStep", None)
    if save is None or step is None:
        raise NotRun("templates missing (no SaveTemplate / TemplateStep)")
    return save, step


async def lifecycle(sizes: Sizes) -> dict[str, Any]:
    """Runs of a template whose only step is the custom command `true`, one per workspace
    over `lifecycle_workspaces` workspaces, all created at once; the scheduler and
    `lifecycle_executors` executors in their own processes (`runplane scheduler`,
    `runplane executor`). Events per second from the first create to the last run's
    release (every event the stream got meanwhile: the runs', the workspaces')."""
    save_template, template_step = _template_api()
    n = sizes.lifecycle_workspaces
    with tempfile.TemporaryDirectory(prefix="rpbench-life-") as tmp:
        repo = make_repo(Path(tmp))
        async with private_server("lifecycle") as server, connected(server.url) as nc:
            app = counted_app(nc)
            await app.create_org(ORG, "admin")
            step = template_step(number=100, kind="custom", name="noop", command="true")
            await app.org_command(ORG, save_template(actor="admin", name=TEMPLATE, steps=[step]))
            config = Workspace(repository=str(repo))
            await gather_limited(
                n, 50, lambda i: app.create_workspace(ORG, ws_name(i), config, "alice")
            )
            released: dict[str, tuple[float, str]] = {}
            changed = asyncio.Event()

            async def on_release(msg: Msg) -> None:
                if msg.headers and msg.headers.get("Rp-Type") == _TERMINAL_RELEASE:
                    body = json.loads(msg.data)
                    released[body["run_id"]] = (time.perf_counter(), body.get("status", ""))
                    changed.set()

            sub = await nc.subscribe("rp.ws.>", cb=on_release)
            env = {"RUNPLANE_ENCRYPTION_KEY": new_key()}
            # child_env leaves the caller's RUNPLANE_* out: the executors' isolation is
            # the one setting the benchmark passes on (RUNPLANE_ISOLATION=sandbox ...)
            isolation = os.environ.get("RUNPLANE_ISOLATION", "auto")
            executor_env = {**env, "RUNPLANE_ISOLATION": isolation}
            async with AsyncExitStack() as stack:
                sched, _ = await stack.enter_async_context(
                    runplane_process(
                        "scheduler", server.url, Path(tmp) / "sched", "scheduler running", env
                    )
                )
                executors = []
                watched = profiled("executor") is not None
                for k in range(sizes.lifecycle_executors):
                    proc, _ = await stack.enter_async_context(
                        runplane_process(
                            "executor",
                            server.url,
                            Path(tmp) / f"ex{k}",
                            "executor running",
                            executor_env,
                        )
                    )
                    executors.append(proc.pid)
                # CPU by component: who spends the two cores (children: git, sh, ...).
                pids = {"scheduler": [sched.pid], "executors": executors, "nats-server": []}
                if server.pid:
                    pids["nats-server"] = [server.pid]
                pids["bench (creates, watch)"] = [os.getpid()]

                def cpu() -> dict[str, float]:
                    return {k: sum(cpu_seconds(p) for p in v) for k, v in pids.items()}

                def children() -> float:  # git, the step's shell, what isolation starts
                    return sum(cpu_seconds(p, children_only=True) for p in executors)

                first = await last_seq(nc)
                outs = [PROFILED[pid] for pid in executors if pid in PROFILED]
                if watched:  # bench/profiled.py: the window opens (counters, profiler)
                    for pid in executors:
                        os.kill(pid, signal.SIGUSR1)
                cpu0, kids0 = cpu(), children()
                t0 = time.perf_counter()
                created = await gather_limited(
                    n,
                    100,
                    lambda i: app.create_run(ORG, ws_name(i), "apply", "alice", template=TEMPLATE),
                )
                create_s = time.perf_counter() - t0
                runs = {str(r.state.run_id) for r in created}
                deadline = time.monotonic() + max(120.0, n * 0.5)
                while len(runs & released.keys()) < n and time.monotonic() < deadline:
                    changed.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(changed.wait(), 1.0)
                t_end = max((released[r][0] for r in runs if r in released), default=t0)
                cpu1, kids1 = cpu(), children()
                window = await profile_window(executors, outs, n) if watched else None
                await asyncio.sleep(0.5)
                events = await last_seq(nc) - first
            await sub.unsubscribe()
    done = [released[r] for r in runs if r in released]
    statuses: dict[str, int] = {}
    for _, status in done:
        statuses[status] = statuses.get(status, 0) + 1
    span = t_end - t0
    return {
        "workspaces": n,
        "runs": n,
        "executors": sizes.lifecycle_executors,
        "isolation": isolation,
        "terminal": len(done),
        "all_terminal": len(done) == n,
        "statuses": statuses,
        "events": events,
        "events_per_run": events / n,
        "seconds": span,
        "create_seconds": create_s,
        "events_per_s": events / span if span > 0 else 0.0,
        "runs_per_s": len(done) / span if span > 0 else 0.0,
        "cpu_ms_per_run": {k: (cpu1[k] - cpu0[k]) * 1000 / n for k in cpu0},
        "executor_children_cpu_ms_per_run": (kids1 - kids0) * 1000 / n,
        **({"executor_messages": window} if window is not None else {}),
    }
