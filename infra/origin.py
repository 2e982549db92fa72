"""Where a command came from: the request, the client and the surface, for the audit log.

The api sets it per request (services/surfaces/api/audit.py's middleware); every event the
request appends carries it in NATS headers (infra/eventstore.py), never in the event, and
the auditor copies it into the event's audit record (events/audit_facts.py). Processes
that append on their own (the scheduler, schedules, chat, VCS) set none: their events
name their cause themselves.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

from events.audit_facts import H_ACTOR_KIND, H_CLIENT, H_REQUEST, H_VIA


@dataclass
class Origin:
    request_id: str
    client: str
    via: str
    actor_kind: str = ""  # set once the caller is known (after authentication)

    def headers(self) -> dict[str, str]:
        out = {H_REQUEST: self.request_id, H_CLIENT: self.client, H_VIA: self.via}
        if self.actor_kind:
            out[H_ACTOR_KIND] = self.actor_kind
        return out


current: contextvars.ContextVar[Origin | None] = contextvars.ContextVar(
    "runplane_origin", default=None
)


def headers() -> dict[str, str]:
    """The current request's origin headers (none outside a request)."""
    found = current.get()
    return found.headers() if found is not None else {}
