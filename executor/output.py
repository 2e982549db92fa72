"""Reading what a command prints: Terraform's `-json` UI stream or plain text.

A step's output can be large, so nothing here keeps all of it: the full text goes to the
step's log file, and `Output` keeps only what the events need (error diagnostics, the
change summary and the last lines, readable).
"""

from __future__ import annotations

import json
import re
from collections import deque
from typing import Any

from events.run import PlanSummary

TAIL_LINES = 40
MAX_MESSAGE = 8000  # events stay small; the full text is in the step's log object

_URL_CREDENTIALS = re.compile(r"(?<=://)[^/@\s]+@")


class Masker:
    """Hides credentials before a line leaves the executor (log object, events, logging).

    URLs with a user and password (`https://user:token@host/`) lose their user info;
    any value in `secrets` becomes `***`.
    """

    def __init__(self, secrets: list[str] | None = None) -> None:
        # Longest first so that a secret containing another is hidden whole.
        self.secrets = sorted((s for s in secrets or [] if s), key=len, reverse=True)

    def add(self, secrets: list[str]) -> None:
        """Hide these too from now on, also in the logs that already use this masker."""
        self.secrets = sorted({*self.secrets, *(s for s in secrets if s)}, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        text = _URL_CREDENTIALS.sub("***@", text)
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return text


class Output:
    """Collects what matters from a command's output, line by line."""

    def __init__(self) -> None:
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.diagnostics: list[dict[str, Any]] = []
        self.changes: dict[str, Any] | None = None
        self.last_line = ""

    def feed(self, line: str) -> None:
        """Take one (already masked) line of output."""
        line = line.rstrip("\r\n")
        self.last_line = line or self.last_line
        record = _json_record(line)
        if record is None:
            self.tail.append(line)
            return
        self.tail.append(str(record.get("@message", line)))
        kind = record.get("type")
        if kind == "diagnostic" and record.get("@level") == "error":
            self.diagnostics.append(record.get("diagnostic") or {})
        elif kind == "change_summary":
            self.changes = record.get("changes") or {}

    def summary(self) -> PlanSummary:
        """The counts of Terraform's `change_summary` message (zero if it printed none)."""
        c = self.changes or {}
        return PlanSummary(
            add=int(c.get("add", 0)),
            change=int(c.get("change", 0)),
            destroy=int(c.get("remove", 0)),
        )

    def error_text(self) -> str:
        """Terraform's error diagnostics, else the text from the first `Error:`, else the tail."""
        if self.diagnostics:
            return _clip("\n\n".join(format_diagnostic(d) for d in self.diagnostics))
        lines = list(self.tail)
        for i, line in enumerate(lines):
            if line.startswith(("Error:", "error:", "fatal:")):
                return _clip("\n".join(lines[i:]).strip())
        return _clip("\n".join(lines).strip())

    def tail_text(self) -> str:
        return _clip("\n".join(self.tail).strip())


def format_diagnostic(d: dict[str, Any]) -> str:
    """One diagnostic the way Terraform prints it: summary, where, detail."""
    parts = [f"Error: {d.get('summary', 'unknown error')}"]
    where = d.get("range") or {}
    if where.get("filename"):
        line = (where.get("start") or {}).get("line", "?")
        snippet = ((d.get("snippet") or {}).get("code") or "").strip()
        loc = f"  on {where['filename']} line {line}"
        parts.append(f"{loc}: {snippet}" if snippet else loc)
    if d.get("detail"):
        parts.append(str(d["detail"]))
    return "\n".join(parts)


def readable(line: str) -> str:
    """The human text of a line of Terraform's machine-readable (`-json`) output.

    The step log is for people: a JSON UI record becomes its message (a diagnostic the
    way Terraform prints it); any other line is kept as it is. Parsers get the JSON.
    """
    record = _json_record(line.rstrip("\r\n"))
    if record is None or "@message" not in record:
        return line
    if record.get("type") == "diagnostic":
        d = record.get("diagnostic") or {}
        text = format_diagnostic(d)
        if d.get("severity") == "warning":
            text = "Warning" + text.removeprefix("Error")
        return text
    return str(record["@message"])


def _json_record(line: str) -> dict[str, Any] | None:
    if not line.startswith("{"):
        return None
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _clip(text: str) -> str:
    if len(text) <= MAX_MESSAGE:
        return text
    return text[: MAX_MESSAGE - 20] + "\n... (truncated)"


def drift_summary(show: dict[str, Any]) -> PlanSummary:
    """Count a refresh-only plan's `resource_drift` (from `terraform show -json`) by action."""
    counts = {"create": 0, "update": 0, "delete": 0}
    for item in show.get("resource_drift") or []:
        for action in (item.get("change") or {}).get("actions") or []:
            if action in counts:
                counts[action] += 1
    return PlanSummary(add=counts["create"], change=counts["update"], destroy=counts["delete"])
