"""Is a webhook request the VCS's? GitHub signs the raw body with the connection's secret
(`X-Hub-Signature-256: sha256=<hex HMAC-SHA256>`); GitLab sends the secret itself
(`X-Gitlab-Token`). Both are compared in constant time, on the bytes as received.

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
# Compared against when there is no connection or no secret, so that such a request costs
# what a wrong signature costs (no timing difference to tell which ids exist).
_NOBODY = "runplane: no connection has this secret"


def github_signature(secret: str, body: bytes) -> str:
    """The header value GitHub would send for `body` signed with `secret`."""
    return _PREFIX + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def verified(provider: str, secret: str, body: bytes, headers: Mapping[str, str]) -> bool:
    """Whether the request carries the connection's proof over exactly `body`."""
    known = bool(secret)
    secret = secret or _NOBODY
    if provider == "github":
        sent = headers.get(GITHUB_SIGNATURE, "")
        ok = hmac.compare_digest(
            sent.strip().lower().encode(), github_signature(secret, body).encode()
        )
    else:
        sent = headers.get(GITLAB_TOKEN, "")
        # digests of both, so that the comparison takes as long whatever the lengths
        ok = hmac.compare_digest(_digest(sent), _digest(secret))
    return ok and known


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).digest()
