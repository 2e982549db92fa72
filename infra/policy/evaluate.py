"""The policy sandbox's child (started by infra/policy/sandbox.py): compiling and
evaluating policy sets (OPA Rego, `events/policies.py`) with regopy (rego-cpp). The only
module that imports regopy, and nothing but that child imports it: a policy runs natively,
with the environment, memory and time of the process that evaluates it.

A policy set is one Rego module with a `package` and a `deny` rule; its verdict on a plan
is the value of `data.<package>.deny` with the plan's JSON (`terraform show -json`) as
`input`: a set of messages (`deny contains msg if {...}`), a partial object whose keys are
the messages (the Rego v0 form `deny[msg] {...}`), a boolean or a single string. It
passes when `deny` is undefined or empty; an evaluation error is a failure whose message
says so.

Each set gets its own interpreter, so one set's rules never see another's.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import resource
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
from regopy import (  # type: ignore[import-untyped]  # no stubs
    Input,
    Interpreter,
    LogLevel,
    Node,
    NodeKind,
    RegoError,
)
from regopy.rego_shared import (  # type: ignore[import-untyped]  # no stubs
    rego_free_output,
    rego_node_get,
    rego_node_size,
    rego_node_type,
    rego_node_value,
    rego_output_node,
    rego_output_ok,
    rego_output_string,
    rego_query,
)

from events.policies import PolicyResult, PolicySet
from infra.policy.wire import (
    EXIT_MEMORY,
    MAX_ERROR,
    READY,
    Checked,
    InvalidPolicy,
    Verdict,
    bounded,
    package_of,
)

_DENY = re.compile(r"^[ \t]*(?:default[ \t]+)?deny\b", re.M)
_INT64 = (-(2**63), 2**63 - 1)
_POLICY_ERROR = "policy error: "
_PR_SET_DUMPABLE = 4  # prctl(2)
_ERROR = re.compile(rb"\(error(?![a-z])(?:[ \t]+(\d+):)?")
_ERRORMSG = re.compile(rb"\(errormsg (\d+):")
_LOCATION = re.compile(rb"\|(\d+)\|(\d+)")

__all__ = ["InvalidPolicy", "child_main", "compile_check", "evaluate", "package_of"]


def compile_check(name: str, source: str) -> None:
    """InvalidPolicy unless `source` parses and compiles, declares a package, has a
    `deny` rule, and evaluates on an empty input without an error."""
    package = package_of(source)
    if not package:
        raise InvalidPolicy("the policy has no `package` declaration (e.g. `package terraform`)")
    if not _DENY.search(source):
        raise InvalidPolicy(
            f"the policy has no `deny` rule: runplane evaluates data.{package}.deny, "
            "a set of messages (e.g. `deny contains msg if { ... }`)"
        )
    module = f"{name}.rego"
    rego = _interpreter()
    try:
        rego.add_module(module, source)
    except RegoError as e:
        message = compiler_message(str(e), source)
        raise InvalidPolicy(f"the policy does not compile: {message}") from None
    rego.set_input_term("{}")
    try:
        _deny(rego, package, source)
    except _EvalError as e:
        raise InvalidPolicy(f"the policy fails on an empty plan: {e}") from None
    except RegoError as e:
        message = compiler_message(str(e), source)
        raise InvalidPolicy(f"the policy fails on an empty plan: {message}") from None


def evaluate(policies: Sequence[PolicySet], plan_json: dict[str, Any]) -> list[PolicyResult]:
    """Each set's verdict on the plan, in the order given."""
    return list(evaluate_each(policies, plan_json))


def evaluate_each(
    policies: Sequence[PolicySet], plan_json: dict[str, Any]
) -> Iterator[PolicyResult]:
    """Each set's verdict on the plan as soon as it is known, in the order given."""
    if not policies:
        return
    # Built once, set into each set's interpreter: converting the plan is most of the
    # cost on a large plan, and this beats rego-cpp parsing the JSON text each time.
    plan: Input | str
    try:
        if not _converts(plan_json):
            raise ValueError("an integer past 64 bits")  # Input would wrap it silently
        plan = Input(plan_json)
    except Exception:  # noqa: BLE001  # regopy cannot convert it: rego-cpp parses the JSON
        plan = json.dumps(plan_json, separators=(",", ":"))
    for policy in policies:
        yield _evaluate_one(policy, plan)


def _converts(value: Any) -> bool:
    """Whether regopy's Input keeps every value: its integers are 64-bit."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, int) and not isinstance(v, bool) and not _INT64[0] <= v <= _INT64[1]:
            return False
    return True


def _evaluate_one(policy: PolicySet, plan: Input | str) -> PolicyResult:
    def result(passed: bool, messages: list[str]) -> PolicyResult:
        return PolicyResult(
            name=policy.name,
            enforcement=policy.enforcement,
            scope=policy.scope,
            passed=passed,
            messages=bounded(messages),
        )

    package = package_of(policy.source)
    if not package:
        return result(False, [_POLICY_ERROR + "the policy has no `package` declaration"])
    rego = _interpreter()
    try:
        rego.add_module(f"{policy.name}.rego", policy.source)
        if isinstance(plan, str):
            rego.set_input_term(plan)
        else:
            rego.set_input(plan)
        messages = _deny(rego, package, policy.source)
    except RegoError as e:
        detail = compiler_message(str(e), policy.source)
        return result(False, [f"{_POLICY_ERROR}the policy could not be evaluated: {detail}"])
    except _EvalError as e:
        return result(False, [f"{_POLICY_ERROR}evaluating the policy failed: {e}"])
    except Exception as e:  # noqa: BLE001  # an answer regopy could not read: still a verdict
        what = f"{type(e).__name__}: {e}"
        return result(False, [f"{_POLICY_ERROR}evaluating the policy failed: {what}"])
    return result(not messages, messages)


# ---------------------------------------------------------------- the child


def child_main() -> None:
    """The child (`python -I -c ... <memory bytes> <cpu s> <uid> <gid>`): warm regopy up,
    confine itself, then answer the request on stdin, one line per answer. Exits
    EXIT_MEMORY on a MemoryError."""
    memory, cpu, uid, gid = (int(a) for a in sys.argv[1:5])
    # Before the confinement: rego-cpp's allocator maps its arena when it loads, and
    # nothing it loads lazily may be left to a user who cannot read the interpreter.
    warm_up()
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # a policy's print() writes to fd 1
    os.environ.clear()  # unsetenv: rego-cpp reads `environ` itself (opa.runtime().env)
    _confine(memory, cpu, uid, gid)
    answers.write(READY + b"\n")
    answers.flush()
    try:
        request = json.loads(sys.stdin.buffer.read())
        for answer in _answers(request):
            answers.write(msgspec.json.encode(answer) + b"\n")
            answers.flush()
    except MemoryError:
        os._exit(EXIT_MEMORY)


def warm_up() -> None:
    """Run a check and an evaluation once, so that everything they load is loaded."""
    compile_check("warm", 'package warm\ndeny contains "x" if { input.x == 1 }\n')
    evaluate([PolicySet(name="warm", enforcement="advisory", source="package w\ndeny := 1\n")], {})


def _confine(memory: int, cpu: int, uid: int, gid: int) -> None:
    """Caps, then (as root) an unprivileged identity; never goes on as root."""
    limits = {
        resource.RLIMIT_AS: _mapped_bytes() + memory,
        resource.RLIMIT_CPU: cpu,
        resource.RLIMIT_FSIZE: 0,
        resource.RLIMIT_CORE: 0,
        resource.RLIMIT_NOFILE: 16,
    }
    for which, value in limits.items():
        hard = value + 1 if which == resource.RLIMIT_CPU else value  # SIGXCPU, then SIGKILL
        resource.setrlimit(which, (value, hard))
    if os.geteuid() == 0:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    # Not dumpable: no other process of that uid may ptrace it or read its /proc files.
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise SystemExit("the policy evaluator cannot make itself non-dumpable")
    if 0 in (*os.getresuid(), *os.getresgid()):
        raise SystemExit("the policy evaluator refuses to run policies as root")


def _mapped_bytes() -> int:
    """The address space mapped now (VmSize): what the memory cap is added to."""
    with open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(b"VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def _answers(request: dict[str, Any]) -> Iterator[Checked | Verdict]:
    """The answers to a request; MemoryError where rego-cpp ran out of memory."""
    if request["op"] == "check":
        try:
            compile_check(request["name"], request["source"])
        except InvalidPolicy as e:
            _raise_if_out_of_memory(str(e))
            yield Checked(invalid=str(e)[:MAX_ERROR])
        else:
            yield Checked()
        return
    sets = [
        PolicySet(name=p["name"], enforcement="advisory", source=p["source"])
        for p in request["policies"]
    ]
    for result in evaluate_each(sets, request["plan"]):
        for message in result.messages if not result.passed else []:
            if message.startswith(_POLICY_ERROR):
                _raise_if_out_of_memory(message)
        yield Verdict(passed=result.passed, messages=result.messages)


def _raise_if_out_of_memory(error: str) -> None:
    """rego-cpp answers some failed allocations as an error of the query, not an abort:
    that is the memory cap too."""
    if "std::bad_alloc" in error:
        raise MemoryError(error)


# ---------------------------------------------------------------- regopy


class _EvalError(Exception):
    """The query answered with errors instead of a value."""


def _interpreter() -> Interpreter:
    rego = Interpreter()
    rego.log_level = LogLevel.NONE  # else rego-cpp prints compile errors to stdout
    return rego


def _deny(rego: Interpreter, package: str, source: str) -> list[str]:
    """The messages of `data.<package>.deny`; _EvalError with the errors if it failed."""
    # Not `Interpreter.query`: its Output parses the answer as JSON, which an error
    # answer (an s-expression) is not.
    out = rego_query(rego._impl, f"data.{package}.deny")
    try:
        return _answer(out, source)
    finally:
        rego_free_output(out)


def _answer(out: Any, source: str) -> list[str]:
    text = rego_output_string(out) if rego_output_ok(out) else ""
    if text == "undefined":
        return []
    if text and not text.startswith("("):  # an error answer is an s-expression
        try:
            answer = json.loads(text)
        except ValueError:
            # rego-cpp writes some computed strings unescaped (`sprintf("%s", [concat(..)])`
            # gives `"1 "xy""`): read the value from its nodes instead.
            return _messages(_first_term(rego_output_node(out)))
        if isinstance(answer, dict):
            expressions = answer.get("expressions") or [None]
            return _messages(expressions[0])
    raise _EvalError(_error_text(out, text, source))


def _first_term(root: Any) -> Any:
    """The value of the first expression of the first result (Results > Result > Terms)."""
    node = root
    for kind in (NodeKind.Results, NodeKind.Result, NodeKind.Terms):
        if rego_node_type(node) != kind or rego_node_size(node) == 0:
            return None
        node = rego_node_get(node, 0)
    return _value(node, 0)


def _value(node: Any, depth: int) -> Any:
    """A rego-cpp node as a Python value."""
    kind = rego_node_type(node)
    if depth > 64:
        return None
    if kind in (NodeKind.Term, NodeKind.Scalar):
        return _value(rego_node_get(node, 0), depth + 1)
    children = [rego_node_get(node, i) for i in range(rego_node_size(node))]
    if kind in (NodeKind.Array, NodeKind.Set):
        return [_value(c, depth + 1) for c in children]
    if kind == NodeKind.Object:  # children are ObjectItems: key, value
        pairs = [(rego_node_get(c, 0), rego_node_get(c, 1)) for c in children]
        return {_text(_value(k, depth + 1)): _value(v, depth + 1) for k, v in pairs}
    if kind == NodeKind.String:
        return _string(rego_node_value(node))
    if kind == NodeKind.Int:
        return int(rego_node_value(node))
    if kind == NodeKind.Float:
        return float(rego_node_value(node))
    if kind == NodeKind.Boolean:
        return rego_node_value(node) == "true"
    return None


def _string(raw: str) -> str:
    """A string node's value: rego-cpp keeps some as their JSON literal, some bare."""
    if len(raw) >= 2 and raw[0] == raw[-1] == '"':
        try:
            decoded = json.loads(raw)
        except ValueError:
            return raw
        if isinstance(decoded, str):
            return decoded
    return raw


def _messages(value: Any) -> list[str]:
    match value:
        case None | False:
            return []
        case True:
            return ["denied"]
        case str():
            return [value]
        case list():
            return [_text(v) for v in value]
        case dict():
            return [k for k, v in value.items() if v not in (False, None)]
        case _:
            return [_text(value)]


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def _error_text(out: Any, text: str, source: str) -> str:
    """The messages (and codes) of an error answer."""
    found: list[str] = []

    def walk(node: Any, depth: int = 0) -> None:
        if depth > 8:
            return
        if node.kind in (NodeKind.ErrorMessage, NodeKind.ErrorCode):
            try:
                value = rego_node_value(node._impl)
            except RegoError:
                value = ""
            if value:
                found.append(value if node.kind == NodeKind.ErrorMessage else f"({value})")
            return
        if node.kind in (NodeKind.ErrorSeq, NodeKind.Error):
            for i in range(len(node)):
                walk(node.at(i), depth + 1)

    try:
        walk(Node(rego_output_node(out)))
    except (RegoError, ValueError):
        pass
    if found:
        return " ".join(found)
    if text:
        return compiler_message(text, source)
    return "the interpreter reported an error"


def compiler_message(raw: str, source: str) -> str:
    """rego-cpp's error sequence (`(error 8:p.rego|31|2 (errormsg 16:this is unclosed)
    ...)`) as `p.rego:2:22: this is unclosed` lines; the raw text if it has none."""
    data, src = raw.encode(), source.encode()
    lines: list[str] = []
    pos = 0
    while m := _ERROR.search(data, pos):
        pos = m.end()
        where = ""
        if m.group(1):
            n = int(m.group(1))
            module = data[pos : pos + n].decode(errors="replace")
            pos += n
            loc = _LOCATION.match(data, pos)
            if loc:
                where = f"{module}:{_line_col(src, int(loc.group(1)))}: "
                pos = loc.end()
        msg = _ERRORMSG.search(data, pos)
        if msg is None:
            break
        n = int(msg.group(1))
        text = data[msg.end() : msg.end() + n].decode(errors="replace")
        pos = msg.end() + n
        line = where + text
        if line not in lines:
            lines.append(line)
    return "\n".join(lines) if lines else raw.strip()


def _line_col(src: bytes, offset: int) -> str:
    offset = max(0, min(offset, len(src)))
    line = src.count(b"\n", 0, offset) + 1
    col = offset - (src.rfind(b"\n", 0, offset) + 1) + 1
    return f"{line}:{col}"
