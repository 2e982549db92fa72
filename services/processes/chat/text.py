"""What a Slack user types, and what runplane says back. Pure: no I/O.

A slash command's text is parsed into a `Parsed` command or a `BadCommand` whose message
is the reply: never a traceback, whatever the text (control characters, a path, a
megabyte of emoji). Everything runplane did not write itself (a run's message, a user's
name, the text the user typed, an address) is escaped for Slack's mrkdwn before it is
shown, so `<!channel>`, `<@U1>` or `<http://evil|click>` in a run's message is shown as
typed and pings or links nobody.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import msgspec

from events.codec import valid_id
from events.run import Status

MAX_TEXT = 1000  # the longest command text taken (Slack's own limit is about 4,000)
MAX_REASON = 500
MAX_SHOWN = 60  # the longest piece of a bad command echoed back
MAX_FIELD = 2500  # a section's text (Slack takes up to 3,000)
MAX_SECTIONS = 45  # sections of addresses in a confirmation (Slack: 50 blocks a message)
APPROVE, DISCARD, CONFIRM = "runplane_approve", "runplane_discard", "runplane_approve_confirmed"
STATUSES = tuple(str(s) for s in Status)

Verb = Literal["help", "status", "runs", "plan", "apply", "approve", "discard", "cancel"]
WRITES = frozenset({"plan", "apply", "approve", "discard", "cancel"})
USAGE = {
    "status": "status <workspace>",
    "runs": "runs [status]",
    "plan": "plan <workspace>",
    "apply": "apply <workspace>",
    "approve": "approve <run id>",
    "discard": "discard <run id> [reason]",
    "cancel": "cancel <run id>",
    "help": "help",
}
Message = dict[str, Any]


class Parsed(msgspec.Struct, frozen=True, kw_only=True):
    verb: Verb
    arg: str = ""  # a workspace, a run id or a status
    reason: str = ""


class BadCommand(Exception):
    """The text is not a command; the message says why and how to write it."""

    retryable = False
    slug = "invalid-command"


def escape(text: object) -> str:
    """`text` as Slack shows it literally in mrkdwn (and plain_text): `&`, `<`, `>`."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def shown(text: str, limit: int = MAX_SHOWN) -> str:
    """A piece of untrusted text to echo back: printable, bounded, escaped, in a code span."""
    clean = "".join(c if c.isprintable() else "\ufffd" for c in text)
    if len(clean) > limit:
        clean = clean[:limit] + "…"
    return "`" + escape(clean.replace("`", "'")) + "`"


def parse(text: str) -> Parsed:
    """The command in a slash command's text; BadCommand saying what is wrong."""
    if len(text) > MAX_TEXT:
        raise BadCommand(f"that command is {len(text)} characters long; at most {MAX_TEXT}")
    words = text.split()
    if not words:
        return Parsed(verb="help")
    verb, args = words[0].lower(), words[1:]
    if verb not in USAGE:
        raise BadCommand(f"unknown command {shown(words[0])}. {help_text()}")
    if verb == "help":
        return Parsed(verb="help")
    if verb == "runs":
        return _runs(args)
    if not args:
        raise BadCommand(f"usage: `{USAGE[verb]}`")
    arg = args[0]
    what = "workspace" if verb in ("status", "plan", "apply") else "run id"
    if not valid_id(arg):
        raise BadCommand(
            f"{shown(arg)} is not a {what} (lowercase letters, digits and dashes). "
            f"usage: `{USAGE[verb]}`"
        )
    if verb == "discard":
        return Parsed(verb="discard", arg=arg, reason=_reason(text, args))
    if len(args) > 1:
        raise BadCommand(f"too many words after {verb}. usage: `{USAGE[verb]}`")
    return Parsed(verb=verb, arg=arg)  # type: ignore[arg-type]  # checked against USAGE


def _runs(args: Sequence[str]) -> Parsed:
    if not args:
        return Parsed(verb="runs")
    if len(args) > 1 or args[0] not in STATUSES:
        raise BadCommand(
            f"{shown(' '.join(args))} is not a run status; one of {', '.join(STATUSES)}"
        )
    return Parsed(verb="runs", arg=args[0])


def _reason(text: str, args: Sequence[str]) -> str:
    reason = " ".join(args[1:])
    if len(reason) > MAX_REASON:
        raise BadCommand(f"the reason is {len(reason)} characters long; at most {MAX_REASON}")
    if not reason.isprintable():
        raise BadCommand("the reason has control characters")
    return reason


def help_text() -> str:
    lines = "\n".join(f"• `{u}`" for u in USAGE.values())
    return f"Commands:\n{lines}"


# ---------------------------------------------------------------- replies


def reply(text: str, *, in_channel: bool = False, replace: bool = False) -> Message:
    """A plain reply (its text written by runplane: escape any untrusted part first)."""
    return {
        "response_type": "in_channel" if in_channel else "ephemeral",
        "replace_original": replace,
        "text": text[:MAX_FIELD],
    }


def summary(run: Mapping[str, Any]) -> str:
    """`1 delete · 2 create` from a run's plan summary ("" before a plan)."""
    plan = run.get("plan_summary") or {}
    counts = (("destroy", "delete"), ("change", "update"), ("add", "create"))
    return " · ".join(f"{plan[k]} {word}" for k, word in counts if plan.get(k))


def run_line(run: Mapping[str, Any]) -> str:
    """One line about a run: id, workspace, type, status, plan summary."""
    extra = summary(run)
    return (
        f"`{escape(run['id'])}` {escape(run['workspace'])} {escape(run['type'])}: "
        f"*{escape(run['status'])}*" + (f" ({extra})" if extra else "")
    )


def run_card(org: str, run: Mapping[str, Any], note: str = "", *, replace: bool = True) -> Message:
    """A run as a message: its line, who made and approved it, its message, and the
    Approve / Discard buttons while it awaits approval."""
    lines = [run_line(run), f"created by {escape(run.get('created_by') or '?')}"]
    if run.get("message"):
        lines.append("> " + escape(str(run["message"])[:300]).replace("\n", " "))
    if run.get("approved_by"):
        lines.append(f"approved by {escape(run['approved_by'])}")
    if run.get("reason") and run.get("status") in ("failed", "discarded", "canceled"):
        lines.append(f"reason: {escape(run['reason'])}")
    if note:
        lines.append(note)
    text = "\n".join(lines)[:MAX_FIELD]
    blocks: list[dict[str, Any]] = [{"type": "section", "text": {"type": "mrkdwn", "text": text}}]
    if run.get("status") == "awaiting_approval":
        blocks.append(actions(f"{org}/{run['workspace']}/{run['id']}"))
    return {
        "response_type": "in_channel",
        "replace_original": replace,
        "text": text,
        "blocks": blocks,
    }


def actions(value: str) -> dict[str, Any]:
    """The Approve and Discard buttons of a run (value `<org>/<ws>/<run_id>`)."""
    return {
        "type": "actions",
        "elements": [
            _button("Approve", APPROVE, value, "primary"),
            _button("Discard", DISCARD, value, "danger"),
        ],
    }


def _button(label: str, action_id: str, value: str, style: str) -> dict[str, Any]:
    return {
        "type": "button",
        "text": {"type": "plain_text", "text": label},
        "action_id": action_id,
        "value": value,
        "style": style,
    }


def confirmation(value: str, run_id: str, missing: Sequence[str], digest: str) -> Message:
    """confirm_destructive: an ephemeral message listing every address the approval must
    acknowledge (in as many sections as it takes; past Slack's 50 blocks the rest are
    counted), and a button that acknowledges exactly these (`digest` of the list)."""
    head = (
        f"Run `{escape(run_id)}` deletes or replaces {len(missing)} resource(s); "
        "approving acknowledges every one:"
    )
    sections, shown = _address_sections(missing)
    if shown < len(missing):
        sections.append(_section(f"… and {len(missing) - shown} more: see the run's changes"))
    label = f"Approve, acknowledging all {len(missing)}"
    button = _button(label, CONFIRM, f"{value}/{digest}", "danger")
    return {
        "response_type": "ephemeral",
        "replace_original": False,
        "text": head + "\n" + "\n".join(b["text"]["text"] for b in sections),
        "blocks": [_section(head), *sections, {"type": "actions", "elements": [button]}],
    }


def _section(text: str) -> dict[str, Any]:
    return {"type": "section", "text": {"type": "mrkdwn", "text": text}}


def _address_sections(addresses: Sequence[str]) -> tuple[list[dict[str, Any]], int]:
    """The addresses one per line, in sections of at most MAX_FIELD characters and at
    most MAX_SECTIONS of them; and how many addresses they hold."""
    sections: list[dict[str, Any]] = []
    lines: list[str] = []
    size = shown = 0
    for address in addresses:
        clean = escape(address.replace("`", "'"))[: MAX_FIELD - 8]
        line = f"• `{clean}`"
        if size + len(line) + 1 > MAX_FIELD:
            if len(sections) == MAX_SECTIONS - 1:
                break
            sections.append(_section("\n".join(lines)))
            lines, size = [], 0
        lines.append(line)
        size += len(line) + 1
        shown += 1
    if lines:
        sections.append(_section("\n".join(lines)))
    return sections, shown
