"""Ids and the clock, as the shell makes them (the core never does: it is handed `now`
and `new_id`)."""

from __future__ import annotations

import base64
import hashlib
from datetime import UTC, datetime

from ulid import ULID


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id() -> str:
    """A ULID, lowercased so that it is a subject-safe token."""
    return str(ULID()).lower()


def derived_id(*parts: str) -> str:
    """A run id derived from what identifies its cause (a webhook delivery and workspace,
    a schedule and fire time): the same parts give the same id, so a second creation of
    the same run finds the first. 26 lowercase base32 characters, like `new_id`'s."""
    digest = hashlib.sha256("\x1f".join(parts).encode()).digest()
    return base64.b32encode(digest).decode().lower()[:26]


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()
