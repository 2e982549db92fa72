"""What the policy sandbox's two sides share (infra/policy/sandbox.py starts the child,
infra/policy/evaluate.py is the child): the answer lines, what a policy may say, and how a
module names its package. No regopy and no asyncio, so the child starts fast and the
parent never loads rego-cpp.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import msgspec

from events.errors import Invalid

MAX_MESSAGES = 50  # per set and plan: the plan's event stays small
MAX_MESSAGE = 1000  # characters of one message
MAX_ERROR = 8000  # characters of a compiler's message (a save's 422)
READY = b"ready"  # the child's first line: confined, now reading the request
EXIT_MEMORY = 3  # the child's exit status for a MemoryError raised in Python
_PACKAGE = re.compile(r"^[ \t]*package[ \t]+([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)[ \t]*(?:#.*)?$", re.M)


class InvalidPolicy(Invalid):
    """A policy set that cannot be used: it does not compile, or lacks `package` or
    `deny`. The message is the compiler's."""

    code = "invalid-policy"


class Checked(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The answer to a compile check."""

    invalid: str | None = None  # the compiler's message; None: the policy is usable


class Verdict(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One set's answer in an evaluation."""

    passed: bool
    messages: list[str]


def package_of(source: str) -> str:
    """The module's package (`package terraform.deletes` -> `terraform.deletes`)."""
    m = _PACKAGE.search(source)
    return m.group(1) if m else ""


def bounded(messages: Sequence[str]) -> list[str]:
    """At most MAX_MESSAGES messages (and a count of the rest) of MAX_MESSAGE characters."""
    kept = [m if len(m) <= MAX_MESSAGE else m[: MAX_MESSAGE - 1] + "…" for m in messages]
    if len(kept) > MAX_MESSAGES:
        extra = len(kept) - MAX_MESSAGES
        kept = [*kept[:MAX_MESSAGES], f"... and {extra} more"]
    return kept
