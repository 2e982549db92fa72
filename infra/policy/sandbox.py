"""Policy sets checked and evaluated in a bounded child process, never in ours.

A policy is an organization admin's code, and rego-cpp runs it natively in the process
that loads it: with that process's environment (`opa.runtime().env` answered the admin
token), its memory (`numbers.range(1, 100000000)` grew the API by 14 GB in 20 s) and its
time. So the API's save-time check and the executor's evaluation both go through
`PolicySandbox`, which starts one child per call (several sets share it) that:

- is this interpreter (`sys.executable -I`, an empty environment, `/` as its directory),
  which imports regopy (infra/policy/evaluate.py) and warms it up while it can still read
  the interpreter's files, then clears its environment, so `opa.runtime().env` is `{}`;
- caps its address space at what it has mapped by then plus `memory_mb` (RLIMIT_AS: rego-cpp
  is native; its allocator reserves 256 GB of address space when it loads, so the cap can
  only be set after the import), its CPU time (RLIMIT_CPU) and forbids files and cores;
- when we run as root, drops to an unprivileged uid/gid (nobody by default) with no
  supplementary groups before it reads anything untrusted;
- reads the request (JSON) on stdin and answers one JSON line per set on a private copy
  of stdout (a policy's `print()` writes to fd 1, which is /dev/null by then).

The parent kills it when one set runs longer than `timeout_s` of wall clock (each set has
its own; RLIMIT_CPU is their sum, a backstop), reads at most one bounded line per set, and
re-bounds every message: nothing the child says is trusted. The caps are
deployment settings, RUNPLANE_POLICY_MEMORY_MB (default 512) and
RUNPLANE_POLICY_TIMEOUT_S (default 10), or constructor arguments.

The parent side imports no regopy: the API and the executor never load rego-cpp.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from events.policies import PolicyResult, PolicySet
from infra.childenv import kill_group
from infra.policy.wire import (
    EXIT_MEMORY,
    MAX_ERROR,
    READY,
    Checked,
    InvalidPolicy,
    Verdict,
    bounded,
)

__all__ = [
    "InvalidPolicy",
    "PolicyCrashed",
    "PolicyLimitExceeded",
    "PolicySandbox",
    "SandboxError",
    "SandboxUnavailable",
]

MEMORY_ENV = "RUNPLANE_POLICY_MEMORY_MB"
TIMEOUT_ENV = "RUNPLANE_POLICY_TIMEOUT_S"
UID_ENV, GID_ENV = "RUNPLANE_POLICY_UID", "RUNPLANE_POLICY_GID"
DEFAULT_MEMORY_MB = 512
DEFAULT_TIMEOUT_S = 10.0
NOBODY = 65534  # uid and gid of `nobody` / `nogroup` on Debian

STARTUP_S = 30.0  # interpreter + regopy import; not the policy's time, so not its cap
_LINE_LIMIT = 1 << 20  # one answer: 51 messages of 1000 characters, JSON-escaped, fit
_STDERR_KEPT = 4096
_ROOT = str(Path(__file__).resolve().parents[2])  # where `infra` is importable from
_BOOT = (
    f"import sys; sys.path.insert(0, {_ROOT!r}); "
    "from infra.policy.evaluate import child_main; child_main()"
)
_T = TypeVar("_T")


# ---------------------------------------------------------------- errors


class SandboxError(Exception):
    """Root of the sandbox's own errors: the policy could not be run to its end."""

    retryable = False


class PolicyLimitExceeded(SandboxError):
    """The policy passed a cap (`limit` is "memory" or "time") and its child was
    stopped; `what` says which cap in words ("used more than 512 MB of memory")."""

    code = "policy-limit-exceeded"

    def __init__(self, limit: str, policy: str, what: str) -> None:
        super().__init__(f"policy {policy} {what}")
        self.limit = limit
        self.policy = policy
        self.what = what


class PolicyCrashed(SandboxError):
    """The evaluator died on the policy for another reason (a signal, a bad answer)."""

    def __init__(self, policy: str, why: str) -> None:
        super().__init__(f"policy {policy} stopped the evaluator: {why}")
        self.policy = policy
        self.why = why


class SandboxUnavailable(SandboxError):
    """The child could not be started or did not get ready: nothing of the policy ran."""

    retryable = True


# ---------------------------------------------------------------- the parent's side


def _setting(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive number, not {raw!r}")
    return value


class PolicySandbox:
    """Runs compile checks and evaluations in a confined child; see the module's text.

    `memory_mb` and `timeout_s` default to the deployment's settings (environment), else
    512 MB and 10 s. `uid`/`gid` is who the child becomes when we are root: the
    deployment's RUNPLANE_POLICY_UID / RUNPLANE_POLICY_GID, else nobody (a uid of its
    own is better: whatever else runs as nobody may signal the child). At most
    `concurrency` children run at once, so that a burst of saves or runs costs at most
    that many times the memory cap.
    """

    def __init__(
        self,
        *,
        memory_mb: int | None = None,
        timeout_s: float | None = None,
        uid: int | None = None,
        gid: int | None = None,
        concurrency: int = 2,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        if memory_mb is None:
            memory_mb = int(_setting(env, MEMORY_ENV, DEFAULT_MEMORY_MB))
        if timeout_s is None:
            timeout_s = _setting(env, TIMEOUT_ENV, DEFAULT_TIMEOUT_S)
        self.memory_mb, self.timeout_s = int(memory_mb), float(timeout_s)
        if self.memory_mb <= 0 or self.timeout_s <= 0:
            raise ValueError("the policy sandbox's caps must be positive")
        if uid is None and env.get(UID_ENV, "").strip():
            uid = int(_setting(env, UID_ENV, NOBODY))
        if gid is None and env.get(GID_ENV, "").strip():
            gid = int(_setting(env, GID_ENV, NOBODY))
        root = os.geteuid() == 0
        if not root and uid not in (None, os.getuid()):
            raise ValueError(f"the policy sandbox cannot become uid {uid}: not running as root")
        self.uid = (NOBODY if uid is None else uid) if root else -1
        self.gid = (NOBODY if gid is None else gid) if root else -1
        if root and (self.uid == 0 or self.gid == 0):
            raise ValueError("the policy sandbox must not run policies as root")
        self._slots = asyncio.Semaphore(concurrency)

    def memory_text(self) -> str:
        return f"used more than {self.memory_mb} MB of memory"

    def time_text(self) -> str:
        return f"ran longer than {self.timeout_s:g} s"

    async def compile_check(self, name: str, source: str) -> None:
        """InvalidPolicy unless `source` compiles, declares a package, has a `deny` rule
        and evaluates on an empty input without an error (infra/policy/evaluate.py);
        PolicyLimitExceeded if checking it passed a cap."""
        request = {"op": "check", "name": name, "source": source}
        [line] = await self._run(json.dumps(request).encode(), [name])
        answer = _decode(line, Checked, name)
        if answer.invalid is not None:
            raise InvalidPolicy(answer.invalid[:MAX_ERROR])

    async def evaluate(
        self, policies: Sequence[PolicySet], plan_json: dict[str, Any]
    ) -> list[PolicyResult]:
        """Each set's verdict on the plan, in the order given, all in one child;
        PolicyLimitExceeded naming the set that passed a cap."""
        if not policies:
            return []
        request = {
            "op": "evaluate",
            "policies": [{"name": p.name, "source": p.source} for p in policies],
            "plan": plan_json,
        }
        body = json.dumps(request, separators=(",", ":")).encode()  # ints of any size
        lines = await self._run(body, [p.name for p in policies])
        results = []
        for policy, line in zip(policies, lines, strict=True):
            verdict = _decode(line, Verdict, policy.name)
            results.append(
                PolicyResult(
                    name=policy.name,
                    enforcement=policy.enforcement,
                    scope=policy.scope,
                    passed=verdict.passed,
                    messages=bounded(verdict.messages),
                )
            )
        return results

    async def _run(self, request: bytes, names: list[str]) -> list[bytes]:
        """One child: its answer lines, one per name; the error its end stands for."""
        async with self._slots:
            try:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-I",
                    "-c",
                    _BOOT,
                    *self._argv(len(names)),
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    env={},
                    cwd="/",
                    start_new_session=True,
                    limit=_LINE_LIMIT,
                )
            except OSError as e:
                raise SandboxUnavailable(f"the policy evaluator cannot start: {e}") from e
            try:
                return await self._talk(proc, request, names)
            finally:
                await kill_group(proc)

    def _argv(self, sets: int) -> list[str]:
        cpu = math.ceil(self.timeout_s * sets) + 1  # the wall clock's kill comes first
        return [str(self.memory_mb << 20), str(cpu), str(self.uid), str(self.gid)]

    async def _talk(
        self, proc: asyncio.subprocess.Process, request: bytes, names: list[str]
    ) -> list[bytes]:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        errors = asyncio.create_task(_head(proc.stderr))
        feed = asyncio.create_task(_feed(proc.stdin, request))
        lines: list[bytes] = []
        try:
            await _ready(proc, proc.stdout)
            await self._read_answers(proc, proc.stdout, names, lines)
        finally:
            feed.cancel()
            if proc.returncode is None:
                await kill_group(proc)
            stderr = await errors
        self._verdict(proc.returncode, stderr, names, lines)
        return lines

    async def _read_answers(
        self,
        proc: asyncio.subprocess.Process,
        stdout: asyncio.StreamReader,
        names: list[str],
        lines: list[bytes],
    ) -> None:
        """Into `lines`, one answer per set, each within timeout_s; then the child's end."""
        try:
            while len(lines) < len(names):
                async with asyncio.timeout(self.timeout_s):
                    line = await _line(stdout)
                if not line:
                    return
                lines.append(line)
            async with asyncio.timeout(self.timeout_s):
                await proc.wait()
        except TimeoutError:
            raise PolicyLimitExceeded("time", _at(names, lines), self.time_text()) from None
        except ValueError:  # a line longer than _LINE_LIMIT: not our child's answer
            raise PolicyCrashed(_at(names, lines), "its answer is too long") from None

    def _verdict(self, rc: int | None, stderr: bytes, names: list[str], lines: list[bytes]) -> None:
        """Nothing if the child answered for every set and ended well, else why not."""
        policy = _at(names, lines)
        out_of_memory = b"bad_alloc" in stderr or b"MemoryError" in stderr
        if rc == EXIT_MEMORY or (rc is not None and rc < 0 and out_of_memory):
            raise PolicyLimitExceeded("memory", policy, self.memory_text())
        if rc == -signal.SIGXCPU:
            raise PolicyLimitExceeded("time", policy, self.time_text())
        if rc != 0:
            raise PolicyCrashed(policy, _status(rc))
        if len(lines) != len(names):
            raise PolicyCrashed(policy, f"it answered {len(lines)} of {len(names)} sets")


async def _ready(proc: asyncio.subprocess.Process, stdout: asyncio.StreamReader) -> None:
    """SandboxUnavailable unless the child says it is confined and reading the request."""
    try:
        async with asyncio.timeout(STARTUP_S):
            ready = await _line(stdout)
    except TimeoutError:
        raise SandboxUnavailable(f"the policy evaluator did not start in {STARTUP_S:g} s") from None
    if ready != READY:
        await proc.wait()
        raise SandboxUnavailable(f"the policy evaluator did not start ({_status(proc.returncode)})")


async def _feed(stdin: asyncio.StreamWriter, data: bytes) -> None:
    with contextlib.suppress(ConnectionError):  # it died or is done reading: no matter
        stdin.write(data)
        await stdin.drain()
        stdin.close()


async def _line(stdout: asyncio.StreamReader) -> bytes:
    """One answer line without its newline; b"" at the end of the output."""
    return (await stdout.readline()).rstrip(b"\n")


async def _head(stream: asyncio.StreamReader) -> bytes:
    """The first bytes of `stream`, read to its end so the child never blocks on it."""
    kept = b""
    while chunk := await stream.read(65536):
        kept = (kept + chunk)[:_STDERR_KEPT]
    return kept


def _at(names: list[str], lines: list[bytes]) -> str:
    """The set being evaluated when the child stopped: the first one it did not answer."""
    return names[min(len(lines), len(names) - 1)]


def _status(rc: int | None) -> str:
    if rc is not None and rc < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-rc).name}"
    return f"exit status {rc}"


def _decode(line: bytes, kind: type[_T], policy: str) -> _T:
    try:
        return msgspec.json.decode(line, type=kind)
    except msgspec.ValidationError as e:  # DecodeError included
        raise PolicyCrashed(policy, f"its answer is not one: {e}") from None
