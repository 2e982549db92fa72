"""Change review: what a saved plan will do, resource by resource, from `terraform show -json`.

Terraform's JSON plan carries every value in clear, sensitive ones included, with
`before_sensitive` / `after_sensitive` saying which are sensitive. Those become exactly
`(sensitive)` here, before anything leaves this module; the JSON itself is read from the
child's pipe and never written to a log or a file.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import msgspec

from events.values import SENSITIVE, AttributeChange, ResourceChange
from executor import process
from executor import terraform as tf
from executor.errors import StepFailed
from executor.isolation import Jail
from executor.output import Masker
from executor.terraform import Terraform

UNKNOWN = "(known after apply)"
VALUE_LIMIT = 4096  # bytes of JSON per value shown: the plan event stays small
CHANGES_BUDGET = 1024 * 1024  # bytes of JSON for all the changes of one plan event
_encode = msgspec.json.Encoder().encode

_ACTIONS = {
    ("create",): "create",
    ("update",): "update",
    ("delete",): "delete",
    ("delete", "create"): "replace",
    ("create", "delete"): "replace",
    ("read",): "read",
    ("no-op",): "no-op",
}
_SKIPPED = "no-op"


def action_of(actions: list[str]) -> str:
    """One word for Terraform's action list; an unknown combination is kept, joined."""
    return _ACTIONS.get(tuple(actions), "-".join(actions) or _SKIPPED)


def plan_changes(show: dict[str, Any], *, drift: bool = False) -> list[ResourceChange]:
    """The resources a plan changes (`resource_changes`; `resource_drift` for a drift run).

    They travel in the plan's event: past `CHANGES_BUDGET` they lose their attributes
    (addresses, actions and replace_paths stay), and each value is bounded on its own.
    """
    items = show.get("resource_drift" if drift else "resource_changes") or []
    changes = [c for c in (resource_change(item) for item in items) if c.action != _SKIPPED]
    if len(_encode(changes)) <= CHANGES_BUDGET:
        return changes
    return [msgspec.structs.replace(c, attributes=[]) for c in changes]


def resource_change(item: dict[str, Any]) -> ResourceChange:
    """One entry of `resource_changes`, with sensitive values masked."""
    change = item.get("change") or {}
    paths = [render_path(p) for p in change.get("replace_paths") or []]
    forcing = {_root(p) for p in change.get("replace_paths") or [] if p}
    return ResourceChange(
        address=str(item.get("address", "")),
        type=str(item.get("type", "")),
        name=str(item.get("name", "")),
        module=str(item.get("module_address", "")),
        action=action_of(list(change.get("actions") or [])),
        attributes=attribute_changes(change, forcing),
        replace_paths=paths,
    )


def attribute_changes(change: dict[str, Any], forcing: set[str]) -> list[AttributeChange]:
    """Top-level attributes whose value changes or becomes known only after apply."""
    before, after = _object(change.get("before")), _object(change.get("after"))
    unknown = change.get("after_unknown")
    out = []
    for name in sorted(set(before) | set(after) | set(_object(unknown))):
        pending = _member(unknown, name)
        if before.get(name) == after.get(name) and not _any_true(pending):
            continue
        out.append(
            AttributeChange(
                name=name,
                before=_shown(
                    mask(before.get(name), _member(change.get("before_sensitive"), name))
                ),
                after=_shown(
                    mask(
                        with_unknown(after.get(name), pending),
                        _member(change.get("after_sensitive"), name),
                    )
                ),
                forces_replacement=name in forcing,
            )
        )
    return out


def _shown(value: Any) -> Any:
    """The value, or a note of its size if it is too large for an event."""
    size = len(_encode(value))
    return value if size <= VALUE_LIMIT else f"({size} bytes, too large to show)"


def mask(value: Any, sensitive: Any) -> Any:
    """`value` with every part that `sensitive` marks (true, nested too) as `(sensitive)`."""
    if sensitive is True:
        return SENSITIVE
    if isinstance(value, dict) and isinstance(sensitive, dict):
        return {k: mask(v, sensitive.get(k)) for k, v in value.items()}
    if isinstance(value, list) and isinstance(sensitive, list):
        return [mask(v, sensitive[i] if i < len(sensitive) else None) for i, v in enumerate(value)]
    return value


def with_unknown(value: Any, unknown: Any) -> Any:
    """`value` with every part that `unknown` marks (true, nested too) as known after apply."""
    if unknown is True:
        return UNKNOWN
    if isinstance(unknown, dict) and unknown:
        merged = dict(value) if isinstance(value, dict) else {}
        for key, u in unknown.items():
            merged[key] = with_unknown(merged.get(key), u)
        return merged
    if isinstance(unknown, list) and unknown:
        items = list(value) if isinstance(value, list) else []
        items += [None] * (len(unknown) - len(items))
        return [
            with_unknown(v, unknown[i] if i < len(unknown) else None) for i, v in enumerate(items)
        ]
    return value


def render_path(path: list[Any]) -> str:
    """A `replace_paths` entry as text: `ami`, `tags.name`, `ingress[0].cidr`."""
    text = ""
    for step in path:
        if isinstance(step, int):
            text += f"[{step}]"
        else:
            text += f".{step}" if text else str(step)
    return text


def _root(path: list[Any]) -> str:
    return str(path[0])


def _object(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _member(marks: Any, name: str) -> Any:
    """The marks (sensitive / unknown) of attribute `name`: all of it if `marks` is true."""
    if marks is True:
        return True
    return marks.get(name) if isinstance(marks, dict) else None


def _any_true(marks: Any) -> bool:
    if marks is True:
        return True
    if isinstance(marks, dict):
        return any(_any_true(v) for v in marks.values())
    if isinstance(marks, list):
        return any(_any_true(v) for v in marks)
    return False


# ---------------------------------------------------------------- running `show`


async def show_plan(
    terraform: Terraform, jail: Jail | None, masker: Masker, workdir: Path
) -> dict[str, Any]:
    """`terraform show -json` of the saved plan in `workdir`, parsed, run as the job
    (`jail`: it starts the workspace's providers); the JSON goes to no log or file, and
    what it says on failure is masked."""
    proc = await process.spawn(
        terraform.argv(*tf.show_args()),
        cwd=workdir,
        env=terraform.env(),
        jail=jail,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await proc.communicate()
    except BaseException:
        if proc.returncode is None:  # show changes nothing: no grace period needed
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        raise
    if proc.returncode != 0:
        detail = masker(err.decode(errors="replace").strip()[-2000:])
        raise StepFailed("plan", f"terraform show failed (exit {proc.returncode}): {detail}")
    try:
        return dict(json.loads(out))
    except ValueError as e:
        raise StepFailed("plan", f"terraform show printed no JSON plan: {e}") from e
