"""Sign-in flows by OpenID Connect's authorization code with PKCE (S256).

`begin` makes a flow: a random `state`, `nonce` and PKCE verifier, written to the
`rp-sso-flows` bucket under a digest of the state and sealed with a key derived from a
value only the browser's cookie holds (its `binding`): a copy of the bucket finishes no
sign-in, and a state planted in another browser (login CSRF) does not open. It answers
the provider's authorization URL.

`finish` (on any api replica: the flow is read from the bucket's stream leader) takes
the flow once: it writes "used" over the entry expecting the revision it read, which the
leader grants to one caller only, before anything else, so a replayed or raced callback
is refused whatever happens after. Then every check, in this order, before anything is
written: the flow is alive (`FLOW_TTL_S`), the organization's configuration is the one
the flow began with (issuer and client id, read from the stream's leader: a flow begun
for one configuration never finishes under another), the callback's `iss` (RFC 9207)
is that issuer, the code is exchanged at that issuer's token endpoint with the verifier,
the ID token verifies (infra/oidc.py), its nonce is used for the first time anywhere
(`update(last=0)`), the email is present, not `email_verified: false` (`"false"` too;
a missing claim is taken, as many providers leave it out, unless the configuration sets
`require_email_verified`: then only `true` is) and of an allowed domain, the groups claim
is a list of strings. Only then is the identity hook called (services/app/sso.py `SignIn`).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlencode

import msgspec
import nats.errors
import nats.js.errors
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from nats.aio.client import Client as NATS
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE, KeyValue

from events import sso
from events.users import user_problem
from infra.directget import as_raw, leader_get
from infra.kv import SSO_FLOWS_BUCKET, KvError
from infra.oidc import OidcClient, OidcError
from services.app.identity import SignedIn
from services.app.sso import Person, SignIn, SsoConfigs

FLOW_TTL_S = 600.0  # from the redirect to the provider to the callback
USED = b"used"
MAX_GROUPS = 500
SCOPE = "openid email profile"


class SsoError(OidcError):
    """A flow that cannot finish (unknown, replayed, expired, another configuration's)."""


class Flow(msgspec.Struct, frozen=True, kw_only=True):
    org: str
    issuer: str
    client_id: str
    redirect_uri: str
    nonce: str
    verifier: str
    return_to: str
    started: float


class Finished(msgspec.Struct, frozen=True, kw_only=True):
    flow: Flow
    person: Person
    signed_in: SignedIn


def new_binding() -> str:
    """A browser's flow binding: the value of its flow cookie."""
    return secrets.token_urlsafe(32)


def challenge_of(verifier: str) -> str:
    digest = hashlib.sha256(verifier.encode()).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _key(state: str) -> str:
    return "f." + hashlib.sha256(b"rp-sso-state\0" + state.encode()).hexdigest()


def _nonce_key(issuer: str, nonce: str) -> str:
    return "n." + hashlib.sha256(f"rp-sso-nonce\0{issuer}\0{nonce}".encode()).hexdigest()


def _sealer(binding: str) -> AESGCM:
    return AESGCM(hmac.new(binding.encode(), b"rp-sso-flow", hashlib.sha256).digest())


class SsoFlows:
    """Begin and finish sign-ins, on any replica."""

    def __init__(
        self,
        nc: NATS,
        configs: SsoConfigs,
        oidc: OidcClient,
        sign_in: SignIn,
        *,
        now: Callable[[], float] = time.time,
        timeout: float = 5.0,
    ) -> None:
        self.nc = nc
        self.configs = configs
        self.oidc = oidc
        self.sign_in = sign_in
        self.now = now
        self.timeout = timeout
        self._kv: KeyValue | None = None

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            self._kv = await self.nc.jetstream(timeout=self.timeout).key_value(SSO_FLOWS_BUCKET)
        return self._kv

    async def begin(self, org: str, *, redirect_uri: str, return_to: str, binding: str) -> str:
        """The provider's authorization URL for a new flow of `org`'s configuration."""
        config = await self.configs.load(org)
        if not config.configured:
            raise SsoError(f"{org} has no single sign-on", reason="sso-not-configured")
        found = await self.oidc.discover(config.issuer)
        state, nonce, verifier = (secrets.token_urlsafe(32) for _ in range(3))
        flow = Flow(
            org=org,
            issuer=config.issuer,
            client_id=config.client_id,
            redirect_uri=redirect_uri,
            nonce=nonce,
            verifier=verifier,
            return_to=return_to,
            started=self.now(),
        )
        key = _key(state)
        iv = os.urandom(12)
        sealed = iv + _sealer(binding).encrypt(iv, msgspec.json.encode(flow), key.encode())
        try:
            await (await self._bucket()).put(key, sealed)
        except (TimeoutError, nats.errors.Error) as e:
            raise KvError(f"recording a sign-in: {e!r}") from e
        query = {
            "response_type": "code",
            "client_id": config.client_id,
            "redirect_uri": redirect_uri,
            "scope": SCOPE,
            "state": state,
            "nonce": nonce,
            "code_challenge": challenge_of(verifier),
            "code_challenge_method": "S256",
        }
        sep = "&" if "?" in found.authorization_endpoint else "?"
        return found.authorization_endpoint + sep + urlencode(query)

    async def finish(self, *, state: str, code: str, binding: str, iss: str | None) -> Finished:
        """Every check of the module's docstring, then the identity hook."""
        flow = await self._take(state, binding)
        if self.now() - flow.started > FLOW_TTL_S:
            raise SsoError("the sign-in took too long: start again", reason="sso-expired")
        config = await self.configs.load(flow.org, latest=True)
        if (config.issuer, config.client_id) != (flow.issuer, flow.client_id):
            raise SsoError(
                "the organization's single sign-on changed during the sign-in",
                reason="sso-config-changed",
            )
        if iss is not None and iss != flow.issuer:
            raise SsoError(
                "the answer came from another identity provider", reason="sso-issuer-mismatch"
            )
        if not code:
            raise SsoError("the identity provider sent no code", reason="sso-denied")
        found = await self.oidc.discover(flow.issuer)
        token = await self.oidc.exchange(
            found,
            code=code,
            redirect_uri=flow.redirect_uri,
            verifier=flow.verifier,
            client_id=flow.client_id,
            client_secret=await self.configs.secret(flow.org),
        )
        claims = await self.oidc.verify(
            token, issuer=flow.issuer, client_id=flow.client_id, nonce=flow.nonce
        )
        await self._use_nonce(flow.issuer, flow.nonce)
        person = person_of(flow.org, config, claims)
        signed_in = await self.sign_in(  # the one call site of the identity hook
            person.org,
            email=person.email,
            name=person.name,
            groups=person.groups,
            issuer=person.issuer,
            subject=person.subject,
            rules=[(r.group, r.team) for r in config.group_rules],
        )
        return Finished(flow=flow, person=person, signed_in=signed_in)

    async def _take(self, state: str, binding: str) -> Flow:
        if not state or len(state) > 200 or not binding:
            raise SsoError("no sign-in of this browser is under way", reason="sso-unknown-flow")
        key = _key(state)
        subject = f"$KV.{SSO_FLOWS_BUCKET}.{key}"
        raw = await leader_get(
            self.nc,
            f"KV_{SSO_FLOWS_BUCKET}",
            as_raw,
            subject=subject,
            what="a sign-in",
            error=KvError,
            timeout=self.timeout,
        )
        if raw is None or raw.headers.get(KV_OP) in (KV_DEL, KV_PURGE) or not raw.data:
            raise SsoError("no sign-in of this browser is under way", reason="sso-unknown-flow")
        if raw.data == USED:
            raise SsoError("this sign-in was finished already", reason="sso-replay")
        try:
            plain = _sealer(binding).decrypt(raw.data[:12], raw.data[12:], key.encode())
            flow = msgspec.json.decode(plain, type=Flow)
        except (InvalidTag, ValueError, msgspec.DecodeError) as e:
            raise SsoError(
                "this sign-in was begun by another browser", reason="sso-unknown-flow"
            ) from e
        try:
            await (await self._bucket()).update(key, USED, last=raw.seq)
        except nats.js.errors.KeyWrongLastSequenceError as e:
            raise SsoError("this sign-in was finished already", reason="sso-replay") from e
        except (TimeoutError, nats.errors.Error) as e:
            raise KvError(f"taking a sign-in: {e!r}") from e
        return flow

    async def _use_nonce(self, issuer: str, nonce: str) -> None:
        try:
            await (await self._bucket()).update(_nonce_key(issuer, nonce), USED, last=0)
        except nats.js.errors.KeyWrongLastSequenceError as e:
            raise SsoError("this ID token was used already", reason="sso-replay") from e
        except (TimeoutError, nats.errors.Error) as e:
            raise KvError(f"recording a nonce: {e!r}") from e


def person_of(org: str, config: sso.SsoState, claims: dict[str, Any]) -> Person:
    """The person the verified claims name, or SsoError saying which claim is wrong."""
    email = claims.get("email")
    if not isinstance(email, str) or user_problem(email) or "@" not in email:
        raise SsoError("the ID token carries no usable email", reason="sso-bad-claims")
    if sso.email_unverified(claims, required=config.require_email_verified):
        raise SsoError(
            "the identity provider has not verified the email", reason="sso-email-unverified"
        )
    if not sso.email_allowed(email, config.allowed_domains):
        raise SsoError(
            f"{email.rpartition('@')[2][:64]} is not a domain allowed to sign in to {org}",
            reason="sso-domain-not-allowed",
        )
    groups = claims.get(config.groups_claim, [])
    if not isinstance(groups, list) or not all(isinstance(g, str) for g in groups):
        raise SsoError(
            f"the claim {config.groups_claim!r} is not a list of strings",
            reason="sso-bad-groups",
        )
    if len(groups) > MAX_GROUPS or any(not 0 < len(g) <= sso.MAX_GROUP for g in groups):
        raise SsoError(f"the claim {config.groups_claim!r} is too large", reason="sso-bad-groups")
    name = claims.get("name")
    return Person(
        org=org,
        email=email,
        name=name if isinstance(name, str) and not user_problem(name) else email,
        groups=sorted(set(groups)),
        issuer=str(claims["iss"]),
        subject=str(claims["sub"]),
    )
