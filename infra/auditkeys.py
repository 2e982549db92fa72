"""The audit checkpoints' Ed25519 key: made by runplane once, sealed, kept in NATS.

One value in the KV bucket `rp-audit` (key `key`): every key so far (newest last), each
with its public key in clear (raw 32 bytes, hex) and its private key (raw 32 bytes)
sealed with the deployment's key ring, bound to the bucket and the key's id. The first
process that needs one makes it and writes it expecting no value (`update(last=0)`): of
processes racing, one wins and the others read its key. Public keys are served at
`GET /api/v1/audit/keys` (no tenant data), for an auditor to pin (`runplane audit verify
--pubkey FILE`). Rotation is not done yet; the set has room for it (verify knows every
key of the set by its id).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable

import msgspec
import nats.errors
import nats.js.errors
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)
from nats.aio.client import Client as NATS
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE

from infra.crypto import CryptoError, KeyRing
from infra.directget import InfraError, as_raw, leader_get
from infra.kv import AUDIT_BUCKET

KEY = "key"
ALG = "Ed25519"


class AuditKeyError(InfraError):
    """The audit key could not be read, made or opened."""


class StoredKey(msgspec.Struct, frozen=True, kw_only=True):
    kid: str
    created: int
    public: str  # raw public key, hex
    sealed: bytes = b""  # raw private key, sealed for `context(kid)`


class KeySet(msgspec.Struct, frozen=True, kw_only=True):
    keys: list[StoredKey] = []


_decode = msgspec.json.Decoder(KeySet)
_encode = msgspec.json.Encoder()


def kid_of(public: bytes) -> str:
    """A key's id: the first 16 hex digits of the SHA-256 of its raw public key."""
    return hashlib.sha256(public).hexdigest()[:16]


def raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def public_keys(keys: KeySet) -> dict[str, Ed25519PublicKey]:
    """Every key's public part by id (what verification needs)."""
    return {k.kid: Ed25519PublicKey.from_public_bytes(bytes.fromhex(k.public)) for k in keys.keys}


CheckSig = Callable[[str, bytes, bytes], bool]


def verifier(pubs: dict[str, Ed25519PublicKey]) -> CheckSig:
    """A `CheckSig` (events/audit_chain.py) over these public keys."""

    def check(kid: str, message: bytes, sig: bytes) -> bool:
        key = pubs.get(kid)
        if key is None:
            return False
        try:
            key.verify(sig, message)
        except InvalidSignature:
            return False
        return True

    return check


class AuditKeys:
    """Signs checkpoints with the deployment's audit key (made at first need)."""

    def __init__(self, nc: NATS, keyring: KeyRing, *, timeout: float = 5.0) -> None:
        self.nc = nc
        self.keyring = keyring
        self.timeout = timeout
        self._signer: tuple[str, Ed25519PrivateKey] | None = None
        self._lock = asyncio.Lock()

    async def kid(self) -> str:
        """The id of the key that signs."""
        return (await self._current())[0]

    async def sign(self, message: bytes) -> bytes:
        """The current key's signature of `message`."""
        return (await self._current())[1].sign(message)

    async def _current(self) -> tuple[str, Ed25519PrivateKey]:
        async with self._lock:
            if self._signer is None:
                stored = (await self._settle()).keys[-1]
                try:
                    raw = self.keyring.open(stored.sealed, f"{AUDIT_BUCKET}/{stored.kid}")
                except CryptoError as e:
                    raise AuditKeyError(f"audit key {stored.kid} does not open: {e}") from e
                self._signer = (stored.kid, Ed25519PrivateKey.from_private_bytes(raw))
            return self._signer

    async def _settle(self) -> KeySet:
        for _ in range(5):
            found, revision = await read(self.nc, timeout=self.timeout)
            if found.keys:
                return found
            private = Ed25519PrivateKey.generate()
            public = raw_public(private.public_key())
            kid = kid_of(public)
            raw = private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
            sealed = self.keyring.seal(raw, f"{AUDIT_BUCKET}/{kid}")
            made = KeySet(
                keys=[
                    StoredKey(kid=kid, created=int(time.time()), public=public.hex(), sealed=sealed)
                ]
            )
            try:
                kv = await self.nc.jetstream(timeout=self.timeout).key_value(AUDIT_BUCKET)
                await kv.update(KEY, _encode.encode(made), last=revision)
                return made
            except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.BadRequestError):
                continue  # another process made it first: read theirs
            except (TimeoutError, nats.errors.Error) as e:
                raise AuditKeyError(f"writing the audit key: {e!r}") from e
        raise AuditKeyError("the audit key kept changing")


async def read(nc: NATS, *, timeout: float = 5.0) -> tuple[KeySet, int]:
    """The stored key set and its revision (0: none yet), from the stream's leader."""
    raw = await leader_get(
        nc,
        f"KV_{AUDIT_BUCKET}",
        as_raw,
        subject=f"$KV.{AUDIT_BUCKET}.{KEY}",
        what="the audit keys",
        error=AuditKeyError,
        timeout=timeout,
    )
    if raw is None or raw.headers.get(KV_OP) in (KV_DEL, KV_PURGE) or not raw.data:
        return KeySet(), raw.seq if raw is not None else 0
    try:
        return _decode.decode(raw.data), raw.seq
    except msgspec.DecodeError as e:
        raise AuditKeyError(f"the stored audit keys are not a key set: {e}") from e


def published(keys: KeySet) -> list[dict[str, object]]:
    """The public view of the keys: id, algorithm, raw public key (hex), since when."""
    return [{"kid": k.kid, "alg": ALG, "public": k.public, "created": k.created} for k in keys.keys]
