"""structlog, configured once per process: JSON lines, readable console output, or the
short lines `runplane up` shows a person.

`people` (what `up` picks on a terminal) keeps only what a person watching wants: one
line per run transition (`run_transition`, services/processes/runwatch.py) and every warning and
error, each on one short line; the rest (a line per HTTP request, per projected batch)
is for machines, in JSON (`--log-format json`, or whenever stderr is not a terminal).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

FORMATS = ("auto", "json", "console", "people")
TRANSITION = "run_transition"
_LOUD = frozenset({"warning", "error", "critical", "exception"})
_SHOWN_FIRST = ("org", "workspace", "run_id")


def choose(fmt: str, *, for_people: bool, tty: bool) -> str:
    """The format `auto` means: for a person's command (`up`) short lines on a terminal,
    elsewhere console output on a terminal; JSON when stderr is not a terminal."""
    if fmt != "auto":
        return fmt
    if not tty:
        return "json"
    return "people" if for_people else "console"


def only_for_people(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Drop what is not a run transition, a warning or an error."""
    if event.get("event") == TRANSITION or event.get("level") in _LOUD:
        return event
    raise structlog.DropEvent


def people_line(_: Any, __: str, event: MutableMapping[str, Any]) -> str:
    """`11:43:07  run 01m8… demo/hello  planning` or `11:43:07  warning  what  k=v ...`."""
    at = str(event.pop("timestamp", ""))[11:19]
    name = event.pop("event", "")
    level = event.pop("level", "")
    if name == TRANSITION:
        where = f"{event.pop('org', '')}/{event.pop('workspace', '')}"
        line = f"{at}  run {event.pop('run_id', '')} {where}  {event.pop('status', '')}"
    else:
        line = f"{at}  {level}  {name}"
    first = [k for k in _SHOWN_FIRST if k in event]
    rest = [*first, *sorted(k for k in event if k not in first)]
    extra = " ".join(f"{k}={_short(event[k])}" for k in rest if event[k] not in (None, ""))
    return f"{line}  {extra}" if extra else line


def _short(value: Any, limit: int = 200) -> str:
    """One line of printable text: a value may be a tenant's (a run's error is its
    Terraform's output), and an escape sequence written raw to an operator's terminal
    could retitle it, rewrite what it shows or set its clipboard."""
    text = "".join(ch if ch.isprintable() else _escaped(ch) for ch in str(value))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _escaped(ch: str) -> str:
    return " " if ch == "\n" else ch.encode("unicode_escape").decode("ascii")


def configure(fmt: str = "auto", level: str = "info", *, for_people: bool = False) -> str:
    """Configure structlog and the stdlib root logger; return the format chosen.

    `fmt` is one of FORMATS (see `choose` for `auto`). Logs go to stderr so that stdout
    stays for what a command prints for people.
    """
    chosen = choose(fmt, for_people=for_people, tty=sys.stderr.isatty())
    processors: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
    ]
    if chosen == "people":
        processors.append(only_for_people)
    processors += [
        structlog.processors.TimeStamper(fmt="iso", utc=chosen != "people"),
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
        _renderer(chosen),
    ]
    lvl = getattr(logging, level.upper(), logging.INFO)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=max(lvl, logging.WARNING), stream=sys.stderr)
    return chosen


def _renderer(fmt: str) -> structlog.types.Processor:
    if fmt == "json":
        return structlog.processors.JSONRenderer()
    if fmt == "people":
        return people_line
    return structlog.dev.ConsoleRenderer()
