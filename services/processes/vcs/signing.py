"""Is a webhook request the VCS's? GitHub signs the raw body with the connection's secret
(`X-Hub-Signature-256: sha256=<hex HMAC-SHA256>`); GitLab sends the secret itself
(`X-Gitlab-Token`). Both are compared in constant time; GitHub's on the bytes as
received, fed to the HMAC chunk by chunk as they arrive (services/surfaces/webhooks/intake.py),
GitLab's before the body is read at all.

(hmac.compare_digest rather than githubkit: the githubkit in this deployment's
environment, 0.16, has no webhook verification module, and the check is four lines.)
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

GITHUB_SIGNATURE = "X-Hub-Signature-256"
GITLAB_TOKEN = "X-Gitlab-Token"
_PREFIX = "sha256="
_HEX = "0123456789abcdef"


def github_signature(secret: str, body: bytes) -> str:
    """The header value GitHub would send for `body` signed with `secret`."""
    return _PREFIX + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def github_hmac(secret: str) -> hmac.HMAC:
    """The HMAC GitHub signs with, to be fed the body's chunks as they arrive. An empty
    secret is refused: anyone could sign with it."""
    if not secret:
        raise ValueError("a connection without a webhook secret proves nothing")
    return hmac.new(secret.encode(), digestmod=hashlib.sha256)


def github_sent(headers: Mapping[str, str]) -> bytes | None:
    """The signature the request carries, if it is one (`sha256=` and 64 hex digits):
    judged before a byte of the body is read."""
    sent = headers.get(GITHUB_SIGNATURE, "").strip().lower()
    digest = sent.removeprefix(_PREFIX)
    if not sent.startswith(_PREFIX) or len(digest) != 64 or digest.strip(_HEX):
        return None
    return sent.encode()


def github_matches(mac: hmac.HMAC, sent: bytes) -> bool:
    """Whether `sent` is the signature of the bytes `mac` was fed (constant time)."""
    return hmac.compare_digest(sent, (_PREFIX + mac.hexdigest()).encode())


def gitlab_verified(secret: str, headers: Mapping[str, str]) -> bool:
    """Whether the request carries the connection's token: no body needed."""
    # digests of both, so that the comparison takes as long whatever the lengths
    sent = headers.get(GITLAB_TOKEN, "")
    return bool(secret) and hmac.compare_digest(_digest(sent), _digest(secret))


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).digest()
