"""What a notification says, per destination: generic (HCP Terraform's payload version 1
with runplane's fields beside it), Slack (Block Kit) and Microsoft Teams (an Adaptive
Card in a message).

Every payload is built from a `RunView`, which holds only what may leave runplane: ids,
names, the status, the run's message, counts of changes and timestamps. Never a variable
(plain or secret), a plan's attributes or an error text: a receiver is outside the trust
boundary, so nothing from which a sensitive value could be read is ever put in.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import msgspec

from events.notification import VERIFICATION
from events.run import Cause, RunState

PAYLOAD_VERSION = 1
PUBLIC_URL_ENV = "RUNPLANE_PUBLIC_URL"
APPROVE_ACTION, DISCARD_ACTION = "runplane_approve", "runplane_discard"
_encoder = msgspec.json.Encoder()

MESSAGES = {
    "run:created": "Run created",
    "run:planning": "Run planning",
    "run:needs_attention": "Run needs attention",
    "run:applying": "Run applying",
    "run:completed": "Run completed",
    "run:errored": "Run errored",
    "run:drifted": "Drift detected",
    "run:policy_failed": "Policy check failed",
    "run:discarded": "Run discarded",
    "run:canceled": "Run canceled",
    VERIFICATION: "Verification of notification configuration",
}


@dataclass(frozen=True)
class RunView:
    """A run as a notification shows it (nothing sensitive: module docstring)."""

    org: str
    workspace: str
    run_id: str
    run_type: str = ""
    status: str = ""
    message: str = ""
    created_at: datetime | None = None
    created_by: str = ""
    updated_at: datetime | None = None
    updated_by: str = ""
    add: int | None = None
    change: int | None = None
    destroy: int | None = None
    replace: int | None = None
    reason: str = ""
    base_url: str = ""
    cause: Cause | None = None

    @property
    def url(self) -> str:
        base = (self.base_url or os.environ.get(PUBLIC_URL_ENV, "")).rstrip("/")
        return f"{base}/orgs/{self.org}/workspaces/{self.workspace}/runs/{self.run_id}"


def view_of(state: RunState, *, at: datetime, actor: str, base_url: str = "") -> RunView:
    """The view of a run folded through the triggering event (`at`, `actor`: its)."""
    summary = state.apply_summary or state.plan_summary
    return RunView(
        org=state.org,
        workspace=state.workspace,
        run_id=state.run_id,
        run_type=state.run_type,
        status=str(state.status or ""),
        message=state.message,
        created_at=state.created_at,
        created_by=state.created_by,
        updated_at=at,
        updated_by=actor,
        add=summary.add if summary else None,
        change=summary.change if summary else None,
        destroy=summary.destroy if summary else None,
        reason=state.reason,
        base_url=base_url,
        cause=state.cause,
    )


def summary(view: RunView) -> str:
    """`1 delete · 2 create`: what the plan changes, deletions first; "" before a plan."""
    parts = [
        (view.destroy, "delete"),
        (view.replace, "replace"),
        (view.change, "update"),
        (view.add, "create"),
    ]
    if all(n is None for n, _ in parts):
        return ""
    shown = [f"{n} {word}" for n, word in parts if n]
    return " · ".join(shown) or "no changes"


def _iso(dt: datetime | None) -> str | None:
    return dt.isoformat().replace("+00:00", "Z") if dt else None


# ---------------------------------------------------------------- generic


def generic(view: RunView, trigger: str, config_id: str) -> dict[str, Any]:
    """HCP Terraform's notification payload, version 1, and runplane's fields beside it
    (a `verification` has no run: its run fields are null, as HCP Terraform sends)."""
    if trigger == VERIFICATION:
        return _verification(view, config_id)
    return {
        "payload_version": PAYLOAD_VERSION,
        "notification_configuration_id": config_id,
        "run_url": view.url,
        "run_id": view.run_id,
        "run_message": view.message,
        "run_created_at": _iso(view.created_at),
        "run_created_by": view.created_by,
        "workspace_id": f"{view.org}/{view.workspace}",
        "workspace_name": view.workspace,
        "organization_name": view.org,
        "notifications": [
            {
                "message": MESSAGES.get(trigger, trigger),
                "trigger": trigger,
                "run_status": view.status,
                "run_updated_at": _iso(view.updated_at),
                "run_updated_by": view.updated_by,
            }
        ],
        "runplane": {
            "run_type": view.run_type,
            "summary": summary(view),
            "changes": {"create": view.add, "update": view.change, "delete": view.destroy},
            "reason": view.reason,
            # why the run exists (null for runs created before causes were recorded)
            "cause": msgspec.to_builtins(view.cause) if view.cause is not None else None,
        },
    }


def _verification(view: RunView, config_id: str) -> dict[str, Any]:
    return {
        "payload_version": PAYLOAD_VERSION,
        "notification_configuration_id": config_id,
        "run_url": None,
        "run_id": None,
        "run_message": None,
        "run_created_at": None,
        "run_created_by": None,
        "workspace_id": f"{view.org}/{view.workspace}" if view.workspace else None,
        "workspace_name": view.workspace or None,
        "organization_name": view.org,
        "notifications": [
            {
                "message": MESSAGES[VERIFICATION],
                "trigger": VERIFICATION,
                "run_status": None,
                "run_updated_at": _iso(view.updated_at),
                "run_updated_by": None,
            }
        ],
    }


# ---------------------------------------------------------------- Slack


def slack_blocks(view: RunView, trigger: str, with_actions: bool) -> list[dict[str, Any]]:
    """Block Kit blocks of a run's notification. A `run:needs_attention` message with
    `with_actions` carries Approve and Discard buttons (`runplane_approve`,
    `runplane_discard`, value `<org>/<ws>/<run_id>`), handled by the chat-ops side."""
    title = f"{MESSAGES.get(trigger, trigger)}: {view.org}/{view.workspace}"
    fields = [
        {"type": "mrkdwn", "text": f"*Status*\n{view.status or '-'}"},
        {"type": "mrkdwn", "text": f"*Run*\n<{view.url}|{view.run_id}>"},
    ]
    change = summary(view)
    if change:
        fields.append({"type": "mrkdwn", "text": f"*Changes*\n{change}"})
    if view.updated_by:
        fields.append({"type": "mrkdwn", "text": f"*By*\n{_plain(view.updated_by)}"})
    blocks: list[dict[str, Any]] = [
        {"type": "header", "text": {"type": "plain_text", "text": title[:150]}},
        {"type": "section", "fields": fields},
    ]
    if view.message:
        blocks.append(
            {"type": "context", "elements": [{"type": "plain_text", "text": view.message[:2000]}]}
        )
    if with_actions and trigger == "run:needs_attention":
        value = f"{view.org}/{view.workspace}/{view.run_id}"
        blocks.append(
            {
                "type": "actions",
                "block_id": f"runplane_run_{view.run_id}",
                "elements": [
                    _button("Approve", APPROVE_ACTION, value, "primary"),
                    _button("Discard", DISCARD_ACTION, value, "danger"),
                ],
            }
        )
    return blocks


def _button(text: str, action: str, value: str, style: str) -> dict[str, Any]:
    return {
        "type": "button",
        "text": {"type": "plain_text", "text": text},
        "action_id": action,
        "value": value,
        "style": style,
    }


def _plain(text: str) -> str:
    """A name put in mrkdwn without formatting it could carry."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def slack(view: RunView, trigger: str) -> dict[str, Any]:
    title = f"{MESSAGES.get(trigger, trigger)}: {view.org}/{view.workspace} ({view.status})"
    return {"text": title, "blocks": slack_blocks(view, trigger, with_actions=True)}


# ---------------------------------------------------------------- Teams


def teams(view: RunView, trigger: str) -> dict[str, Any]:
    """A message with one Adaptive Card, as Teams' workflow webhooks take it."""
    facts = [
        {"title": "Status", "value": view.status or "-"},
        {"title": "Run", "value": view.run_id},
    ]
    change = summary(view)
    if change:
        facts.append({"title": "Changes", "value": change})
    if view.updated_by:
        facts.append({"title": "By", "value": view.updated_by})
    body: list[dict[str, Any]] = [
        {
            "type": "TextBlock",
            "size": "Medium",
            "weight": "Bolder",
            "text": f"{MESSAGES.get(trigger, trigger)}: {view.org}/{view.workspace}",
            "wrap": True,
        },
        {"type": "FactSet", "facts": facts},
    ]
    if view.message:
        body.append({"type": "TextBlock", "text": view.message[:2000], "wrap": True})
    card = {
        "$schema": "http://adaptivecards.io/schemas/adaptive-card.json",
        "type": "AdaptiveCard",
        "version": "1.4",
        "body": body,
        "actions": [{"type": "Action.OpenUrl", "title": "Open run", "url": view.url}],
    }
    return {
        "type": "message",
        "attachments": [
            {"contentType": "application/vnd.microsoft.card.adaptive", "content": card}
        ],
    }


def render(destination: str, view: RunView, trigger: str, config_id: str) -> bytes:
    """The body sent to a destination of that kind."""
    if destination == "slack":
        payload = slack(view, trigger)
    elif destination == "teams":
        payload = teams(view, trigger)
    else:
        payload = generic(view, trigger, config_id)
    return _encoder.encode(payload)
