"""The CLI's POST /runs body, read: its relationships and the run options its flags
ask for (-refresh-only, -refresh, -target, -replace, -var); a malformed one is a 422."""

from __future__ import annotations

from typing import Any

from events.run import RunOptions
from services.surfaces.tfe.jsonapi import TfeError


def related(rels: dict[str, Any], name: str, *, required: bool = True) -> str:
    rel = rels.get(name)
    data = rel.get("data") if isinstance(rel, dict) else None
    if isinstance(data, dict) and isinstance(data.get("id"), str):
        return str(data["id"])
    if required:
        raise TfeError(422, "invalid body", f"relationships.{name}.data.id is required")
    return ""


def flag(attrs: dict[str, Any], name: str, default: bool) -> bool:
    value = attrs.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise TfeError(422, "invalid attribute", f"{name} must be a boolean")
    return value


def _addresses(attrs: dict[str, Any], name: str) -> list[str]:
    value = attrs.get(name) or []
    if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
        raise TfeError(422, "invalid attribute", f"{name} must be a list of strings")
    return list(value)


def options_of(attrs: dict[str, Any], *, confirm: bool) -> RunOptions:
    variables: dict[str, str] = {}
    raw = attrs.get("variables") or []
    if not isinstance(raw, list):
        raise TfeError(422, "invalid attribute", "variables must be a list of {key, value}")
    for item in raw:
        if not isinstance(item, dict) or not isinstance(item.get("key"), str):
            raise TfeError(422, "invalid attribute", "each variable needs a key and a value")
        value = item.get("value")
        if not isinstance(value, str):
            raise TfeError(422, "invalid attribute", f"variable {item['key']}: value is a string")
        variables[item["key"]] = value
    return RunOptions(
        refresh_only=flag(attrs, "refresh-only", False),
        refresh=flag(attrs, "refresh", True),
        targets=_addresses(attrs, "target-addrs"),
        replaces=_addresses(attrs, "replace-addrs"),
        variables=variables,
        confirm=confirm,
    )
