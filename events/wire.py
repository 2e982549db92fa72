"""The messages that cross NATS between runplane's processes, one Struct each, used by
the side that builds a message and by the side that reads it.

- `Dispatch`: a phase waiting in a pool's work queue (`rp.dispatch.<pool>`, the scheduler
  and the reaper write it, an executor reads it);
- `Heartbeat`: the body of a heartbeat board entry (`rp.hb.<run>.<phase|deadline>`: the
  executor's beats, the scheduler's `dispatched` and `claimed` entries and deadline
  markers; the reaper, the API and a restarting executor read them);
- `SecretsRequest` / `SecretsReply`: an executor asking the secrets responder for its
  run's secret values (`rp.secrets.<org>.<ws>`, request-reply, never stored), and
  `SecretValues`, what the sealed reply opens to (or `GitSecret`, the run's git credential,
  when the request asks `git`).

Here and not in services/ or executor/: both of those import it, and this module, pure
msgspec like the rest of `events/`, imports neither (no arrow runs back up).

Compatibility: processes of two versions run side by side during a rolling upgrade and
entries outlive the process that wrote them (the board keeps them 24 h). So, as for
events: fields are only added, with defaults; readers allow unknown fields (a newer
writer's); writers leave out what a reader would take as its default anyway
(`omit_defaults`), which keeps each message exactly what the older writers sent
(`tests/test_wire.py` decodes their literal bytes, and the new bytes with the old types).
"""

from __future__ import annotations

from datetime import datetime
from typing import TypeVar

import msgspec

from events.codec import valid_id
from events.templates import valid_phase

DISPATCHED = "dispatched"  # Heartbeat.kind of a phase nobody has claimed yet
CLAIMED = "claimed"  # Heartbeat.kind of the scheduler's beat on a fresh lease's behalf
DEADLINE = "deadline"  # Heartbeat.kind (and phase token) of a run's deadline marker


class Dispatch(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A phase of a run waiting for an executor of the pool. Only a hint: the claim (an
    append on the run) decides who runs it."""

    org: str
    workspace: str
    run_id: str
    phase: str
    # An apply's: the executor that planned it, which may hold its checkout warm
    # (executor/warm.py); the others leave it to that one for a short while.
    planner: str = ""


class Heartbeat(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A heartbeat board entry's body. Each says after how many silent seconds it is
    stale, so a reader needs no other lookup while all is well."""

    lease_id: str = ""  # empty: nobody holds the phase yet (`dispatched`, deadline)
    executor_id: str = ""
    kind: str = ""  # "" (an executor's beat), DISPATCHED, CLAIMED, DEADLINE
    org: str = ""
    workspace: str = ""
    timeout: int = -1  # seconds of silence before the entry is stale; -1: not said
    # The executor's clock when it beat: for people reading the board, never compared
    # (ages are measured on the server's timestamps only).
    at: datetime | None = None
    # `dispatched` markers only: the pool the phase went to, how often the reaper checks
    # that its work-queue message still exists (seconds; the marker is rewritten at each
    # check), and when it was first dispatched (the dispatch timeout counts from there;
    # None: the marker's own time).
    pool: str = ""
    recheck: int = 0
    dispatched_at: datetime | None = None
    # Deadline markers only: when the limits pass (server time) and the run version seen.
    run_deadline: datetime | None = None
    approval_deadline: datetime | None = None
    version: int = 0


class SecretsRequest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """An executor's request for its run's secrets, under the lease it holds."""

    run_id: str
    lease_id: str
    # The run's git credential (`GitSecret`) instead of its secret variables.
    git: bool = False
    # The phase's workload identity token (a JWT, services/app/workload.py) instead.
    workload: bool = False


class GitSecret(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A workspace's git credential, from its VCS connection: inside `SecretsReply.sealed`
    when the request asked `git`."""

    token: str = ""
    username: str = ""
    ssh_key: str = ""


class SecretsReply(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The responder's answer: the values sealed for the run and lease, or why not."""

    sealed: bytes = b""  # base64 on the wire; opens to `SecretValues`
    error: str = ""


SecretValues = dict[str, str]  # variable name -> value, JSON, inside `SecretsReply.sealed`

SECRETS_PREFIX = "rp.secrets"  # + `.<org>.<ws>`: where `SecretsRequest`s go


def secrets_subject(org: str, ws: str) -> str:
    """Where an executor asks for the secrets of a run of `org`/`ws`."""
    return f"{SECRETS_PREFIX}.{org}.{ws}"


def reply_context(run_id: str, lease_id: str, *, git: bool = False, workload: bool = False) -> str:
    """What a sealed answer is bound to: it opens only for this run and lease (and as
    what was asked: variables never open as a git credential, nor the reverse)."""
    kind = "workload" if workload else "git" if git else "secrets"
    return f"{kind}:{run_id}:{lease_id}"


T = TypeVar("T")
_encoder = msgspec.json.Encoder()
_dispatch = msgspec.json.Decoder(Dispatch)
_heartbeat = msgspec.json.Decoder(Heartbeat)
_request = msgspec.json.Decoder(SecretsRequest)
_reply = msgspec.json.Decoder(SecretsReply)
_values = msgspec.json.Decoder(SecretValues)
_git = msgspec.json.Decoder(GitSecret)


class WireError(ValueError):
    """A message is not what its subject promises (malformed, or ids that are not
    subject-safe tokens). Permanent: the same bytes never decode."""

    retryable = False


def encode(
    message: Dispatch | Heartbeat | SecretsRequest | SecretsReply | SecretValues | GitSecret,
) -> bytes:
    return _encoder.encode(message)


def decode_dispatch(data: bytes) -> Dispatch:
    """A dispatch message, its ids and phase checked; WireError if it is not one."""
    d = _decode(_dispatch, data, "dispatch message")
    if not all(valid_id(x) for x in (d.org, d.workspace, d.run_id)):
        raise WireError("dispatch ids are not subject-safe tokens")
    if not valid_phase(d.phase):
        raise WireError(f"unknown phase {d.phase!r}")
    return d


def decode_heartbeat(data: bytes) -> Heartbeat:
    """A board entry's body (an empty one is all defaults); WireError if unreadable."""
    return _decode(_heartbeat, data, "heartbeat") if data else Heartbeat()


def decode_secrets_request(data: bytes) -> SecretsRequest:
    return _decode(_request, data, "secrets request")


def decode_secrets_reply(data: bytes) -> SecretsReply:
    return _decode(_reply, data, "secrets reply")


def decode_secret_values(data: bytes) -> SecretValues:
    return _decode(_values, data, "set of secret values")


def decode_git_secret(data: bytes) -> GitSecret:
    return _decode(_git, data, "git credential")


def _decode(decoder: msgspec.json.Decoder[T], data: bytes, what: str) -> T:
    try:
        return decoder.decode(data)
    except msgspec.DecodeError as e:  # ValidationError included
        raise WireError(f"not a {what}: {e}") from e
