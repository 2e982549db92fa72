"""Signatures of a delivery's raw body with its configuration's token.

- `X-TFE-Notification-Signature`: the hex HMAC-SHA512 of the body, as HCP Terraform
  signs, so receivers built for it check ours unchanged;
- `RP-Signature: t=<unix>,v1=<hex HMAC-SHA256 of "<t>.<body>">`: the timestamp is
  signed too, so a receiver that refuses old timestamps refuses a replayed delivery.

Without a token neither header is sent. `RP-Delivery` (the delivery's stable id) always is.
"""

from __future__ import annotations

import hashlib
import hmac

TFE_HEADER = "X-TFE-Notification-Signature"
RP_HEADER = "RP-Signature"
DELIVERY_HEADER = "RP-Delivery"
TOLERANCE_S = 300


def tfe_signature(token: str, body: bytes) -> str:
    return hmac.new(token.encode(), body, hashlib.sha512).hexdigest()


def rp_signature(token: str, body: bytes, t: int) -> str:
    mac = hmac.new(token.encode(), str(t).encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"t={t},v1={mac}"


def headers(token: str, body: bytes, delivery: str, now: float) -> dict[str, str]:
    out = {DELIVERY_HEADER: delivery}
    if token:
        out[TFE_HEADER] = tfe_signature(token, body)
        out[RP_HEADER] = rp_signature(token, body, int(now))
    return out


def check_tfe(token: str, body: bytes, header: str) -> bool:
    return hmac.compare_digest(tfe_signature(token, body), header)


def check_rp(
    token: str, body: bytes, header: str, now: float, tolerance: float = TOLERANCE_S
) -> bool:
    """What a receiver does: the header's v1 over its t, and t within `tolerance`."""
    parts = dict(p.split("=", 1) for p in header.split(",") if "=" in p)
    t = parts.get("t", "")
    if not t.isdigit() or abs(now - int(t)) > tolerance:
        return False
    expected = rp_signature(token, body, int(t))
    return hmac.compare_digest(expected, f"t={t},v1={parts.get('v1', '')}")
