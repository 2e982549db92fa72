"""`runplane stack list | show | create | set | delete`: stacks from the command line
(services/surfaces/api/stacks.py).

`create NAME --workspace A --workspace B --edge A:B` makes stack NAME of A and B where B
depends on A (`--edge SOURCE:TARGET`, repeatable); `set NAME ...` replaces its whole
definition with the same flags; `--failure-policy pause|abort|continue`.

`run NAME --type plan|apply|destroy [--target WS ...] [--skip-dependencies]
[--failure-policy P]` starts a stack run; `run-show ID` shows one; `resume ID` resumes a
paused, failed or aborted one.
"""

from __future__ import annotations

import argparse
from typing import Any, Protocol

from events.codec import valid_id
from services.surfaces.client.errors import ClientError
from services.surfaces.client.http import Api
from services.surfaces.client.output import short


class Session(Protocol):
    """What a command gets of commands.py's `Session` (which imports this module)."""

    api: Api

    async def org(self) -> str: ...

    def show(self, data: Any, lines: list[str]) -> None: ...


POLICIES = ("pause", "abort", "continue")


def add_parsers(sub: Any, leaf: Any) -> None:
    """`stack` and its actions under `runplane` (`leaf`: commands.py's `_leaf`)."""
    stack = sub.add_parser("stack", help="list, show, create, change or delete stacks")
    ssub = stack.add_subparsers(dest="action", required=True, metavar="ACTION")
    leaf(ssub, "list", stack_list, "the organization's stacks")
    leaf(ssub, "show", stack_show, "one stack, with its DAG levels").add_argument("stack")
    leaf(ssub, "delete", stack_delete, "delete a stack").add_argument("stack")
    for name, handler, what in (
        ("create", stack_create, "make a stack"),
        ("set", stack_set, "replace a stack's definition"),
    ):
        p = leaf(ssub, name, handler, what)
        p.add_argument("stack")
        p.add_argument("--workspace", action="append", default=[], help="a node (repeatable)")
        p.add_argument(
            "--edge",
            action="append",
            default=[],
            metavar="SOURCE:TARGET",
            help="TARGET depends on SOURCE (repeatable)",
        )
        p.add_argument("--failure-policy", choices=POLICIES, default="pause")
    p = leaf(ssub, "run", stack_run, "run a stack in dependency order")
    p.add_argument("stack")
    p.add_argument("--type", choices=("plan", "apply", "destroy"), default="plan")
    p.add_argument("--target", action="append", default=[], help="only these (repeatable)")
    p.add_argument("--skip-dependencies", action="store_true",
                   help="the targets alone, not what they need first")  # fmt: skip
    p.add_argument("--failure-policy", choices=POLICIES, default=None)
    leaf(ssub, "run-show", run_show, "one stack run, its nodes and runs").add_argument("id")
    leaf(ssub, "resume", run_resume, "resume a paused, failed or aborted stack run").add_argument(
        "id"
    )


def _definition(ns: argparse.Namespace) -> dict[str, Any]:
    edges = []
    for e in ns.edge:
        source, sep, target = str(e).partition(":")
        if not sep or not source or not target:
            raise ClientError(f"--edge {e!r} is not SOURCE:TARGET", kind="bad-input")
        edges.append({"source": source, "target": target})
    return {"workspaces": ns.workspace, "edges": edges, "failure_policy": ns.failure_policy}


def lines(stack: dict[str, Any]) -> list[str]:
    """A stack as people read it: its name and policy, then a line per DAG level."""
    out = [
        f"stack {short(str(stack.get('name', '')))}  "
        f"failure_policy={short(str(stack.get('failure_policy', '')))}"
    ]
    for i, level in enumerate(stack.get("levels") or []):
        out.append(f"  level {i}: {short(' '.join(str(w) for w in level))}")
    return out


def checked(what: str, value: str) -> str:
    if not valid_id(value):
        raise ClientError(f"{what} {value!r} is not a valid name", kind="bad-input")
    return value


def _path(org: str, name: str = "") -> str:
    return f"/api/v1/orgs/{org}/stacks" + (f"/{name}" if name else "")


async def stack_list(s: Session, ns: argparse.Namespace) -> int:
    page = await s.api.get(_path(await s.org()))
    rows = page.get("items", []) if isinstance(page, dict) else []
    s.show(page, [line for r in rows for line in lines(r)] or ["no stacks"])
    return 0


async def stack_show(s: Session, ns: argparse.Namespace) -> int:
    row = await s.api.get(_path(await s.org(), checked("stack", ns.stack)))
    s.show(row, lines(row) if isinstance(row, dict) else [])
    return 0


async def stack_create(s: Session, ns: argparse.Namespace) -> int:
    body = {"name": checked("stack", ns.stack), **_definition(ns)}
    answer = await s.api.post(_path(await s.org()), body)
    s.show(answer.body, lines(answer.body) if isinstance(answer.body, dict) else [])
    return 0


async def stack_set(s: Session, ns: argparse.Namespace) -> int:
    path = _path(await s.org(), checked("stack", ns.stack))
    answer = await s.api.call("PUT", path, json=_definition(ns))
    s.show(answer.body, lines(answer.body) if isinstance(answer.body, dict) else [])
    return 0


async def stack_delete(s: Session, ns: argparse.Namespace) -> int:
    await s.api.call("DELETE", _path(await s.org(), checked("stack", ns.stack)))
    s.show({"deleted": ns.stack}, [f"stack {short(ns.stack)} deleted"])
    return 0


def run_lines(r: dict[str, Any]) -> list[str]:
    """A stack run as people read it: its status, then a line per level, each node with
    its status and run."""
    out = [f"stack run {short(str(r.get('id', '')))} {short(str(r.get('stack', '')))}  "
           f"{short(str(r.get('type', '')))}  {short(str(r.get('status', '')))}"]  # fmt: skip
    nodes = r.get("nodes") if isinstance(r.get("nodes"), dict) else {}
    for i, level in enumerate(r.get("levels") or []):
        said = []
        for w in level:
            n = nodes.get(w) if isinstance(nodes, dict) else None
            n = n if isinstance(n, dict) else {}
            said.append(
                f"{w}={n.get('status', '?')}" + (f"({n['run_id']})" if n.get("run_id") else "")
            )
        out.append(f"  level {i}: {short(' '.join(said))}")
    return out


async def stack_run(s: Session, ns: argparse.Namespace) -> int:
    body: dict[str, Any] = {"type": ns.type, "targets": [checked("target", t) for t in ns.target],
                            "skip_dependencies": ns.skip_dependencies}  # fmt: skip
    if ns.failure_policy:
        body["failure_policy"] = ns.failure_policy
    answer = await s.api.post(_path(await s.org(), checked("stack", ns.stack)) + "/runs", body)
    s.show(answer.body, run_lines(answer.body) if isinstance(answer.body, dict) else [])
    return 0


async def run_show(s: Session, ns: argparse.Namespace) -> int:
    row = await s.api.get(f"/api/v1/orgs/{await s.org()}/stack-runs/{checked('id', ns.id)}")
    s.show(row, run_lines(row) if isinstance(row, dict) else [])
    return 0


async def run_resume(s: Session, ns: argparse.Namespace) -> int:
    path = f"/api/v1/orgs/{await s.org()}/stack-runs/{checked('id', ns.id)}/resume"
    answer = await s.api.post(path, {})
    s.show(answer.body, run_lines(answer.body) if isinstance(answer.body, dict) else [])
    return 0
