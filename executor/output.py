"""Reading what a command prints: Terraform's `-json` UI stream or plain text.

A step's output can be large, so nothing here keeps all of it: the full text goes to the
step's log file, and `Output` keeps only what the events need (error diagnostics, the
change summary and the last lines, readable).
"""

from __future__ import annotations

import json
import re
from collections import deque
from collections.abc import Iterable
from typing import Any

import msgspec

from events.policies import PolicyResult
from events.run import FailRun, FinishPlan, FinishStep, PlanSummary, ReportResource, RunCommand
from events.values import AttributeChange, ResourceChange

TAIL_LINES = 40
MAX_MESSAGE = 8000  # events stay small; the full text is in the step's log object

_URL_CREDENTIALS = re.compile(r"(?<=://)[^/@\s]+@")
HIDDEN = "***"
# A line of a multi-line secret shorter than this is too common to hide wherever it
# appears (`-----`, `}`): it is hidden only where it stands as a whole line.
MIN_LINE_SECRET = 8
_LINE_BREAK = re.compile(r"\r\n|\r|\n")
# Terraform's prefix of a provisioner's output line (`null_resource.x: (local-exec): ...`).
_PROVISIONER_PREFIX = re.compile(r"^.*?\((?:local|remote)-exec\): ")


class Masker:
    """Hides credentials before text leaves the executor (log object, events, logging).

    URLs with a user and password (`https://user:token@host/`) lose their user info, and
    every secret value becomes `***` in each form a tool of a run prints it in
    (`secret_forms`): Terraform (its `-json` UI, its diagnostics, its plain UI), a shell
    (`echo`, `printenv`, `cat` of a file) and the JSON encoders of Go and Python. Each
    line of a multi-line value is hidden on its own too, since logs are read line by line.

    Out of reach, by design: a value the tenant's own code transforms on purpose (base64,
    hex, reversed, cut in pieces) is no longer that value; masking guards against a tool
    disclosing a secret by accident, not against the code that was given the secret.
    """

    def __init__(self, secrets: list[str] | None = None) -> None:
        self.values: frozenset[str] = frozenset()
        self.forms: list[str] = []  # longest first: a secret containing another goes whole
        self.lines: frozenset[str] = frozenset()  # short lines, hidden as whole lines only
        self.add(secrets or [])

    @property
    def secrets(self) -> list[str]:
        """The secret values this masker hides (as given, not their forms)."""
        return sorted(self.values)

    def add(self, secrets: Iterable[str]) -> None:
        """Hide these too from now on, also in the logs that already use this masker."""
        self.values = self.values | {s for s in secrets if s}
        forms: set[str] = set()
        lines: set[str] = set()
        for value in self.values:
            everywhere, whole = secret_forms(value)
            forms |= everywhere
            lines |= whole
        self.forms = sorted(forms, key=len, reverse=True)
        self.lines = frozenset(lines - forms)

    def with_values(self, secrets: Iterable[str]) -> Masker:
        """A masker hiding what this one hides and `secrets` (this one is unchanged)."""
        return Masker([*self.values, *secrets])

    def __call__(self, text: str) -> str:
        text = _URL_CREDENTIALS.sub("***@", text)
        for form in self.forms:
            if form in text:
                text = text.replace(form, HIDDEN)
        if self.lines:
            text = "".join(self._whole_line(line) for line in text.splitlines(keepends=True))
        return text

    def _whole_line(self, line: str) -> str:
        body = line.rstrip("\r\n")
        core = body.strip()
        if core in self.lines:
            return line.replace(core, HIDDEN)
        prefix = _PROVISIONER_PREFIX.match(body)
        if prefix and body[prefix.end() :].strip() in self.lines:
            return body[: prefix.end()] + HIDDEN + line[len(body) :]
        return line


def secret_forms(value: str) -> tuple[set[str], set[str]]:
    """The forms of a secret value to hide wherever they appear, and the short lines of a
    multi-line value to hide only where they stand as a whole line.

    The value and each of its lines (a multi-line value is printed line by line by
    `echo`, `printenv`, a provisioner), each as it is, quoted Go's way (`%q`: Terraform's
    diagnostics, `cannot convert "..."`), and quoted HCL's way (Terraform's plain UI:
    `\"`, `\\`, `\n`, `$${`); and each of these as it appears inside a JSON string written
    by Go (Terraform's `-json` and `show -json`: `<>&` as `\u003c\u003e\u0026`, U+2028 and
    U+2029 escaped; `\b \f` as `\u0008 \u000c` before Go 1.22) or by Python's json
    (ASCII-only or not). So a diagnostic quoting a value inside a `-json` line (`%q` inside
    JSON) is covered too. A line is taken without its surrounding blanks: a substring of
    every form of the whole line.
    """
    parts = {value}
    short: set[str] = set()
    if _LINE_BREAK.search(value):
        for line in _LINE_BREAK.split(value):
            core = line.strip()
            if len(core) >= MIN_LINE_SECRET:
                parts.add(core)
            elif core:
                short.add(core)
    forms = set()
    for part in parts:
        for quoted in (part, go_quoted(part), hcl_quoted(part)):
            forms.update(json_forms(quoted))
    return {f for f in forms if f}, short


def json_forms(text: str) -> set[str]:
    """`text` as it is and as the inside of a JSON string, by Go and by Python."""
    return {
        text,
        json.dumps(text)[1:-1],
        json.dumps(text, ensure_ascii=False)[1:-1],
        go_json(text, legacy=True),
        go_json(text, legacy=False),
    }


_GO_QUOTE = {
    "\a": "\\a",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
    "\v": "\\v",
    '"': '\\"',
    "\\": "\\\\",
}


def go_quoted(text: str) -> str:
    """The inside of Go's `strconv.Quote(text)` (`%q`): printable runes as they are."""
    return "".join(_GO_QUOTE.get(ch) or _go_rune(ch) for ch in text)


def _go_rune(ch: str) -> str:
    if ch.isprintable():  # Python's and Go's notions of printable agree
        return ch
    code = ord(ch)
    if code < 0x80:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


_HCL_QUOTE = {"\n": "\\n", "\r": "\\r", "\t": "\\t", '"': '\\"', "\\": "\\\\"}


def hcl_quoted(text: str) -> str:
    """The inside of a quoted HCL string literal of `text` (hclwrite's escaping)."""
    out = []
    for i, ch in enumerate(text):
        if ch in _HCL_QUOTE:
            out.append(_HCL_QUOTE[ch])
        elif ch in "$%" and text[i + 1 : i + 2] == "{":
            out.append(ch + ch)  # `${` and `%{` would start a template sequence
        elif ch.isprintable():
            out.append(ch)
        else:
            code = ord(ch)
            out.append(f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}")
    return "".join(out)


_GO_JSON = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
_GO_JSON_HTML = {
    "<": "\\u003c",
    ">": "\\u003e",
    "&": "\\u0026",
    "\u2028": "\\u2028",
    "\u2029": "\\u2029",
}
_GO_JSON_NEW = {"\b": "\\b", "\f": "\\f"}  # since Go 1.22


def go_json(text: str, *, legacy: bool) -> str:
    """The inside of Go's `encoding/json` string for `text` (HTML-safe, its default)."""
    table = {**_GO_JSON, **_GO_JSON_HTML, **({} if legacy else _GO_JSON_NEW)}
    out = []
    for ch in text:
        if ch in table:
            out.append(table[ch])
        elif ord(ch) < 0x20:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "".join(out)


def masked_command(mask: Masker, command: RunCommand) -> RunCommand:
    """`command` with its free text masked: the last pass before a report leaves.

    Messages were built from output already masked line by line, but some of it was
    decoded on the way (a `-json` record's message, a diagnostic) and a plan's changes
    come from `show -json` unmasked (a secret variable Terraform does not know to be
    sensitive is shown in clear there). Ids, addresses and digests are never touched.
    """
    replace = msgspec.structs.replace
    match command:
        case FailRun() if command.message:
            return replace(command, message=mask(command.message))
        case FinishStep() | ReportResource() if command.error:
            return replace(command, error=mask(command.error))
        case FinishPlan():
            return replace(
                command,
                commit_message=mask(command.commit_message),
                changes=[_masked_change(mask, c) for c in command.changes],
                policies=[_masked_policy(mask, p) for p in command.policies],
            )
    return command


def _masked_change(mask: Masker, change: ResourceChange) -> ResourceChange:
    attributes = [
        AttributeChange(
            name=a.name,
            before=masked_value(mask, a.before),
            after=masked_value(mask, a.after),
            forces_replacement=a.forces_replacement,
        )
        for a in change.attributes
    ]
    return msgspec.structs.replace(change, attributes=attributes)


def _masked_policy(mask: Masker, result: PolicyResult) -> PolicyResult:
    return msgspec.structs.replace(result, messages=[mask(m) for m in result.messages])


def masked_value(mask: Masker, value: Any) -> Any:
    """A JSON value with every string in it (keys too) masked."""
    if isinstance(value, str):
        return mask(value)
    if isinstance(value, dict):
        return {mask(str(k)): masked_value(mask, v) for k, v in value.items()}
    if isinstance(value, list):
        return [masked_value(mask, v) for v in value]
    return value


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
