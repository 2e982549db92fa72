"""The deployment's workload identity signing keys: made by runplane, sealed, kept in NATS.

RS256 (RSA 2048, PKCS#1 v1.5 with SHA-256): what HCP Terraform signs its workload tokens
with, and the one JWS algorithm every relying party takes (AWS STS, GCP workload identity
federation, Azure's federated credentials, which take no other, and Vault). ES256 would
sign faster with smaller keys, but a key a cloud cannot verify is no key.

The key set is one value in the KV bucket `rp-signing-keys` (key `keys`): every key not
yet forgotten, newest last, each with its public JWK in clear and its private key (PKCS#8)
sealed with the deployment's key ring, bound to the bucket and the key's id. Any process
that signs or publishes (the secrets responder, the api) reads it from the stream's
leader (a lagging replica would publish a set without the newest key) and, when the
newest key is older than the rotation period (less `AHEAD`), makes the next one and writes
the set back expecting the revision it read: of processes racing to rotate, one wins, the
others read the winner's set and use it. A new key is published `AHEAD` before it signs
(a relying party's cached JWKS, 5 minutes at most by our Cache-Control, already has it
when the first token it signed arrives); the key it replaces signs until then and stays
published `KEEP_AFTER` longer: past the longest a token lives (events/workload_rules.py
`MAX_TTL`), plus a process's cache of the set and clock skew. The first key of a
deployment signs at once.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import time
from collections.abc import Callable
from typing import Any

import jwt
import msgspec
import nats.errors
import nats.js.errors
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm
from nats.aio.client import Client as NATS
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE

from events.workload_rules import MAX_TTL
from infra.crypto import CryptoError, KeyRing
from infra.directget import InfraError, as_raw, leader_get
from infra.kv import SIGNING_KEYS_BUCKET

ALG = "RS256"
KEY = "keys"
RSA_BITS = 2048
ROTATE_AFTER = 7 * 86400  # seconds; --workload-key-rotation
ROTATE_RANGE = (3600, 90 * 86400)
CACHE_S = 30.0  # a process uses the set it read this long before reading it again
JWKS_MAX_AGE = 300  # seconds relying parties may cache the JWKS (services/surfaces/api/oidc.py)
AHEAD = JWKS_MAX_AGE + 2 * CACHE_S + 240  # a new key is published this long before it signs
KEEP_AFTER = MAX_TTL + 2 * CACHE_S + 600  # a retired key stays published this long
_TRIES = 5
# Members of an RSA JWK that are private (RFC 7518 6.3.2): never published.
PRIVATE_MEMBERS = frozenset({"d", "p", "q", "dp", "dq", "qi", "oth"})


class SigningError(InfraError):
    """The key set could not be read, made or opened; NATS may be back in a moment."""

    retryable = True


class StoredKey(msgspec.Struct, frozen=True, kw_only=True):
    kid: str
    created: int  # unix seconds
    public: dict[str, Any]  # the public JWK
    sealed: bytes  # the private key, PKCS#8 PEM, sealed for `context(kid)`


class KeySet(msgspec.Struct, frozen=True, kw_only=True):
    keys: list[StoredKey] = []


_decode = msgspec.json.Decoder(KeySet)
_encode = msgspec.json.Encoder()


def context(kid: str) -> str:
    return f"{SIGNING_KEYS_BUCKET}/{kid}"


def thumbprint(jwk: dict[str, Any]) -> str:
    """RFC 7638's JWK thumbprint of an RSA key (base64url of SHA-256): its `kid`."""
    canonical = json.dumps({k: jwk[k] for k in ("e", "kty", "n")}, separators=(",", ":"))
    digest = hashlib.sha256(canonical.encode()).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def new_key(keyring: KeyRing, now: int) -> StoredKey:
    """A fresh RSA key, its private part sealed (CPU-bound: run it off the event loop)."""
    private = rsa.generate_private_key(public_exponent=65537, key_size=RSA_BITS)
    jwk: dict[str, Any] = json.loads(RSAAlgorithm.to_jwk(private.public_key()))
    public = {"kty": "RSA", "n": jwk["n"], "e": jwk["e"]}
    kid = thumbprint(public)
    public.update(kid=kid, alg=ALG, use="sig")
    pem = private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return StoredKey(kid=kid, created=now, public=public, sealed=keyring.seal(pem, context(kid)))


class SigningKeys:
    """Signs with the current key, publishes every live one, rotates when due."""

    def __init__(
        self,
        nc: NATS,
        keyring: KeyRing,
        *,
        rotate_after: float = ROTATE_AFTER,
        clock: Callable[[], float] = time.time,
        cache_s: float = CACHE_S,
        timeout: float = 5.0,
    ) -> None:
        self.nc = nc
        self.keyring = keyring
        self.rotate_after = rotate_after
        self.clock = clock
        self.cache_s = cache_s
        self.timeout = timeout
        self._set: KeySet | None = None
        self._read_at = 0.0
        self._opened: dict[str, rsa.RSAPrivateKey] = {}
        self._lock = asyncio.Lock()

    async def sign(self, claims: dict[str, Any]) -> str:
        """`claims` as a compact JWS by the current key (its `kid` in the header)."""
        keys = await self.current()
        key = signer(keys, self.clock())
        private = self._open(key)
        headers = {"kid": key.kid, "typ": "JWT"}
        return jwt.encode(claims, private, algorithm=ALG, headers=headers)

    async def jwks(self) -> dict[str, Any]:
        """The JSON Web Key Set relying parties verify with: public members only."""
        keys = await self.current()
        live = kept(keys, self.clock())
        return {
            "keys": [{m: v for m, v in k.public.items() if m not in PRIVATE_MEMBERS} for k in live]
        }

    async def current(self) -> KeySet:
        """The key set, read again past `cache_s`, a new key made when one is due."""
        async with self._lock:
            now = self.clock()
            if self._set is not None and now - self._read_at < self.cache_s:
                if not self._due(self._set, now):
                    return self._set
            self._set = await self._settle()
            self._read_at = self.clock()
            return self._set

    def _due(self, keys: KeySet, now: float) -> bool:
        return not keys.keys or keys.keys[-1].created + self.rotate_after - AHEAD <= now

    async def _settle(self) -> KeySet:
        """The set as the leader has it, after this process's rotation if one is due
        (or another's, which won the race: its set is read and taken)."""
        for _ in range(_TRIES):
            found, revision = await self.read()
            now = int(self.clock())
            if not self._due(found, now):
                return found
            fresh = await asyncio.to_thread(new_key, self.keyring, now)
            rotated = KeySet(keys=[*kept(found, now), fresh])
            if await self._write(rotated, revision):
                return rotated
        raise SigningError(f"the signing keys kept changing under {_TRIES} rotations")

    async def read(self) -> tuple[KeySet, int]:
        """The stored set and its revision (0: none yet), from the stream's leader."""
        raw = await leader_get(
            self.nc,
            f"KV_{SIGNING_KEYS_BUCKET}",
            as_raw,
            subject=f"$KV.{SIGNING_KEYS_BUCKET}.{KEY}",
            what="the signing keys",
            error=SigningError,
            timeout=self.timeout,
        )
        if raw is None or raw.headers.get(KV_OP) in (KV_DEL, KV_PURGE) or not raw.data:
            return KeySet(), raw.seq if raw is not None else 0
        try:
            return _decode.decode(raw.data), raw.seq
        except msgspec.DecodeError as e:
            raise SigningError(f"the stored signing keys are not a key set: {e}") from e

    async def _write(self, keys: KeySet, revision: int) -> bool:
        """Write the set expecting `revision`; False if another process wrote first."""
        try:
            kv = await self.nc.jetstream(timeout=self.timeout).key_value(SIGNING_KEYS_BUCKET)
            await kv.update(KEY, _encode.encode(keys), last=revision)
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.BadRequestError):
            return False
        except (TimeoutError, nats.errors.Error) as e:
            raise SigningError(f"writing the signing keys: {e!r}") from e
        return True

    def _open(self, key: StoredKey) -> rsa.RSAPrivateKey:
        opened = self._opened.get(key.kid)
        if opened is None:
            try:
                pem = self.keyring.open(key.sealed, context(key.kid))
            except CryptoError as e:
                raise SigningError(f"signing key {key.kid} does not open: {e}") from e
            loaded = serialization.load_pem_private_key(pem, password=None)
            assert isinstance(loaded, rsa.RSAPrivateKey)
            self._opened = {key.kid: loaded}  # only the current one is kept open
            opened = loaded
        return opened


def signer(keys: KeySet, now: float) -> StoredKey:
    """The key that signs at `now`: the newest published `AHEAD` ago (the first key of a
    deployment at once)."""
    ready = [k for k in keys.keys if k.created + AHEAD <= now]
    return ready[-1] if ready else keys.keys[0]


def kept(keys: KeySet, now: float) -> list[StoredKey]:
    """The keys still published: those that sign or will, and those whose signing ended
    (their successor's start) less than `KEEP_AFTER` ago."""
    out = []
    for i, key in enumerate(keys.keys):
        later = keys.keys[i + 1 :]
        ended = min((k.created + AHEAD for k in later), default=None)
        if ended is None or ended > now or ended + KEEP_AFTER > now:
            out.append(key)
    return out
