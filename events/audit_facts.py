"""Which events are commands worth an audit record, and what the record says. Pure.

An event is audited when it records a decision someone made (a person, a token, a
schedule, a webhook, a chat request): `AUDITED` lists those tags. What only follows from
a decision (a run queued, a step started, a delivery attempted, a token's use) is not:
its cause already is on the record. The request that appended an event (its id, the
client's address, the surface, the token) travels in the event's NATS headers
(infra/origin.py), never in the event.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any, Final

from events.audit import OK, Facts, digest

AUDITED: Final = frozenset(
    {
        "run.created", "run.approved", "run.discarded", "run.canceled", "run.stop_requested",
        "run.log_pruned", "run.removed",
        "ws.created", "ws.deleted", "ws.purged", "ws.locked", "ws.unlocked",
        "ws.settings_set", "ws.config_changed", "ws.variables_set", "ws.state_pushed",
        "org.created", "org.access_granted", "org.access_revoked", "org.folder_created",
        "org.folder_settings_set", "org.group_set", "org.notify_config_deleted",
        "org.notify_config_saved", "org.policy_deleted", "org.policy_set",
        "org.run_trigger_added", "org.run_trigger_removed", "org.schedule_deleted",
        "org.schedule_saved", "org.settings_set", "org.sso_configured", "org.sso_removed",
        "org.team_deleted", "org.team_members_set", "org.team_set", "org.template_deleted",
        "org.template_set", "org.token_issued", "org.token_revoked", "org.user_added",
        "org.user_linked", "org.user_reactivated", "org.user_suspended",
        "org.user_teams_synced", "org.vcs_connection_deleted", "org.vcs_connection_saved",
        "chat.slack_configured", "chat.slack_removed", "chat.slack_user_mapped",
        "chat.slack_user_unmapped", "org.audit_destination_saved",
        "org.audit_destination_deleted", "org.stack_created", "org.stack_changed",
        "org.stack_deleted", "org.stack_run_created", "org.stack_run_resumed",
    }
)  # fmt: skip

# What runplane itself decides (its actor names the process, not a person).
SYSTEM: Final = frozenset({"run.log_pruned", "run.removed"})

# The headers an api request's events carry (infra/origin.py).
H_REQUEST, H_CLIENT, H_VIA, H_ACTOR_KIND = (
    "Rp-Request-Id", "Rp-Client", "Rp-Via", "Rp-Actor-Kind",
)  # fmt: skip
# Members naming what an organization's event is about, in the order they are looked for.
_NAMED: Final = (
    ("team", "team"), ("name", ""), ("user_id", "user"), ("token_id", "token"),
    ("connection_id", "vcs connection"), ("schedule_id", "schedule"), ("folder", "folder"),
    ("destination_id", "audit destination"), ("stack_run_id", "stack run"),
)  # fmt: skip


def facts_of(
    *,
    seq: int,
    subject: str,
    tag: str,
    data: bytes,
    event: Any,
    at: datetime,
    headers: Mapping[str, str],
) -> Facts | None:
    """The audit facts of event `seq` (`data` as stored), None if it is not audited."""
    if tag not in AUDITED:
        return None
    parts = subject.split(".")
    if len(parts) < 3 or parts[0] != "rp":
        return None
    org = parts[2]
    return Facts(
        org=org,
        at=at,
        actor=str(getattr(event, "actor", "")),
        actor_kind=headers.get(H_ACTOR_KIND, "") or _actor_kind(tag, event),
        via=headers.get(H_VIA, "") or _via(event),
        action=tag,
        thing=_thing(parts, tag, event),
        outcome=OK,
        detail=_removed(tag, event),
        request_id=headers.get(H_REQUEST, ""),
        client=headers.get(H_CLIENT, ""),
        src=seq,
        src_hash=digest(data),
    )


def _removed(tag: str, event: Any) -> str:
    """What a retention record removed (services/processes/retention.py): the read-model
    rows and each object with its bucket and SHA-256, so the chain itself lists them."""
    if tag not in SYSTEM:
        return ""
    rows = list(getattr(event, "rows", []))
    objects = [
        f"{o.bucket or 'rp-logs'}/{o.name} sha256:{o.sha256 or '-'}"
        for o in getattr(event, "objects", [])
    ]
    said = ([f"rows: {', '.join(rows)}"] if rows else []) + [
        f"objects: {', '.join(objects) or '-'}"
    ]
    return "removed " + "; ".join(said)


def _via(event: Any) -> str:
    said = str(getattr(event, "via", ""))  # e.g. an approval's: api, ui, slack
    if said:
        return "chat" if said == "slack" else said
    cause = getattr(event, "cause", None)
    if cause is not None and str(getattr(cause, "kind", "")):
        return str(cause.kind)
    return "system"


def _actor_kind(tag: str, event: Any) -> str:
    if tag in SYSTEM:
        return "system"
    cause = getattr(event, "cause", None)
    if cause is not None and cause.kind in ("schedule", "run_trigger", "vcs"):
        return "system"
    return "user" if str(getattr(event, "actor", "")) else "system"


def _thing(parts: list[str], tag: str, event: Any) -> str:
    kind = parts[1]
    if kind == "run" and len(parts) >= 5:
        return f"run {parts[3]}/{parts[4]}"
    if kind == "ws" and len(parts) >= 4:
        return f"workspace {parts[3]}"
    if tag == "org.created":
        return f"organization {parts[2]}"
    for member, label in _NAMED:
        value = getattr(event, member, None)
        if isinstance(value, str) and value:
            noun = label or tag.split(".", 1)[1].rsplit("_", 1)[0].replace("_", " ")
            return f"{noun} {value}"
    return f"organization {parts[2]}"
