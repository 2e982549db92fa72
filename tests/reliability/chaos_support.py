"""Chaos harness: nats-server, `runplane api`, `scheduler` and `executor` as separate
processes that a test kills with SIGKILL and restarts, a driver that pushes apply runs
through the HTTP API, and the checks that run afterwards; on a cluster, the wait for
every stream, bucket and consumer to have its 3 replicas again (`replicated`), and
`runplane subscribers` replicas (`_subscribers`).

Used by tests/reliability/test_chaos.py (one nats-server, one process of each role) and
tests/reliability/test_cluster.py (a 3-node cluster, `ClusterNats`, and several
processes of each role). Everything is real: nats-server (its own processes on fixed
ports, restarted on the same data directory), Terraform 1.0.3 with the null provider
(offline), git repositories on disk.
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
from typing import Any, Protocol

import aiohttp
import nats
import nats.errors
from nats.aio.client import Client as NATS

from infra.eventstore import EventStore
from infra.natsserver import _die_with_parent, server_binary
from infra.streams import EVENTS
from projections.readmodel import ReadModel
from services.root import natsstatus
from tests.cluster_support import NatsCluster, Node
from tests.executor_support import commit, git
from tests.procs import Proc, descendants, free_port

ORG = "chaos"
TOKEN = "chaos-admin-token"
TERMINAL = {"applied", "planned", "no_changes", "drifted", "discarded", "failed", "canceled"}
OPEN = ["pending", "queued", "planning", "running", "awaiting_approval", "apply_queued", "applying"]

# Every apply replaces the resource (timestamp() is unknown at plan time), and its
# provisioner sends Terraform's working directory, `<work>/jobs/<run>-apply-XXXX/...`, to
# the test's `Witness` over loopback TCP: Terraform's own record of which run applied,
# outside runplane. (A file would not do: a sandboxed job writes its own directory only.)
# The sleep widens the window between the provisioner and the state write.
CHAOS_TF = """
variable "witness" {}
resource "null_resource" "chaos" {
  triggers = { at = timestamp() }
  provisioner "local-exec" {
    interpreter = ["/bin/bash", "-c"]
    command     = "pwd > /dev/tcp/127.0.0.1/${var.witness}; sleep 1"
  }
}
"""
# The executors' jobs run as production runs them by default (`auto`: the sandbox as root
# with bubblewrap, else the uid mode), not in the uid mode the rest of the suite pins
# (tests/conftest.py); RUNPLANE_CHAOS_ISOLATION=user runs the fallback instead.
ISOLATION = os.environ.get("RUNPLANE_CHAOS_ISOLATION", "auto")
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

    async def kill_all(self) -> None:
        await self.kill()

    def env(self) -> dict[str, str]:
        """What a runplane process needs besides `--nats-url`: nothing (no auth)."""
        return {}

    async def connect(self) -> NATS:
        return await nats.connect(self.url)


class ClusterNats:
    """A `NatsCluster` as a plane's nats side: a `nats` fault (`kill`) kills -9 the node
    that leads `RP_EVENTS` at that moment, `start` brings that node back on its store and
    waits until every node is routed to every other again. Clients get every node's URL
    (`url`) and the cluster's credentials (`env`)."""

    def __init__(self, cluster: NatsCluster) -> None:
        self.cluster = cluster
        self.url = cluster.url
        self.down: Node | None = None
        self.killed: list[str] = []  # the names of the nodes killed, in order

    async def start(self) -> None:
        """The cluster the first time; afterwards the node that was killed."""
        if not any(n.alive() for n in self.cluster.nodes) and self.down is None:
            await self.cluster.__aenter__()
            return
        if self.down is not None:
            await self.down.start()
            self.down = None
        await self.cluster.wait_ready()

    async def kill(self) -> None:
        self.down = await self.cluster.stream_leader(EVENTS)
        self.killed.append(self.down.name)
        await self.down.kill()

    def alive(self) -> bool:
        """A quorum of nodes runs: runplane's processes are expected to keep going."""
        return sum(n.alive() for n in self.cluster.nodes) > len(self.cluster.nodes) // 2

    async def stop(self) -> None:
        await self.cluster.stop()

    async def kill_all(self) -> None:
        for n in self.cluster.nodes:
            await n.kill()

    def env(self) -> dict[str, str]:
        return self.cluster.env()

    async def connect(self) -> NATS:
        return await self.cluster.connect()


class NatsSide(Protocol):
    """What a plane needs of its NATS: one server (`NatsProc`) or a cluster."""

    url: str

    async def start(self) -> None: ...
    async def kill(self) -> None: ...
    async def kill_all(self) -> None: ...
    async def stop(self) -> None: ...
    def alive(self) -> bool: ...
    def env(self) -> dict[str, str]: ...
    async def connect(self) -> NATS: ...


# ---------------------------------------------------------------- runplane processes


class Component:
    """One `runplane <role>` process with its log; kill -9 and restart keep the same
    arguments, environment, data directory and log file."""

    def __init__(
        self, role: str, args: list[str], log: Path, ready: str, env: dict[str, str] | None = None
    ) -> None:
        self.role = role
        self.args = args
        self.log = log
        self.ready_text = ready
        self.env = {"RUNPLANE_ADMIN_TOKEN": TOKEN, **(env or {})}
        self.proc: Proc | None = None
        self.offset = 0
        self.starts = 0
        self.expected_exit = False

    async def start(self) -> None:
        self.offset = self.log.stat().st_size if self.log.exists() else 0
        self.expected_exit = False
        self.proc = await Proc(self.args, self.log, env=self.env).start()
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

    def works_on(self, run_id: str) -> bool:
        """Whether a process this one started (git, Terraform) works in a job directory
        of `run_id` now: the executor that runs one of its phases."""
        if not self.proc or not self.proc.proc or self.returncode() is not None:
            return False
        for pid in descendants(self.proc.proc.pid)[1:]:
            try:
                if f"/jobs/{run_id}-" in os.readlink(f"/proc/{pid}/cwd"):
                    return True
            except OSError:
                continue
        return False

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
    target: str = ""  # the process killed: its role, or the nats node's name
    wall: float = 0.0  # time.time() of the kill, to set against event timestamps
    run_id: str = ""  # the run it waited for (applying, planning), if any


ROLES = ("api", "scheduler", "executor")
# Data directories and logs of the first process of each role (the names of a plane of
# one of each); the second is `<name>2`, and so on.
_DIRS = {"api": "api", "scheduler": "sched", "executor": "exec"}
_READY = {
    "api": "runplane api listening",
    "scheduler": "runplane scheduler running",
    "executor": "runplane executor running",
}


@dataclass
class Plane:
    """The processes of one deployment on one machine, each separately killable: a
    nats side (one server, or a cluster) and `count` processes of each role, every api
    on a port of its own (`bases`, in the order of `apis`)."""

    root: Path
    nats: NatsSide
    apis: list[Component]
    schedulers: list[Component]
    executors: list[Component]
    bases: list[str]
    faults: list[Fault] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)
    orphans: list[asyncio.Task[float]] = field(default_factory=list)  # their lifetimes

    @property
    def api(self) -> Component:
        return self.apis[0]

    @property
    def scheduler(self) -> Component:
        return self.schedulers[0]

    @property
    def executor(self) -> Component:
        return self.executors[0]

    @property
    def base(self) -> str:
        return self.bases[0]

    def isolation(self) -> str:
        """The job isolation the executors said at start they run (`job_isolation`)."""
        modes = {
            str(json.loads(line).get("mode"))
            for c in self.executors
            for line in c.log.read_text().splitlines()
            if "job_isolation" in line and line.startswith("{")
        }
        return ",".join(sorted(modes)) or "?"

    @classmethod
    async def start(cls, root: Path, nats_side: NatsSide | None = None, count: int = 1) -> Plane:
        """Start the nats side (by default one nats-server of its own) and `count`
        processes of each role, every one given the nats side's URLs and environment."""
        root.mkdir(parents=True, exist_ok=True)
        if nats_side is None:
            (root / "nats").mkdir(exist_ok=True)
            nats_side = NatsProc(root / "nats", free_port())
        await nats_side.start()
        common = ["--nats-url", nats_side.url, "--log-format", "json", "--data-dir"]
        made: dict[str, list[Component]] = {role: [] for role in ROLES}
        bases = []
        for role in ROLES:
            for i in range(count):
                name = _DIRS[role] + (str(i + 1) if i else "")
                args = [role, *common, str(root / name)]
                if role == "api":
                    port = free_port()
                    args += ["--listen", f"127.0.0.1:{port}"]
                    bases.append(f"http://127.0.0.1:{port}")
                label = role + (str(i + 1) if count > 1 else "")
                env = nats_side.env()
                if role == "executor":
                    env["RUNPLANE_ISOLATION"] = ISOLATION
                made[role].append(Component(label, args, root / f"{name}.log", _READY[role], env))
        plane = cls(root, nats_side, made["api"], made["scheduler"], made["executor"], bases)
        for c in plane.components():
            await c.start()
        for c in plane.components():
            await c.ready()
        return plane

    def components(self) -> list[Component]:
        return [*self.apis, *self.schedulers, *self.executors]

    def of(self, kind: str) -> list[Component]:
        return {"api": self.apis, "scheduler": self.schedulers, "executor": self.executors}[kind]

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

    async def inject(
        self, kind: str, down_s: float, note: str, tree: bool = True, index: int = 0
    ) -> Fault:
        """kill -9 one process (the `index`th of its role; `nats`: the server, or the
        cluster node leading `RP_EVENTS`), leave it down `down_s` seconds, restart it,
        wait ready. `tree=False` kills the process alone: what it started (Terraform)
        lives on, and how long is measured (`orphans`)."""
        fault = Fault(at=now(), kind=kind, down_s=down_s, note=note, wall=time.time())
        t0 = now()
        if kind == "nats":
            await self.nats.kill()
            if isinstance(self.nats, ClusterNats):
                fault.target = self.nats.killed[-1]
            await asyncio.sleep(down_s)
            await self.nats.start()
        else:
            comp = self.of(kind)[index]
            fault.target = comp.role
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
        await self.nats.kill_all()
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


@dataclass(frozen=True)
class Answer:
    """One request's answer, as the driver saw it: which api replica, when."""

    at: float  # now() as the answer came
    replica: int
    method: str
    path: str
    status: int  # 0: no answer (refused, reset, timeout)
    kind: str  # a problem's type (its last part), else empty


class Api:
    """A forgiving client: the api may be dead at any moment; errors are answers.

    Given several bases (api replicas), each call goes to the next one in turn and, when
    that one does not answer at all, to the others (a load balancer's failover); every
    answer is kept in `answers`."""

    def __init__(self, base: str | list[str]) -> None:
        self.bases = [base] if isinstance(base, str) else list(base)
        self.base = self.bases[0]
        self.answers: list[Answer] = []
        self._turn = 0
        self.session = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=aiohttp.ClientTimeout(total=15),
        )

    async def close(self) -> None:
        await self.session.close()

    async def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        min_seq: int = 0,
        replica: int | None = None,
    ) -> tuple[int, Any]:
        """(status, payload); status 0 when no answer came (refused, reset, timeout).
        `replica` pins the call to one base, without failover."""
        if replica is not None:
            return await self._call(replica, method, path, body, min_seq)
        self._turn += 1
        order = [(self._turn + i) % len(self.bases) for i in range(len(self.bases))]
        for i in order:
            status, payload = await self._call(i, method, path, body, min_seq)
            if status != 0 or method != "GET":  # a write is never sent twice
                break
        return status, payload

    async def _call(
        self, replica: int, method: str, path: str, body: Any, min_seq: int
    ) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body)
        headers = {"RP-Min-Seq": str(min_seq)} if min_seq else None
        status, payload = 0, None
        try:
            async with self.session.request(
                method, self.bases[replica] + path, data=data, headers=headers
            ) as resp:
                status, text = resp.status, await resp.text()
                try:
                    payload = json.loads(text) if text else None
                except ValueError:
                    payload = text
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as e:
            status, payload = 0, repr(e)
        kind = _slug(payload) if status >= 400 else ""
        self.answers.append(Answer(now(), replica, method, path, status, kind))
        return status, payload

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
    aim: dict[str, str] | None = None,
    alone: bool | None = None,
) -> None:
    """Inject the faults of `plan` in order, a random gap apart. Some wait for a moment
    when a run is applying (the window a double apply would need) or planning, some for
    a create or an approve in flight (0-30 ms after the request left); the rest strike
    wherever the runs are. `aim` forces the target of a kind (e.g. `{"executor":
    "applying"}`); with several processes of a role, the executor working on the run
    waited for is the one killed, else one at random. `alone` kills an executor without
    (True) or with (False) its Terraform; by default half the time each. `after` runs
    once each fault is over."""
    for kind in plan:
        await asyncio.sleep(rng.uniform(*gap))
        targets = ["random", "applying", "planning", "create", "approve"]
        if aim and kind in aim:
            target = aim[kind]
        else:
            target = rng.choices(targets, weights=[3, 3, 2, 2, 1])[0]
        runs = await api.all_runs(OPEN)
        note = f"open runs {dict(Counter(r['status'] for r in runs or []))}; "
        run_id = ""
        if target in ("applying", "planning"):
            seen, run_id = await _wait_for_status(api, target, rng.uniform(0, 1.5), 15)
            note += seen
        elif target in work.sending:
            note += await _wait_for_request(work, target, rng.uniform(0, 0.03), 15)
        else:
            note += "random"
        # Mostly short outages; one in five outlasts the heartbeat timeout (4 s).
        down = round(rng.uniform(0.0, 3.0) if rng.random() < 0.8 else rng.uniform(4.0, 8.0), 2)
        t0 = now()
        if alone is None:
            tree = kind != "executor" or rng.random() < 0.5
        else:
            tree = kind != "executor" or not alone
        index = _pick(plane, kind, run_id, rng)
        try:
            fault = await plane.inject(kind, down, note, tree, index)
        except Exception as e:  # a process that will not come back is a finding
            plane.crashes.append(f"{kind} did not come back: {e!r}")
            print("RESTART FAILED", kind, repr(e), flush=True)
            raise
        fault.run_id = run_id
        print(
            f"fault #{len(plane.faults)} kill -9 {kind:9s} {fault.target} ({note}), "
            f"down {down}s, back after {fault.recovered_s}s (t={t0:.1f})",
            flush=True,
        )
        await plane.check_crashes()
        await after(fault)


def _pick(plane: Plane, kind: str, run_id: str, rng: random.Random) -> int:
    """Which process of `kind` to kill: the executor working on `run_id` if one is, else
    each in turn (with only one, always it: no draw, so a seed replays as before)."""
    if kind == "nats" or len(plane.of(kind)) == 1:
        return 0
    if kind == "executor" and run_id:
        for i, c in enumerate(plane.executors):
            if c.works_on(run_id):
                return i
    return sum(f.kind == kind for f in plane.faults) % len(plane.of(kind))


async def _wait_for_request(work: Workload, kind: str, extra: float, timeout: float) -> str:
    try:
        await asyncio.wait_for(work.sending[kind].wait(), timeout)
    except TimeoutError:
        return f"no {kind} request within {timeout}s"
    await asyncio.sleep(extra)
    return f"{extra * 1000:.0f} ms after a {kind} request left"


async def _wait_for_status(api: Api, status: str, extra: float, timeout: float) -> tuple[str, str]:
    """(a note, the run) once a run has `status` and `extra` seconds more went by."""
    deadline = now() + timeout
    while now() < deadline:
        runs = await api.all_runs([status])
        if runs:
            await asyncio.sleep(extra)
            return f"while {runs[0]['id']} {status}", runs[0]["id"]
        await asyncio.sleep(0.2)
    return f"no run {status} within {timeout}s", ""


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


class Witness:
    """Terraform's record of applies: a TCP listener on loopback (port 0) that keeps every
    line a provisioner sends it. It lives in the test's process, which no fault kills."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> Witness:
        self.server = await asyncio.start_server(self._take, "127.0.0.1", 0)
        return self

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def _take(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            data = await asyncio.wait_for(reader.read(), timeout=30)
            self.lines += data.decode(errors="replace").splitlines()
        finally:
            writer.close()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


async def setup_org(
    api: Api, root: Path, workspaces: list[str], settings: dict[str, Any], witness: Witness
) -> None:
    """The organization, its limits, and workspaces sharing one repository whose applies
    report to `witness`."""
    repo = make_repo(root / "repo")
    await api.ok("POST", "/api/v1/orgs", {"name": ORG})
    if settings:
        await api.ok("PATCH", f"/api/v1/orgs/{ORG}/settings", settings)
    for ws in workspaces:
        await api.ok(
            "POST",
            f"/api/v1/orgs/{ORG}/workspaces",
            {"name": ws, "repository": str(repo), "variables": {"witness": str(witness.port)}},
        )


# ---------------------------------------------------------------- the checks


def applies_from_terraform(witness: Witness) -> Counter[str]:
    """Runs whose apply ran the provisioner, counted from Terraform's own output."""
    found: Counter[str] = Counter()
    for line in witness.lines:
        m = _RUN_IN_PATH.search(line)
        assert m, f"unexpected witness line {line!r}"
        found[m.group(1)] += 1
    return found


@dataclass
class StreamView:
    runs: dict[str, str]  # run id -> workspace
    types: dict[str, list[str]]  # run id -> event types in order
    state_versions: Counter[str]  # run id -> run.state_version events
    last_seq: int
    # (time.time() of the event, run or workspace id, type) of every run and workspace
    # event of the organization, in stream order.
    timeline: list[tuple[float, str, str]] = field(default_factory=list)


async def read_stream(source: NatsSide | str) -> StreamView:
    """The organization's run and workspace events, from a URL or a plane's nats side."""
    nc = await (nats.connect(source) if isinstance(source, str) else source.connect())
    try:
        store = EventStore(nc)
        envs = await store.read(f"rp.run.{ORG}.>")
        ws_envs = await store.read(f"rp.ws.{ORG}.>")
        info = await nc.jetstream().stream_info("RP_EVENTS")
    finally:
        await nc.close()
    runs: dict[str, str] = {}
    types: dict[str, list[str]] = defaultdict(list)
    versions: Counter[str] = Counter()
    timeline: list[tuple[int, float, str, str]] = []
    for env in envs:
        _, _, _, ws, run_id = env.subject.split(".")
        tag = type(env.event).__struct_config__.tag
        types[run_id].append(str(tag))
        timeline.append((env.seq, env.time.timestamp() if env.time else 0.0, run_id, str(tag)))
        if tag == "run.created":
            runs[run_id] = ws
        if tag == "run.state_version":
            versions[run_id] += 1
    for env in ws_envs:
        tag = str(type(env.event).__struct_config__.tag)
        ws = env.subject.split(".")[3]
        timeline.append((env.seq, env.time.timestamp() if env.time else 0.0, ws, tag))
    ordered = [t[1:] for t in sorted(timeline)]
    return StreamView(runs, dict(types), versions, int(info.state.last_seq), ordered)


def check_runs(
    runs: list[dict[str, Any]],
    created: list[str],
    stream: StreamView,
    state_versions: Counter[str],
    applies_tf: Counter[str],
    at_least: int,
) -> None:
    """No run lost, none applied twice.

    Every create answered 2xx is in the stream and in the read model (`runs`, a GET of
    every run), which has exactly the stream's runs; per run at most one
    `run.state_version` (the stream's equal to the API's `state_versions`) and at most
    one line in Terraform's own record (`applies_tf`), exactly one of each for an
    `applied` run, and never more than two phases started."""
    in_model = {r["id"] for r in runs}
    assert set(created) <= set(stream.runs), set(created) - set(stream.runs)
    assert set(stream.runs) == in_model, set(stream.runs) ^ in_model
    assert len(created) >= at_least
    assert state_versions == stream.state_versions
    twice = {
        r: (applies_tf[r], stream.state_versions[r])
        for r in set(applies_tf) | set(stream.state_versions)
        if applies_tf[r] > 1 or stream.state_versions[r] > 1
    }
    assert not twice, f"applied more than once (terraform, state versions): {twice}"
    assert set(applies_tf) <= set(stream.runs), set(applies_tf) - set(stream.runs)
    for r in runs:
        events = stream.types[r["id"]]
        assert events.count("run.phase_started") <= 2, (r["id"], events)
        if r["status"] == "applied":
            once = (applies_tf[r["id"]], stream.state_versions[r["id"]])
            assert once == (1, 1), (r["id"], once, events)


async def settle(api: Api, plane: Plane, timeout: float) -> list[dict[str, str]]:
    """Wait (the approver keeps approving) for every run to end; the ones still open
    after `timeout` are returned."""
    deadline = now() + timeout
    while True:
        await plane.check_crashes()
        runs = await api.all_runs()
        if runs is not None:
            left = [
                {"id": r["id"], "status": r["status"]} for r in runs if r["status"] not in TERMINAL
            ]
            if not left or now() > deadline:
                return left
        await asyncio.sleep(0.5)


async def state_versions_by_run(api: Api, workspaces: list[str]) -> Counter[str]:
    found: Counter[str] = Counter()
    for ws in workspaces:
        page = await api.ok("GET", f"/api/v1/orgs/{ORG}/workspaces/{ws}/state-versions")
        found.update(v["run_id"] for v in page["items"])
    return found


def data_dir(c: Component) -> Path:
    return Path(c.args[c.args.index("--data-dir") + 1])


async def replay_identity(
    plane: Plane, tmp_path: Path
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Stop every api (each projector is at the stream's end), dump each one's read
    model, and rebuild a fresh one with `runplane replay`: (live rows of each api in
    the order of `plane.apis`, replayed rows)."""
    lives = []
    for c in plane.apis:
        code = await c.stop()
        assert code == 0, f"{c.role} exited {code}: {c.output()[-3000:]}"
        lives.append(await dump(data_dir(c) / "readmodel.sqlite"))
    fresh = tmp_path / "replayed"
    args = ["replay", "--nats-url", plane.nats.url, "--data-dir", str(fresh)]
    replay = await Proc(args, tmp_path / "replay.log", env=plane.nats.env()).start()
    assert await replay.stop(signal.SIGCONT, timeout=120) == 0, replay.output()
    return lives, await dump(fresh / "readmodel.sqlite")


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


# ---------------------------------------------------------------- the cluster's checks

REPLICAS = 3
# A 5xx other than 503 is a defect; a 503 is allowed from a kill until this many seconds
# after the killed process (or node) is back.
AFTER_FAULT_503_S = 10.0
# How long, after a fault is over, every stream, bucket and consumer may take to have a
# leader and its 3 replicas again.
REPLICATION_WAIT_S = 30.0


async def replicated(nats_side: ClusterNats, timeout: float = REPLICATION_WAIT_S) -> dict[str, Any]:
    """Wait until everything has its 3 replicas with a leader (`below_replication`
    empty); how long it took, and what was still below after `timeout`."""
    t0 = time.monotonic()
    while True:
        try:
            below = await below_replication(nats_side)
        except nats.errors.TimeoutError as e:  # no leader yet to answer
            below = [f"no answer: {e}"]
        if not below or time.monotonic() - t0 > timeout:
            return {"after_s": round(time.monotonic() - t0, 2), "below": below}
        await asyncio.sleep(0.5)


async def below_replication(nats_side: ClusterNats) -> list[str]:
    """Every stream, bucket and durable consumer that is not configured for 3 replicas,
    or has no leader or not 2 other replicas (`runplane nats status`'s own rows)."""
    nc = await nats_side.connect()
    try:
        rows = await natsstatus.collect(nc)
    finally:
        await nc.close()
    found = []
    for row in rows:
        peers = [] if row.peers in ("-", "missing") else row.peers.split(", ")
        if row.durable and (row.have < REPLICAS or row.leader == "-" or len(peers) != 2):
            found.append(f"{row.kind} {row.name}: {row.have} replicas, {row.leader}, {row.peers}")
    return found


NOTIFY_ENV = {
    "RUNPLANE_NOTIFY_ALLOW": "loopback",  # the receiver is on 127.0.0.1
    "RUNPLANE_NOTIFY_SCHEDULE": "0.5,1,2,4",  # retries within the test's bounds
    "RUNPLANE_NOTIFY_TIMEOUT": "5",
}


def _subscribers(root: Path, nats_side: ClusterNats, count: int = 2) -> list[Component]:
    out = []
    for i in range(1, count + 1):
        args = ["subscribers", "--nats-url", nats_side.url, "--log-format", "json"]
        args += ["--data-dir", str(root / f"subs{i}")]
        env = {**nats_side.env(), **NOTIFY_ENV}
        ready = "runplane subscribers running (notifications"
        out.append(Component(f"subscribers{i}", args, root / f"subs{i}.log", ready, env))
    return out


async def _maybe(waiting: Awaitable[bool]) -> bool:
    """The wait's answer, False when it timed out (the asserts after say what is off)."""
    try:
        return await waiting
    except AssertionError:
        return False
