"""Notifications: configurations (events/notification.py), payloads, signatures, the
address guard and the delivery engine; the subscriber that feeds it from the event log."""

from __future__ import annotations


class NotifyError(Exception):
    """Root of the errors of this package; `retryable` says whether trying again helps."""

    retryable = False


class Refused(NotifyError):
    """The destination's address is one this deployment does not send to (SSRF guard)."""

    code = "destination-refused"
