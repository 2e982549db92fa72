"""Policies are an organization admin's code: the attacks, at save and at run time, with
real Terraform through the HTTP API (infra/policy/sandbox.py).

- `opa.runtime()` answers the evaluating process's environment: the admin token and the
  NATS credentials were one policy away (at save as an oracle: the check fails or not on
  what the environment holds; at run time as the policy's deny message);
- `numbers.range(1, 100000000)` grew the API (at save) or the executor (at run time)
  without bound; a busy loop held it for ever.

The deployment's caps are set the way a deployment sets them, in the environment (the
time cap lowered to 4 s to keep the suite quick, the memory cap left at its default). A
guard process kills this test's own processes if one passes 2 GB of RSS, so that a
sandbox that does not hold never hurts the machine. The sandbox's module is imported
only by the tests that call it directly: the others are the attacks themselves and run
against any version of the API and executor.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from events.policies import PolicySet
from tests.api_support import ADMIN_TOKEN
from tests.helpers import eventually
from tests.plane_support import (  # noqa: F401  # registers the fixtures
    Plane,
    commit,
    plane_fixture,
)

V1 = "/api/v1/orgs/acme"
TWO = 'resource "null_resource" "a" {}\nresource "null_resource" "b" {}\n'
NATS_SECRET = "nats-password-of-the-deployment"
TIME_CAP_S = 4  # the runaway reaches 512 MB in about 1 s
GUARD_MB = 2048

RUNTIME = """package runtime
import rego.v1

deny contains msg if { msg := opa.runtime() }
deny contains msg if { msg := sprintf("token=%s", [opa.runtime().env.RUNPLANE_ADMIN_TOKEN]) }
"""
# Fails the check on an empty plan (base64.decode of "!..." is an error) exactly when the
# environment holds what it guesses, `x` a value found on the way: one bit per save,
# enough to read the token. (rego-cpp does not evaluate a body in order: the error is
# made to depend on what the guess found.)
ORACLE = """package oracle
import rego.v1

deny contains msg if {{
  {guess}
  msg := base64.decode(sprintf("!%v", [x]))
}}
"""
HUGE = "count(numbers.range(1, 100000000)) > 0"
# rego-cpp stops a query after a number of statements: these are few and slow (a regex
# over 100 KB each), about 20 minutes of them in-process, in little memory.
BUSY = (
    's := concat(",", [sprintf("%d", [j]) | some j in numbers.range(1, 20000)])\n'
    "  some i in numbers.range(1, 1000)\n"
    "  some k in numbers.range(1, 1000)\n"
    '  regex.match(sprintf("x%d-%d", [i, k]), s)'
)
ON_A_PLAN = "count(input.resource_changes) > 0"  # nothing on the empty plan of a save


def _policy(package: str, *conditions: str) -> str:
    body = "\n  ".join(conditions)
    return f'package {package}\nimport rego.v1\n\ndeny contains "no" if {{\n  {body}\n}}\n'


# ---------------------------------------------------------------- the guard

GUARD = r"""
import os, signal, sys, time
root, limit_kb = int(sys.argv[1]), int(sys.argv[2]) * 1024
page_kb = os.sysconf("SC_PAGE_SIZE") // 1024

def rss_kb(pid):
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * page_kb
    except (OSError, ValueError, IndexError):
        return 0

def tree():
    children = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found

pids, tick = [root], 0
while os.path.exists(f"/proc/{root}"):
    if tick % 10 == 0:
        pids = tree()
    for pid in pids:
        used = rss_kb(pid)
        if used > limit_kb:
            print(f"memory guard: SIGKILL to pid {pid} at {used // 1024} MB", file=sys.stderr)
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    tick += 1
    time.sleep(0.05)
"""


@pytest.fixture(autouse=True, scope="module")
def memory_guard() -> Iterator[None]:
    """Kills any process of this test (pytest included) whose RSS passes GUARD_MB."""
    guard = subprocess.Popen([sys.executable, "-c", GUARD, str(os.getpid()), str(GUARD_MB)])
    try:
        yield
    finally:
        guard.send_signal(signal.SIGTERM)
        guard.wait(10)


@pytest.fixture(autouse=True)
def deployment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment of a deployment: its secrets, and a lowered time cap."""
    monkeypatch.setenv("RUNPLANE_ADMIN_TOKEN", ADMIN_TOKEN)
    monkeypatch.setenv("NATS_PASSWORD", NATS_SECRET)
    monkeypatch.setenv("RUNPLANE_POLICY_TIMEOUT_S", str(TIME_CAP_S))


def _peak_mb(who: int = resource.RUSAGE_SELF) -> int:
    return resource.getrusage(who).ru_maxrss // 1024


def _leaks(text: str, source: str = "") -> list[str]:
    """What of the deployment's environment `text` shows, but for the policy's source."""
    text = text.replace(json.dumps(source)[1:-1], "") if source else text
    return [s for s in (ADMIN_TOKEN, NATS_SECRET, "RUNPLANE_", "NATS_") if s in text]


# ---------------------------------------------------------------- helpers


async def _read(plane: Plane, path: str) -> Any:
    seq = await plane.app.store.last_seq()
    answer = await plane.http.get(path, headers={"RP-Min-Seq": str(seq)})
    assert answer.status == 200, answer.body
    return answer.body


async def _put(plane: Plane, name: str, source: str, enforcement: str = "advisory") -> Any:
    body = {"enforcement": enforcement, "source": source}
    # Bounded: an unbounded check would hold the request for ever.
    return await asyncio.wait_for(
        plane.http.call("PUT", f"{V1}/policies/{name}", json=body), timeout=60
    )


async def _planned_with(plane: Plane, repo: Path, name: str, source: str) -> str:
    """A workspace of two null resources with one policy set; its plan run's id."""
    commit(repo, {"main.tf": TWO})
    a = await plane.http.post(f"{V1}/workspaces", json={"name": "net", "repository": str(repo)})
    assert a.status == 201, a.body
    saved = await _put(plane, name, source)
    assert saved.status == 201, saved.body
    await plane.executor("e1")
    return await plane.start("net", "plan")


async def _everything_about(plane: Plane, run_id: str) -> str:
    """The run, its events and its policy step's log, as one text."""
    run = await _read(plane, f"{V1}/runs/{run_id}")
    events = await _read(plane, f"{V1}/runs/{run_id}/events")
    log = await _read(plane, f"{V1}/runs/{run_id}/logs?phase=plan&step=policy")
    return json.dumps([run, events, log])


async def _policy_log(plane: Plane, run_id: str) -> str:
    log = await _read(plane, f"{V1}/runs/{run_id}/logs?phase=plan&step=policy")
    return "\n".join(line["text"] for line in log["items"])


# ---------------------------------------------------------------- opa.runtime()


async def test_at_save_a_policy_learns_nothing_of_the_apis_environment(plane: Plane) -> None:
    """The check of a save cannot tell whether the environment is empty, nor confirm a
    guess of the admin token: both save (201), and no answer carries the token."""
    guesses = {
        "anything": "x := count(opa.runtime().env)\n  x > 0",
        "token": "x := opa.runtime().env.RUNPLANE_ADMIN_TOKEN\n"
        f'  startswith(x, "{ADMIN_TOKEN[:6]}")',
        "nats": 'x := opa.runtime().env.NATS_PASSWORD\n  startswith(x, "nats")',
    }
    for name, guess in guesses.items():
        a = await _put(plane, f"oracle-{name}", ORACLE.format(guess=guess))
        assert a.status == 201, (name, a.body)
        answer = {k: v for k, v in a.body.items() if k != "source"}  # the source names them
        assert not _leaks(json.dumps(answer)), a.body
    # the oracle works where there is something to find: a guess about the runtime's
    # fields that holds fails the check
    a = await _put(plane, "control", ORACLE.format(guess="x := opa.runtime().env\n  x == {}"))
    assert "fails on an empty plan" in a.problem("invalid-policy", 422)["detail"]


@pytest.mark.terraform
async def test_at_run_time_opa_runtime_shows_an_empty_environment(plane: Plane, repo: Path) -> None:
    """A policy whose deny messages are `opa.runtime()` and the admin token: the plan's
    policy result shows the runtime with `env` {} and no token, and nothing of the
    deployment's variables is in the run, its events or the step's log."""
    run_id = await _planned_with(plane, repo, "runtime", RUNTIME)
    done = await plane.reaches("net", run_id, "planned", "failed")
    assert done.status == "planned", done.error_message
    run = await _read(plane, f"{V1}/runs/{run_id}")
    [result] = run["policies"]
    [message] = result["messages"]  # the sprintf of an undefined token: no message
    runtime = json.loads(message)
    assert runtime["env"] == {}, runtime
    assert set(runtime) <= {"env", "commit", "version", "regocpp_version", "config"}
    assert not _leaks(await _everything_about(plane, run_id), RUNTIME)


# ---------------------------------------------------------------- memory


async def test_at_save_a_runaway_policy_is_refused_naming_the_memory_cap(plane: Plane) -> None:
    """`numbers.range(1, 100000000)`: 422 policy-limit-exceeded naming the 512 MB cap,
    nothing saved; the API process did not grow, the child stopped near the cap."""
    before = _peak_mb()
    # RUSAGE_CHILDREN is the largest child this process ever waited for: an earlier test's
    # child may be larger than the cap already (1,174 MB once, in a full suite). Then the
    # policy's child, which stopped near the cap, leaves it as it was.
    children_before = _peak_mb(resource.RUSAGE_CHILDREN)
    a = await _put(plane, "runaway", _policy("runaway", HUGE))
    body = a.problem("policy-limit-exceeded", 422)
    assert body["limit"] == "memory"
    assert "used more than 512 MB of memory" in body["detail"], body
    assert _peak_mb() - before < 100, (before, _peak_mb())
    children = _peak_mb(resource.RUSAGE_CHILDREN)
    assert children < 512 + 150 or children == children_before, (children_before, children)
    (await plane.http.get(f"{V1}/policies/runaway")).problem("not-found", 404)
    a = await _put(plane, "fine", _policy("fine", "input.x == 1"))
    assert a.status == 201, a.body  # the API is well


@pytest.mark.terraform
async def test_at_run_time_a_runaway_policy_fails_the_run_naming_the_memory_cap(
    plane: Plane, repo: Path
) -> None:
    """A policy that saves (nothing runs away on an empty plan) and runs away on the
    plan: the run fails `policy_limit_exceeded` with the set and the cap, its policy step
    failed; the executor (this process) did not grow."""
    before = _peak_mb()
    run_id = await _planned_with(plane, repo, "runaway", _policy("runaway", ON_A_PLAN, HUGE))
    failed = await plane.reaches("net", run_id, "failed", "planned")
    assert failed.reason == "policy_limit_exceeded", (failed.reason, failed.error_message)
    assert failed.error_message == "policy runaway used more than 512 MB of memory"
    steps = (await _read(plane, f"{V1}/runs/{run_id}/steps"))["items"]
    policy_step = next(s for s in steps if s["step"] == "policy")
    assert policy_step["status"] == "failed", policy_step
    assert "used more than 512 MB of memory" in await _policy_log(plane, run_id)
    assert _peak_mb() - before < 100, (before, _peak_mb())
    second = await plane.start("net", "plan")  # the executor takes the next run
    assert (await plane.reaches("net", second, "failed")).reason == "policy_limit_exceeded"


# ---------------------------------------------------------------- time


async def test_at_save_a_busy_policy_is_refused_naming_the_time_cap(plane: Plane) -> None:
    started = time.monotonic()
    a = await _put(plane, "busy", _policy("busy", BUSY))
    took = time.monotonic() - started
    body = a.problem("policy-limit-exceeded", 422)
    assert (body["limit"], body["detail"]) == (
        "time",
        f"the policy ran longer than {TIME_CAP_S} s (the deployment's time cap for a policy)",
    )
    assert TIME_CAP_S <= took < TIME_CAP_S + 5, took


@pytest.mark.terraform
async def test_at_run_time_a_busy_policy_fails_the_run_naming_the_time_cap(
    plane: Plane, repo: Path
) -> None:
    run_id = await _planned_with(plane, repo, "busy", _policy("busy", ON_A_PLAN, BUSY))
    failed = await plane.reaches("net", run_id, "failed", "planned")
    assert failed.reason == "policy_limit_exceeded", (failed.reason, failed.error_message)
    assert failed.error_message == f"policy busy ran longer than {TIME_CAP_S} s"


# ---------------------------------------------------------------- the child itself


def _children_running(module: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid() and module.encode() in cmdline:
            found.append(int(name))
    return found


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


async def test_the_child_is_confined_and_its_caps_are_the_callers() -> None:
    """A busy set in a sandbox of 128 MB and 3 s: while it runs, its child has no
    environment, no supplementary groups, nobody's uid and gid (we run as root), its
    address space capped; it is stopped at 3 s, naming the set that ran."""
    from infra.policy.sandbox import PolicyLimitExceeded, PolicySandbox

    sandbox = PolicySandbox(memory_mb=128, timeout_s=3)
    sets = [
        PolicySet(name="quick", enforcement="advisory", source=_policy("quick", "input.x")),
        PolicySet(name="busy", enforcement="advisory", source=_policy("busy", BUSY)),
    ]
    evaluation = asyncio.create_task(sandbox.evaluate(sets, {"x": True}))

    async def child() -> int:
        running = _children_running("infra.policy.evaluate")
        assert len(running) == 1, running
        pid = running[0]
        assert _status(pid)["Uid"].split()[0] == str(65534 if os.geteuid() == 0 else os.getuid())
        return pid

    pid = await eventually(child, timeout=10, what="the sandbox's child")
    status = _status(pid)
    if os.geteuid() == 0:
        assert status["Uid"].split() == ["65534"] * 4 and status["Gid"].split() == ["65534"] * 4
        assert status["Groups"].strip() == ""
    environ = Path(f"/proc/{pid}/environ")
    assert environ.read_bytes() == b""
    assert environ.stat().st_uid == 0  # not dumpable: its /proc files stay root's
    limits = {
        line[:26].strip(): line[26:].split()[:2]
        for line in Path(f"/proc/{pid}/limits").read_text().splitlines()[1:]
    }
    assert limits["Max cpu time"] == ["7", "8"], limits  # 3 s for each set, and one more
    assert limits["Max file size"] == ["0", "0"] and limits["Max core file size"] == ["0", "0"]
    mapped_mb = int(status["VmSize"].split()[0]) // 1024
    cap_mb = int(limits["Max address space"][0]) >> 20
    assert 0 < cap_mb - mapped_mb <= 128, (cap_mb, mapped_mb)
    with pytest.raises(PolicyLimitExceeded) as caught:
        await evaluation
    assert (caught.value.limit, str(caught.value)) == ("time", "policy busy ran longer than 3 s")
    assert _children_running("infra.policy.evaluate") == []


async def test_a_policy_that_prints_cannot_forge_its_answer() -> None:
    """rego-cpp's print() writes to fd 1: a fake "passed" line goes nowhere."""
    from infra.policy.sandbox import PolicySandbox

    forged = json.dumps({"passed": True, "messages": []}).replace('"', '\\"')
    source = f'package forged\nimport rego.v1\n\ndeny contains "real" if {{ print("{forged}") }}\n'
    [result] = await PolicySandbox().evaluate(
        [PolicySet(name="forged", enforcement="hard-mandatory", source=source)], {}
    )
    assert (result.passed, result.messages) == (False, ["real"])


@pytest.mark.parametrize(
    ("condition", "memory_mb"),
    [
        (HUGE, 64),  # rego-cpp aborts: std::bad_alloc thrown past it
        # rego-cpp answers the query with a `std::bad_alloc` error, as if the policy failed
        ('some i in numbers.range(1, 1000000)\n  regex.match(sprintf("x%d", [i]), "y")', 512),
    ],
)
async def test_the_memory_cap_is_the_callers(condition: str, memory_mb: int) -> None:
    from infra.policy.sandbox import PolicyLimitExceeded, PolicySandbox

    sandbox = PolicySandbox(memory_mb=memory_mb, timeout_s=30)
    with pytest.raises(PolicyLimitExceeded) as caught:
        await sandbox.compile_check("huge", _policy("huge", condition))
    assert caught.value.limit == "memory"
    assert caught.value.what == f"used more than {memory_mb} MB of memory"
    await sandbox.compile_check("small", _policy("small", "input.x == 1"))  # within it


def test_the_caps_and_identity_are_deployment_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from infra.policy.sandbox import PolicySandbox

    monkeypatch.setenv("RUNPLANE_POLICY_MEMORY_MB", "300")
    monkeypatch.setenv("RUNPLANE_POLICY_TIMEOUT_S", "2.5")
    sandbox = PolicySandbox()
    assert (sandbox.memory_mb, sandbox.timeout_s) == (300, 2.5)
    monkeypatch.delenv("RUNPLANE_POLICY_MEMORY_MB")
    monkeypatch.delenv("RUNPLANE_POLICY_TIMEOUT_S")
    assert (PolicySandbox().memory_mb, PolicySandbox().timeout_s) == (512, 10.0)
    if os.geteuid() == 0:
        monkeypatch.setenv("RUNPLANE_POLICY_UID", "4242")
        assert (PolicySandbox().uid, PolicySandbox().gid) == (4242, 65534)
        assert PolicySandbox(uid=4343, gid=4343).gid == 4343
        with pytest.raises(ValueError, match="not run policies as root"):
            PolicySandbox(uid=0)
    for bad in ("0", "-1", "lots", "nan"):
        monkeypatch.setenv("RUNPLANE_POLICY_MEMORY_MB", bad)
        with pytest.raises(ValueError, match="RUNPLANE_POLICY_MEMORY_MB must be a positive"):
            PolicySandbox()
