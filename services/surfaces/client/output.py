"""What the client prints: the API's JSON (`--json`), or short lines for a person.

Everything a server sends may be a tenant's (a run's message, a workspace's name, a
Terraform error) or the server's own lie: a person's line shows each value through the
people's log escaping (infra/logs.py), so an escape sequence in it is printed as
text, never written raw to the terminal. `--json` is encoded ASCII-only, so no control
character (C0 or C1) reaches the terminal there either.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, TextIO

from infra.logs import _short as short  # the people's log escaping, one rule for both

__all__ = ["dump", "run_detail", "run_line", "short", "workspace_detail", "workspace_line"]

LONG = 2000  # characters of an error shown by `run show`


def dump(out: TextIO, data: Any) -> None:
    """The API's JSON, as received, indented; ASCII-only (control characters escaped)."""
    print(json.dumps(data, indent=2, ensure_ascii=True), file=out, flush=True)


def _get(row: dict[str, Any], key: str) -> Any:
    value = row.get(key)
    return "" if value is None else value


def _summary(value: Any) -> str:
    if not isinstance(value, dict):
        return ""
    return f"+{value.get('add', 0)} ~{value.get('change', 0)} -{value.get('destroy', 0)}"


def now() -> str:
    return datetime.now().strftime("%H:%M:%S")


def run_line(row: dict[str, Any], at: str = "") -> str:
    """`11:43:07  run 01m8… acme/web  planning  reason=...`: the people's log line of a
    run's status (infra/logs.py `people_line`)."""
    where = f"{short(_get(row, 'org'))}/{short(_get(row, 'workspace'))}"
    line = f"{at or now()}  run {short(_get(row, 'id'))} {where}  {short(_get(row, 'status'))}"
    extra = {
        "type": _get(row, "type"),
        "plan": _summary(row.get("plan_summary")),
        "apply": _summary(row.get("apply_summary")),
        "reason": _get(row, "reason"),
        "error": _get(row, "error_message"),
    }
    shown = " ".join(f"{k}={short(v)}" for k, v in extra.items() if v not in ("", None))
    return f"{line}  {shown}" if shown else line


def listed_run(row: dict[str, Any]) -> str:
    """A line of `run list`: when it was created, then the run's line, then its message."""
    created = str(_get(row, "created_at")).replace("T", " ")[:19]
    line = run_line(row, at=short(created) or "-")
    message = _get(row, "message")
    return f"{line}  message={short(message, 80)}" if message else line


def _cause(value: Any) -> str:
    if not isinstance(value, dict):
        return ""
    kind = value.get("kind", "")
    rest = " ".join(f"{k}={v}" for k, v in value.items() if k != "kind" and v not in ("", 0))
    return f"{kind} {rest}".strip()


_RUN_FIELDS = (
    ("workspace", lambda r: f"{_get(r, 'org')}/{_get(r, 'workspace')}"),
    ("type", lambda r: _get(r, "type")),
    ("status", lambda r: _get(r, "status")),
    ("cause", lambda r: _cause(r.get("cause"))),
    ("created", lambda r: f"{_get(r, 'created_at')} by {_get(r, 'created_by')}"),
    ("updated", lambda r: _get(r, "updated_at")),
    ("message", lambda r: _get(r, "message")),
    ("template", lambda r: _get(r, "template")),
    ("commit", lambda r: _get(r, "commit")),
    ("plan", lambda r: _summary(r.get("plan_summary"))),
    ("apply", lambda r: _summary(r.get("apply_summary"))),
    ("approved by", lambda r: _get(r, "approved_by")),
    ("reason", lambda r: _get(r, "reason")),
    ("step", lambda r: _get(r, "current_step")),
)


def run_detail(row: dict[str, Any]) -> list[str]:
    """`run show`: one `name  value` line per field that has a value."""
    lines = [f"run          {short(_get(row, 'id'))}"]
    for name, value_of in _RUN_FIELDS:
        value = value_of(row)
        if value not in ("", None):
            lines.append(f"{name:<12} {short(value)}")
    if row.get("error_message"):
        lines.append(f"{'error':<12} {short(row['error_message'], LONG)}")
    return lines


def workspace_line(row: dict[str, Any]) -> str:
    active = _get(row, "active_run")
    line = f"{short(_get(row, 'name'))}  {short(_get(row, 'repository'))}"
    line += f"  branch={short(_get(row, 'branch'))}"
    if _get(row, "directory"):
        line += f" directory={short(_get(row, 'directory'))}"
    if active:
        line += f" active_run={short(active)}"
    if row.get("lock"):
        line += " locked"
    return line


_WS_FIELDS = ("repository", "branch", "directory", "created_at", "created_by", "active_run")


def workspace_detail(row: dict[str, Any]) -> list[str]:
    lines = [f"workspace    {short(_get(row, 'org'))}/{short(_get(row, 'name'))}"]
    for name in _WS_FIELDS:
        if _get(row, name) not in ("", None):
            lines.append(f"{name:<12} {short(_get(row, name))}")
    lock = row.get("lock")
    if isinstance(lock, dict):
        lines.append(f"{'lock':<12} {short(_get(lock, 'holder'))}: {short(_get(lock, 'reason'))}")
    queue = row.get("queue")
    if isinstance(queue, list) and queue:
        lines.append(f"{'queue':<12} {short(' '.join(str(q) for q in queue))}")
    for kind in ("variables", "secret_variables"):
        values = row.get(kind)
        if isinstance(values, dict):
            for k, v in sorted(values.items()):
                lines.append(f"{kind[:-1].replace('_', ' '):<12} {short(k)}={short(v)}")
    return lines
