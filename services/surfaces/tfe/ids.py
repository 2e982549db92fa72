"""TFE ids for runplane's objects, and back.

The CLI addresses a workspace by id alone (`/workspaces/:id/...`), so the id carries
its organization: `ws-<org>.<ws>`. runplane's names are `[a-z0-9-]` (events/codec.py),
so the dot is never part of one and the id reads back unambiguously. A state version is
`sv-<org>.<ws>.<serial>.<digest16>`: the object it names in `rp-state`
(executor/statestore.py `version_object`).
"""

from __future__ import annotations

from events.codec import valid_id
from services.surfaces.tfe.jsonapi import TfeError, not_found


def workspace_id(org: str, ws: str) -> str:
    return f"ws-{org}.{ws}"


def parse_workspace_id(value: str) -> tuple[str, str]:
    """(org, ws) of a workspace id; 404 if it is not one (nothing exists under it)."""
    body = value.removeprefix("ws-")
    org, sep, ws = body.partition(".")
    if body == value or not sep or not valid_id(org) or not valid_id(ws):
        raise not_found(f"workspace {value!r} not found")
    return org, ws


def state_version_id(org: str, ws: str, serial: int, digest: str) -> str:
    return f"sv-{org}.{ws}.{serial}.{digest[:16]}"


def parse_state_version_id(value: str) -> tuple[str, str, int, str]:
    """(org, ws, serial, digest prefix) of a state version id; 404 if not one."""
    parts = value.removeprefix("sv-").split(".")
    bad = value[:3] != "sv-" or len(parts) != 4
    if bad or not valid_id(parts[0]) or not valid_id(parts[1]) or not _serial(parts[2]):
        raise not_found(f"state version {value!r} not found")
    digest = parts[3]
    if len(digest) != 16 or any(c not in "0123456789abcdef" for c in digest):
        raise not_found(f"state version {value!r} not found")
    return parts[0], parts[1], int(parts[2]), digest


def _serial(text: str) -> bool:
    """ASCII digits of a serial that int() takes ("²" is a digit to str.isdigit)."""
    return text.isascii() and text.isdigit() and len(text) <= 19


def config_id(org: str, ws: str, short: str) -> str:
    return f"cv-{org}.{ws}.{short}"


def parse_config_id(value: str) -> tuple[str, str, str]:
    """(org, ws, short id) of a configuration version id; 404 if not one."""
    parts = value.removeprefix("cv-").split(".")
    if value[:3] != "cv-" or len(parts) != 3 or not all(valid_id(p) for p in parts):
        raise not_found(f"configuration version {value!r} not found")
    return parts[0], parts[1], parts[2]


def check_org(value: str) -> str:
    if not valid_id(value):
        raise not_found(f"organization {value!r} not found")
    return value


def check_workspace_name(value: str) -> str:
    """A workspace name from the CLI: runplane's names are subject tokens, narrower
    than TFE's (which allow capitals and underscores): 422 saying so."""
    if not valid_id(value):
        raise TfeError(
            422,
            "invalid workspace name",
            f"workspace name {value!r} is not one runplane takes: use 1 to 63 lowercase "
            "letters, digits and dashes, starting with a letter or digit",
        )
    return value


# Runs and what hangs off them (plans, applies, policy checks) carry their workspace:
# the CLI names them by id alone, and a run's events are on its workspace's subject.
RUN_KINDS = ("run", "plan", "apply", "polchk")


def run_object_id(kind: str, org: str, ws: str, run: str) -> str:
    """`run-<org>.<ws>.<run>`, `plan-...`, `apply-...`, `polchk-...`."""
    return f"{kind}-{org}.{ws}.{run}"


def parse_run_object_id(kind: str, value: str) -> tuple[str, str, str]:
    """(org, ws, run) of an id of `kind`; 404 if it is not one."""
    parts = value.removeprefix(f"{kind}-").split(".")
    if not value.startswith(f"{kind}-") or len(parts) != 3 or not all(map(valid_id, parts)):
        raise not_found(f"{kind} {value!r} not found")
    return parts[0], parts[1], parts[2]
