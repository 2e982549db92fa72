"""Chaos harness: nats-server, `runplane api`, `scheduler` and `executor` as separate
processes that a test kills with SIGKILL and restarts, a driver that pushes apply runs
through the HTTP API, and the checks that run afterwards.

Used by tests/reliability/test_chaos.py. Everything is real: nats-server (its own process
on a fixed port, restarted on the same data directory), Terraform 1.0.3 with the null
provider (offline), git repositories on disk.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import nats

from projections.readmodel import ReadModel
from services.infra.eventstore import EventStore
from services.infra.natsserver import _die_with_parent, server_binary
from tests.procs import Proc, descendants, free_port
from tests.test_executor import commit, git

ORG = "chaos"
TOKEN = "chaos-admin-token"
TERMINAL = {"applied", "planned", "no_changes", "drifted", "discarded", "failed", "canceled"}
OPEN = ["pending", "queued", "planning", "running", "awaiting_approval", "apply_queued", "applying"]

# Every apply replaces the resource (timestamp() is unknown at plan time), and its
# provisioner appends Terraform's working directory, `<work>/jobs/<run>-apply-XXXX/...`,
# to a file outside that directory: Terraform's own record of which run applied. The
# sleep widens the window between the provisioner and the state write.
CHAOS_TF = """
variable "marker" {}
resource "null_resource" "chaos" {
  triggers = { at = timestamp() }
  provisioner "local-exec" { command = "pwd >> ${var.marker}; sleep 1" }
}
"""
_RUN_IN_PATH = re.compile(r"/jobs/([0-9A-Za-z]+)-apply-")


def now() -> float:
    return time.monotonic()


async def _lifetime(pids: list[int], limit: float = 120) -> float:
    """Seconds until none of `pids` runs any more (zombies count as gone)."""
    t0 = now()
    for _ in range(int(limit * 10)):
        if not any(_running(p) for p in pids):
            break
        await asyncio.sleep(0.1)
    return round(now() - t0, 1)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


# ---------------------------------------------------------------- nats-server


class NatsProc:
    """nats-server with JetStream on a fixed port and data directory, killable with -9
    and restartable on the same store (the same settings as the embedded server)."""

    def __init__(self, data_dir: Path, port: int) -> None:
        self.data_dir = data_dir
        self.port = port
        self.url = f"nats://127.0.0.1:{port}"
        self.log = data_dir / "nats.log"
        self.proc: asyncio.subprocess.Process | None = None

    def _config(self) -> Path:
        store = self.data_dir / "jetstream"
        store.mkdir(parents=True, exist_ok=True)
        conf = self.data_dir / "nats-server.conf"
        conf.write_text(
            f'host: "127.0.0.1"\nport: {self.port}\nmax_payload: 8MB\n'
            f'jetstream {{\n  store_dir: "{store}"\n  sync_interval: 1s\n}}\n'
        )
        return conf

    async def start(self, timeout: float = 60) -> None:
        conf = self._config()
        offset = self.log.stat().st_size if self.log.exists() else 0
        out = open(self.log, "ab")
        self.proc = await asyncio.create_subprocess_exec(
            server_binary(),
            "-c",
            str(conf),
            stdout=out,
            stderr=out,
            start_new_session=True,
            preexec_fn=_die_with_parent,  # no server left behind if the test is killed
        )
        out.close()
        deadline = now() + timeout
        while now() < deadline:
            if self.proc.returncode is not None:
                raise RuntimeError(f"nats-server exited: {self.tail(offset)}")
            text = self.log.read_bytes()[offset:].decode(errors="replace")
            if "Server is ready" in text:
                return
            await asyncio.sleep(0.05)
        raise RuntimeError(f"nats-server not ready in {timeout}s: {self.tail(offset)}")

    def tail(self, offset: int = 0) -> str:
        return self.log.read_bytes()[offset:].decode(errors="replace")[-2000:]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def kill(self) -> None:
        if self.proc and self.proc.returncode is None:
            self.proc.kill()
        if self.proc:
            await self.proc.wait()

    async def stop(self) -> None:
        if self.proc and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 20)
            except TimeoutError:
                await self.kill()


# ---------------------------------------------------------------- runplane processes


class Component:
    """One `runplane <role>` process with its log; kill -9 and restart keep the same
    arguments, data directory and log file."""

    def __init__(self, role: str, args: list[str], log: Path, ready: str) -> None:
        self.role = role
        self.args = args
        self.log = log
        self.ready_text = ready
        self.proc: Proc | None = None
        self.offset = 0
        self.starts = 0
        self.expected_exit = False

    async def start(self) -> None:
        self.offset = self.log.stat().st_size if self.log.exists() else 0
        self.expected_exit = False
        self.proc = await Proc(self.args, self.log, env={"RUNPLANE_ADMIN_TOKEN": TOKEN}).start()
        self.starts += 1

    def output(self) -> str:
        return self.log.read_bytes()[self.offset :].decode(errors="replace")

    def returncode(self) -> int | None:
        assert self.proc and self.proc.proc
        return self.proc.proc.returncode

    async def ready(self, timeout: float = 60) -> None:
        deadline = now() + timeout
        while now() < deadline:
            if self.returncode() is not None:
                raise RuntimeError(
                    f"{self.role} exited {self.returncode()}: {self.output()[-3000:]}"
                )
            if self.ready_text in self.output():
                return
            await asyncio.sleep(0.05)
        raise RuntimeError(f"{self.role} not ready in {timeout}s: {self.output()[-3000:]}")

    async def kill(self, tree: bool = True) -> list[int]:
        """SIGKILL the process and everything it started (Terraform too: a host lost),
        or the process alone (a crash: its children live on). The children's pids."""
        assert self.proc and self.proc.proc
        self.expected_exit = True
        family = descendants(self.proc.proc.pid)
        for pid in family if tree else family[:1]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        await self.proc.proc.wait()
        return family[1:]

    async def stop(self, timeout: float = 60) -> int:
        assert self.proc and self.proc.proc
        self.expected_exit = True
        try:
            return await self.proc.stop(signal.SIGTERM, timeout)
        except TimeoutError:
            await self.kill()
            return -9


@dataclass
class Fault:
    at: float
    kind: str
    down_s: float
    note: str
    recovered_s: float = 0.0


@dataclass
class Plane:
    """The processes of one deployment on one machine, each separately killable."""

    root: Path
    nats: NatsProc
    api: Component
    scheduler: Component
    executor: Component
    base: str
    faults: list[Fault] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)
    orphans: list[asyncio.Task[float]] = field(default_factory=list)  # their lifetimes

    @classmethod
    async def start(cls, root: Path) -> Plane:
        root.mkdir(parents=True, exist_ok=True)
        nats_proc = NatsProc(root / "nats", free_port())
        (root / "nats").mkdir(exist_ok=True)
        await nats_proc.start()
        port = free_port()
        common = ["--nats-url", nats_proc.url, "--log-format", "json", "--data-dir"]
        api = Component(
            "api",
            ["api", *common, str(root / "api"), "--listen", f"127.0.0.1:{port}"],
            root / "api.log",
            "runplane api listening",
        )
        sched = Component(
            "scheduler",
            ["scheduler", *common, str(root / "sched")],
            root / "sched.log",
            "runplane scheduler running",
        )
        execu = Component(
            "executor",
            ["executor", *common, str(root / "exec")],
            root / "exec.log",
            "runplane executor running",
        )
        plane = cls(root, nats_proc, api, sched, execu, f"http://127.0.0.1:{port}")
        for c in plane.components():
            await c.start()
        for c in plane.components():
            await c.ready()
        return plane

    def components(self) -> list[Component]:
        return [self.api, self.scheduler, self.executor]

    async def check_crashes(self) -> None:
        """A component that exited without being killed crashed: log it, restart it."""
        if not self.nats.alive():
            return
        for c in self.components():
            if c.proc and c.returncode() is not None and not c.expected_exit:
                what = f"{c.role} exited {c.returncode()} on its own: {c.output()[-1500:]}"
                self.crashes.append(what)
                print("CRASH", what, flush=True)
                await c.start()
                await c.ready()

    async def inject(self, kind: str, down_s: float, note: str, tree: bool = True) -> Fault:
        """kill -9 one process, leave it down `down_s` seconds, restart it, wait ready.
        `tree=False` kills the process alone: what it started (Terraform) lives on, and
        how long is measured (`orphans`)."""
        fault = Fault(at=now(), kind=kind, down_s=down_s, note=note)
        t0 = now()
        if kind == "nats":
            await self.nats.kill()
            await asyncio.sleep(down_s)
            await self.nats.start()
        else:
            comp = {"api": self.api, "scheduler": self.scheduler, "executor": self.executor}[kind]
            left = await comp.kill(tree)
            if not tree:
                fault.note += "; the process alone"
                self.orphans.append(asyncio.create_task(_lifetime(left)))
            await asyncio.sleep(down_s)
            await comp.start()
            await comp.ready()
        fault.recovered_s = round(now() - t0, 2)
        self.faults.append(fault)
        return fault

    async def shutdown(self) -> None:
        for c in self.components():
            if c.proc and c.returncode() is None:
                await c.stop()
        await self.nats.stop()

    async def kill_all(self) -> None:
        for c in self.components():
            if c.proc and c.proc.proc and c.returncode() is None:
                await c.kill()
        await self.nats.kill()
        for pid in self.strays():  # what killed executors left running (see `strays`)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def strays(self) -> list[int]:
        """Running processes (zombies aside) whose working directory is in this plane's
        tree: with every component stopped, what a killed executor's Terraform left."""
        root = str(self.root.resolve())
        found = []
        for entry in Path("/proc").iterdir():
            try:
                cwd = os.readlink(entry / "cwd") if entry.name.isdigit() else ""
            except OSError:
                continue
            if cwd.startswith(root + os.sep) and _running(int(entry.name)):
                found.append(int(entry.name))
        return found


# ---------------------------------------------------------------- the API client


class Api:
    """A forgiving client: the api may be dead at any moment; errors are answers."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.session = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=aiohttp.ClientTimeout(total=15),
        )

    async def close(self) -> None:
        await self.session.close()

    async def call(
        self, method: str, path: str, body: Any = None, min_seq: int = 0
    ) -> tuple[int, Any]:
        """(status, payload); status 0 when no answer came (refused, reset, timeout)."""
        data = None if body is None else json.dumps(body)
        headers = {"RP-Min-Seq": str(min_seq)} if min_seq else None
        try:
            async with self.session.request(
                method, self.base + path, data=data, headers=headers
            ) as resp:
                text = await resp.text()
                try:
                    return resp.status, json.loads(text) if text else None
                except ValueError:
                    return resp.status, text
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as e:
            return 0, repr(e)

    async def ok(
        self, method: str, path: str, body: Any = None, timeout: float = 60, min_seq: int = 0
    ) -> Any:
        """Retry until a 2xx answer (setup only: the call must be idempotent or first)."""
        deadline = now() + timeout
        while True:
            status, payload = await self.call(method, path, body, min_seq)
            if 200 <= status < 300:
                return payload
            if now() > deadline:
                raise AssertionError(f"{method} {path}: {status} {payload}")
            await asyncio.sleep(0.3)

    async def ok_runs(self, status: list[str] | None = None, timeout: float = 60) -> list[Any]:
        deadline = now() + timeout
        while (runs := await self.all_runs(status)) is None:
            if now() > deadline:
                raise AssertionError("the api did not answer")
            await asyncio.sleep(0.3)
        return runs

    async def all_runs(self, status: list[str] | None = None) -> list[dict[str, Any]] | None:
        """Every run of the org (all pages), or None if the api did not answer."""
        out: list[dict[str, Any]] = []
        before = ""
        while True:
            q = "limit=1000" + (f"&status={','.join(status)}" if status else "")
            q += f"&before={before}" if before else ""
            code, page = await self.call("GET", f"/api/v1/orgs/{ORG}/runs?{q}")
            if code != 200:
                return None
            out += page["items"]
            if not page.get("next"):
                return out
            before = page["next"]


# ---------------------------------------------------------------- the workload


@dataclass
class Workload:
    api: Api
    workspaces: list[str]
    target: int
    rng: random.Random
    max_open: int = 2
    created: list[str] = field(default_factory=list)  # ids answered 2xx
    create_unanswered: int = 0
    create_refused: Counter[str] = field(default_factory=Counter)
    approvals: int = 0
    approve_errors: Counter[str] = field(default_factory=Counter)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    faults_done: asyncio.Event = field(default_factory=asyncio.Event)
    # Set as a create or an approve request leaves: a fault can strike while it is in flight.
    sending: dict[str, asyncio.Event] = field(
        default_factory=lambda: {"create": asyncio.Event(), "approve": asyncio.Event()}
    )

    def _sent(self, kind: str) -> None:
        self.sending[kind].set()
        self.sending[kind] = asyncio.Event()

    async def creator(self) -> None:
        """Create apply runs, at most `max_open` open runs per workspace (as the driver
        last saw them), until `target` got a 2xx and the faults are over."""
        while len(self.created) < self.target or not self.faults_done.is_set():
            runs = await self.api.all_runs(OPEN)
            if runs is None:
                await asyncio.sleep(0.5)
                continue
            open_by_ws = Counter(r["workspace"] for r in runs)
            room = [w for w in self.workspaces if open_by_ws[w] < self.max_open]
            if not room:
                await asyncio.sleep(0.5)
                continue
            ws = self.rng.choice(room)
            self._sent("create")
            code, body = await self.api.call(
                "POST", f"/api/v1/orgs/{ORG}/workspaces/{ws}/runs", {"type": "apply"}
            )
            if 200 <= code < 300:
                self.created.append(body["id"])
            elif code == 0:
                self.create_unanswered += 1
            else:
                self.create_refused[f"{code} {_slug(body)}"] += 1
            await asyncio.sleep(self.rng.uniform(0.1, 0.6))
        self.done.set()

    async def approver(self, stop: asyncio.Event) -> None:
        """Approve whatever awaits approval (runs whose create went unanswered included)."""
        while not stop.is_set():
            runs = await self.api.all_runs(["awaiting_approval"])
            for r in runs or []:
                self._sent("approve")
                code, body = await self.api.call(
                    "POST", f"/api/v1/orgs/{ORG}/runs/{r['id']}/approve", {"acknowledged": []}
                )
                if 200 <= code < 300:
                    self.approvals += 1
                else:
                    self.approve_errors[f"{code} {_slug(body)}"] += 1
            await asyncio.sleep(0.3)


def _slug(body: Any) -> str:
    if isinstance(body, dict):
        return str(body.get("type", "")).rsplit("/", 1)[-1] or str(body)[:80]
    return str(body)[:80]


# ---------------------------------------------------------------- the fault injector


async def inject_faults(
    plane: Plane,
    api: Api,
    work: Workload,
    rng: random.Random,
    plan: list[str],
    gap: tuple[float, float],
    after: Callable[[Fault], Awaitable[None]],
) -> None:
    """Inject the faults of `plan` in order, a random gap apart. Some wait for a moment
    when a run is applying (the window a double apply would need) or planning, some for
    a create or an approve in flight (0-30 ms after the request left); the rest strike
    wherever the runs are. `after` runs once each fault is over."""
    for kind in plan:
        await asyncio.sleep(rng.uniform(*gap))
        targets = ["random", "applying", "planning", "create", "approve"]
        target = rng.choices(targets, weights=[3, 3, 2, 2, 1])[0]
        runs = await api.all_runs(OPEN)
        note = f"open runs {dict(Counter(r['status'] for r in runs or []))}; "
        if target in ("applying", "planning"):
            note += await _wait_for_status(api, target, rng.uniform(0, 1.5), 15)
        elif target in work.sending:
            note += await _wait_for_request(work, target, rng.uniform(0, 0.03), 15)
        else:
            note += "random"
        # Mostly short outages; one in five outlasts the heartbeat timeout (4 s).
        down = round(rng.uniform(0.0, 3.0) if rng.random() < 0.8 else rng.uniform(4.0, 8.0), 2)
        t0 = now()
        tree = kind != "executor" or rng.random() < 0.5
        try:
            fault = await plane.inject(kind, down, note, tree)
        except Exception as e:  # a process that will not come back is a finding
            plane.crashes.append(f"{kind} did not come back: {e!r}")
            print("RESTART FAILED", kind, repr(e), flush=True)
            raise
        print(
            f"fault #{len(plane.faults)} kill -9 {kind:9s} ({note}), down {down}s, "
            f"back after {fault.recovered_s}s (t={t0:.1f})",
            flush=True,
        )
        await plane.check_crashes()
        await after(fault)


async def _wait_for_request(work: Workload, kind: str, extra: float, timeout: float) -> str:
    try:
        await asyncio.wait_for(work.sending[kind].wait(), timeout)
    except TimeoutError:
        return f"no {kind} request within {timeout}s"
    await asyncio.sleep(extra)
    return f"{extra * 1000:.0f} ms after a {kind} request left"


async def _wait_for_status(api: Api, status: str, extra: float, timeout: float) -> str:
    deadline = now() + timeout
    while now() < deadline:
        runs = await api.all_runs([status])
        if runs:
            await asyncio.sleep(extra)
            return f"while {runs[0]['id']} {status}"
        await asyncio.sleep(0.2)
    return f"no run {status} within {timeout}s"


async def _sleep_or(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        pass


async def watch_crashes(plane: Plane, stop: asyncio.Event) -> None:
    while not stop.is_set():
        await plane.check_crashes()
        await _sleep_or(stop, 0.5)


# ---------------------------------------------------------------- setup


def make_repo(path: Path) -> Path:
    path.mkdir(parents=True)
    git(path, "init", "-q", "-b", "main")
    commit(path, CHAOS_TF)
    return path


async def setup_org(api: Api, root: Path, workspaces: list[str], settings: dict[str, Any]) -> Path:
    """The organization, its limits, and workspaces sharing one repository; the marker
    file (Terraform's record of applies) is returned."""
    repo = make_repo(root / "repo")
    marker = root / "applies.txt"
    await api.ok("POST", "/api/v1/orgs", {"name": ORG})
    await api.ok("PATCH", f"/api/v1/orgs/{ORG}/settings", settings)
    for ws in workspaces:
        await api.ok(
            "POST",
            f"/api/v1/orgs/{ORG}/workspaces",
            {"name": ws, "repository": str(repo), "variables": {"marker": str(marker)}},
        )
    return marker


# ---------------------------------------------------------------- the checks


def applies_from_terraform(marker: Path) -> Counter[str]:
    """Runs whose apply ran the provisioner, counted from Terraform's own output."""
    found: Counter[str] = Counter()
    if marker.exists():
        for line in marker.read_text().splitlines():
            m = _RUN_IN_PATH.search(line)
            assert m, f"unexpected marker line {line!r}"
            found[m.group(1)] += 1
    return found


@dataclass
class StreamView:
    runs: dict[str, str]  # run id -> workspace
    types: dict[str, list[str]]  # run id -> event types in order
    state_versions: Counter[str]  # run id -> run.state_version events
    last_seq: int


async def read_stream(url: str) -> StreamView:
    nc = await nats.connect(url)
    try:
        store = EventStore(nc)
        envs = await store.read(f"rp.run.{ORG}.>")
        info = await nc.jetstream().stream_info("RP_EVENTS")
    finally:
        await nc.close()
    runs: dict[str, str] = {}
    types: dict[str, list[str]] = defaultdict(list)
    versions: Counter[str] = Counter()
    for env in envs:
        _, _, _, ws, run_id = env.subject.split(".")
        tag = type(env.event).__struct_config__.tag
        types[run_id].append(str(tag))
        if tag == "run.created":
            runs[run_id] = ws
        if tag == "run.state_version":
            versions[run_id] += 1
    return StreamView(runs, dict(types), versions, int(info.state.last_seq))


async def dump(path: Path) -> dict[str, list[tuple[object, ...]]]:
    async with await ReadModel.open(path) as rm:
        return await rm.dump()


def diff_dumps(live: dict[str, Any], replayed: dict[str, Any]) -> list[str]:
    out = []
    for table in sorted(set(live) | set(replayed)):
        a, b = live.get(table, []), replayed.get(table, [])
        if a != b:
            only_live = [r for r in a if r not in b][:3]
            only_replay = [r for r in b if r not in a][:3]
            out.append(
                f"{table}: live {len(a)} rows, replay {len(b)}; live only {only_live}; "
                f"replay only {only_replay}"
            )
    return out
