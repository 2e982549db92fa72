"""Slack's request signature (v0), checked on the raw body before anything else is read.

Slack signs `v0:<X-Slack-Request-Timestamp>:<raw body>` with the app's signing secret
(HMAC-SHA256, hex) and sends it as `X-Slack-Signature: v0=<hex>`. A request is taken only
if its timestamp is within `WINDOW` of our clock (either way) and its signature matches,
compared in constant time. The window bounds a replay by time; the request id derived
from the signature (`request_id`) refuses one inside it (services/processes/chat/requests.py).
"""

from __future__ import annotations

import hashlib
import hmac
from datetime import datetime, timedelta

WINDOW = timedelta(minutes=5)
VERSION = "v0"
MAX_SIGNATURE = 128  # "v0=" and 64 hex digits; anything far longer is not Slack's


class SignatureError(Exception):
    """The request is not proven to come from the organization's Slack app."""

    retryable = False


def signature(secret: str, timestamp: str, body: bytes) -> str:
    """What Slack sends as X-Slack-Signature for `body` sent at `timestamp`."""
    base = f"{VERSION}:{timestamp}:".encode() + body
    return f"{VERSION}=" + hmac.new(secret.encode(), base, hashlib.sha256).hexdigest()


def check_timestamp(timestamp: str | None, now: datetime) -> int:
    """The request's time (unix seconds), if it is a number within the window of `now`."""
    if not timestamp:
        raise SignatureError("X-Slack-Request-Timestamp is missing")
    if not timestamp.isascii() or not timestamp.isdigit() or len(timestamp) > 12:
        raise SignatureError("X-Slack-Request-Timestamp is not a unix time")
    sent = int(timestamp)
    if abs(now.timestamp() - sent) > WINDOW.total_seconds():
        raise SignatureError(
            "X-Slack-Request-Timestamp is more than 5 minutes from now: a replay, or a clock off"
        )
    return sent


def check_format(sig: str | None) -> str:
    if not sig:
        raise SignatureError("X-Slack-Signature is missing")
    if len(sig) > MAX_SIGNATURE or not sig.startswith(f"{VERSION}="):
        raise SignatureError("X-Slack-Signature is not a v0 signature")
    return sig


def matches(secret: str, timestamp: str, body: bytes, sig: str) -> bool:
    """Whether `sig` is the signature of `body` at `timestamp` under `secret` (constant time)."""
    return hmac.compare_digest(signature(secret, timestamp, body).encode(), sig.encode())


def request_id(sig: str) -> str:
    """A subject-safe id for the signed request: the same signature, the same id."""
    return hashlib.sha256(sig.encode()).hexdigest()[:32]
