"""Capability URLs: what the Terraform CLI fetches without an Authorization header.

go-tfe sends no token with some requests (a configuration upload, a log read) and the
CLI follows URLs the server handed it; such a URL must carry its own authority. A
capability is `<payload>.<mac>`: the payload (base64url JSON) names the kind of object,
its organization, its id and an expiry; the mac is HMAC-SHA256 over the payload with a
key derived from the deployment's sealed key material (infra/crypto.py), so a
URL for one object never opens another, an altered one opens nothing, and none outlives
its expiry. Keys rotate with the key ring: a capability signed with an older key still
verifies until it expires (minutes), and the current key signs. A capability handed to a
caller may name its `holder` (the caller's token id): its use then stands only while that
token does (services/surfaces/tfe/holders.py).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time
from collections.abc import Callable

import msgspec

from infra.crypto import KeyRing

_LABEL = b"runplane-tfe-capability-v1"
_MAC_BYTES = 32
MAX_TTL_S = 3600  # nothing the CLI fetches needs a URL that lives longer
MAX_LENGTH = 2048  # a capability longer than this is refused before it is decoded


class CapabilityError(Exception):
    """The capability does not grant what was asked: malformed, forged, expired, or
    for another object. Never says which (an attacker learns nothing by trying)."""

    retryable = False


class _Payload(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    kind: str
    org: str
    object_id: str
    expires: int
    holder: str = ""  # the token it was handed to ("" none: the admin token, or older ones)


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(_Payload).decode


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def derive_keys(keyring: KeyRing) -> tuple[bytes, ...]:
    """The signing keys of a key ring, current first: never the encryption keys
    themselves, so a capability's mac says nothing about them."""
    return tuple(
        hmac.new(key, _LABEL, hashlib.sha256).digest() for key in (keyring.current, *keyring.older)
    )


class Signer:
    """Signs and verifies capabilities with the deployment's keys."""

    def __init__(self, keys: tuple[bytes, ...], clock: Callable[[], float] = time.time) -> None:
        if not keys:
            raise ValueError("a signer needs at least one key")
        self.keys = keys
        self.clock = clock

    @classmethod
    def of(cls, keyring: KeyRing) -> Signer:
        return cls(derive_keys(keyring))

    def sign(self, kind: str, org: str, object_id: str, ttl: int, *, holder: str = "") -> str:
        """A capability for one object of `org`, valid `ttl` seconds (and, with `holder`,
        while that token stands: the verifier's caller checks)."""
        if not 0 < ttl <= MAX_TTL_S:
            raise ValueError(f"ttl must be 1 to {MAX_TTL_S} seconds")
        payload = _encode(_Payload(kind, org, object_id, int(self.clock()) + ttl, holder))
        mac = hmac.new(self.keys[0], payload, hashlib.sha256).digest()
        return f"{_b64(payload)}.{_b64(mac)}"

    def verify(self, token: str, kind: str) -> tuple[str, str]:
        """The (org, object id) a capability of `kind` grants; CapabilityError if none."""
        org, object_id, _ = self.verify_held(token, kind)
        return org, object_id

    def verify_held(self, token: str, kind: str) -> tuple[str, str, str]:
        """The (org, object id, holder) a capability of `kind` grants ("" no holder)."""
        payload = self._authentic(token)
        try:
            grant = _decode(payload)
        except msgspec.DecodeError as e:
            raise CapabilityError("invalid capability") from e
        # Both compared in constant time too: what differs must not show in timing.
        if not hmac.compare_digest(grant.kind.encode(), kind.encode()):
            raise CapabilityError("invalid capability")
        if grant.expires <= self.clock():
            raise CapabilityError("invalid capability")
        return grant.org, grant.object_id, grant.holder

    def check(self, token: str, kind: str, org: str, object_id: str) -> None:
        """Raise CapabilityError unless the capability grants exactly this object."""
        got_org, got_id = self.verify(token, kind)
        same_org = hmac.compare_digest(got_org.encode(), org.encode())
        same_id = hmac.compare_digest(got_id.encode(), object_id.encode())
        if not (same_org and same_id):
            raise CapabilityError("invalid capability")

    def _authentic(self, token: str) -> bytes:
        if len(token) > MAX_LENGTH or token.count(".") != 1:
            raise CapabilityError("invalid capability")
        encoded, _, mac_text = token.partition(".")
        try:
            payload, mac = _unb64(encoded), _unb64(mac_text)
        except (binascii.Error, ValueError) as e:
            raise CapabilityError("invalid capability") from e
        if len(mac) != _MAC_BYTES:
            raise CapabilityError("invalid capability")
        valid = False
        for key in self.keys:  # every key, whatever matched: no early exit to time
            expected = hmac.new(key, payload, hashlib.sha256).digest()
            valid |= hmac.compare_digest(expected, mac)
        if not valid:
            raise CapabilityError("invalid capability")
        return payload


def sign(signer: Signer, kind: str, org: str, object_id: str, ttl: int) -> str:
    """Module-level spelling of `Signer.sign`."""
    return signer.sign(kind, org, object_id, ttl)


def verify(signer: Signer, token: str, kind: str) -> tuple[str, str]:
    """Module-level spelling of `Signer.verify`."""
    return signer.verify(token, kind)
