"""VCS webhooks, inbound: connections (events/vcs.py) with their sealed secrets, the
signature checks, the payloads of GitHub and GitLab read into one shape, which
workspaces a push or a pull request starts, and the webhook's handling."""

from __future__ import annotations


class VcsError(Exception):
    """Root of the errors of this package; `retryable` says whether trying again helps."""

    retryable = False


class BadPayload(VcsError):
    """A signed payload runplane cannot act on (malformed, wrong types, hostile names)."""
