"""One reused encoder and decoder for every stored event."""

from __future__ import annotations

import re

import msgspec

from events.audit_stream import AuditDestinationEvent
from events.chat import ChatEvent
from events.notification import NotificationEvent
from events.org import OrgEvent
from events.run import RunEvent
from events.run_triggers import RunTriggerEvent
from events.schedule import ScheduleEvent
from events.sso import SsoEvent
from events.stack_run_events import StackRunEvent
from events.stacks import StackEvent
from events.vcs import VcsEvent
from events.vcs_report import VcsReportEvent
from events.workspace import WorkspaceEvent

AnyEvent = (
    RunEvent
    | WorkspaceEvent
    | OrgEvent
    | NotificationEvent
    | ChatEvent
    | VcsEvent
    | VcsReportEvent
    | RunTriggerEvent
    | ScheduleEvent
    | SsoEvent
    | AuditDestinationEvent
    | StackEvent
    | StackRunEvent
)

_encoder = msgspec.json.Encoder()
_decoder: msgspec.json.Decoder[AnyEvent] = msgspec.json.Decoder(AnyEvent)

ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


def encode(event: AnyEvent) -> bytes:
    return _encoder.encode(event)


def decode(data: bytes) -> AnyEvent:
    return _decoder.decode(data)


def tag_of(event: AnyEvent) -> str:
    return str(type(event).__struct_config__.tag)


def valid_id(value: str) -> bool:
    """Ids and names are subject-safe tokens: lowercase letters, digits and dashes."""
    return ID_RE.fullmatch(value) is not None


def run_subject(org: str, ws: str, run: str) -> str:
    return f"rp.run.{org}.{ws}.{run}"


def ws_subject(org: str, ws: str) -> str:
    return f"rp.ws.{org}.{ws}"


def org_subject(org: str) -> str:
    return f"rp.org.{org}"
