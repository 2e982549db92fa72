"""The workload identity settings' rules (events/workload.py), apart so that
events/settings.py can name them without importing the run aggregate. Pure."""

from __future__ import annotations

from typing import Any

DEFAULT_AUDIENCE = "runplane.workload.identity"
DEFAULT_TTL = 3600  # seconds
MIN_TTL = 60
MAX_TTL = 12 * 3600  # no token lives longer; old signing keys are kept as long (and more)
MAX_AUDIENCE = 255
PHASES = ("plan", "apply")
ENABLED, AUDIENCE, TTL = "workload_identity", "workload_identity_audience", "workload_identity_ttl"


def audience_problem(value: Any) -> str:
    """Why a workspace's audience is refused ("" when it is not): printable ASCII without
    spaces (a URL or a name, as clouds take them), 1 to 255 characters."""
    ok = isinstance(value, str) and 0 < len(value) <= MAX_AUDIENCE
    if ok and value.isascii() and value.isprintable() and " " not in value:
        return ""
    return f"must be 1 to {MAX_AUDIENCE} printable ASCII characters without spaces"


def ttl_problem(value: Any) -> str:
    ok = isinstance(value, int) and not isinstance(value, bool) and MIN_TTL <= value <= MAX_TTL
    return "" if ok else f"must be a whole number of seconds from {MIN_TTL} to {MAX_TTL}"
