"""`runplane stack list | show | create | set | delete`: stacks from the command line
(services/surfaces/api/stacks.py).

`create NAME --workspace A --workspace B --edge A:B` makes stack NAME of A and B where B
depends on A (`--edge SOURCE:TARGET`, repeatable); `set NAME ...` replaces its whole
definition with the same flags; `--failure-policy pause|abort|continue`.
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
