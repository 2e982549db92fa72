"""Shared event base and helpers."""

from __future__ import annotations

from datetime import datetime

import msgspec


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of every stored event. Stored events never forbid unknown fields."""

    at: datetime
    actor: str


class Command(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every command."""

    actor: str
