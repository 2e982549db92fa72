"""The relying party's side of OpenID Connect: discovery, the issuer's keys, the code
exchange and the ID token's checks (OpenID Connect Core 1.0, 3.1.3.7).

What an organization's admin names (the issuer) is reached through `connect`, a factory
of HTTP sessions the caller gives: the composition root's judges every address it
connects to (services/processes/notifications/guard.py, `RUNPLANE_SSO_ALLOW`), so an
issuer cannot point the control plane at its own network. Redirects are never followed
and every answer is read to at most `MAX_BODY` bytes.

- Discovery (`/.well-known/openid-configuration`) is taken only if it names exactly the
  issuer asked for (Discovery 4.3): a provider cannot speak for another (IdP mix-up).
- Keys: the issuer's JWKS, cached. A token signed with a key id the cache does not hold
  fetches the set again, once, and at most once per `refetch_s` per issuer whatever
  tokens come (a stranger's made-up key ids cost the provider nothing); so a provider
  that rotates its key is followed at once.
- An ID token: signed (RS/PS/ES/EdDSA only: never `none`, never a MAC with a secret
  anyone holding the client id might guess) by a key of the issuer's set, `iss` the
  issuer, `aud` holding the client id, `azp` the client id when there are several
  audiences (or whenever given), `exp` not past and `iat` not ahead (both with
  `skew_s`), `iat` not older than `max_age_s`, and `nonce` the one the flow sent.
"""

from __future__ import annotations

import base64
import hmac
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote_plus, urlsplit

import aiohttp
import jwt
import msgspec

from infra import jsonbody

MAX_BODY = 256 * 1024
TIMEOUT_S = 10.0
SIGNING_ALGS = frozenset(
    {"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"}
)
WELL_KNOWN = "/.well-known/openid-configuration"


class OidcError(Exception):
    """A sign-in that cannot go on; `reason` is a stable slug the UI and API show."""

    reason = "sso-failed"
    retryable = False

    def __init__(self, detail: str, *, reason: str | None = None) -> None:
        super().__init__(detail)
        if reason is not None:
            self.reason = reason


class ProviderUnreachable(OidcError):
    """The provider did not answer (or not in time, or not JSON): maybe later."""

    reason = "sso-provider-unavailable"
    retryable = True


class TokenRefused(OidcError):
    """The ID token (or the provider's answer carrying it) fails a check."""

    reason = "sso-token-refused"


class Discovery(msgspec.Struct, frozen=True, kw_only=True):
    issuer: str
    authorization_endpoint: str
    token_endpoint: str
    jwks_uri: str
    device_authorization_endpoint: str = ""
    id_token_signing_alg_values_supported: list[str] = []


Connect = Callable[[], aiohttp.ClientSession]
# Judges a URL's address before it is reached (an IP literal, which no resolver sees);
# raises OidcError to refuse it.
Guard = Callable[[str], Awaitable[None]]


async def no_guard(url: str) -> None:
    """Judges nothing: for a caller that reaches only what it chose itself."""


def plain_session() -> aiohttp.ClientSession:
    """A session that judges no address: for a caller that reaches only what it chose."""
    return aiohttp.ClientSession()


@dataclass
class _Keys:
    keys: dict[str, jwt.PyJWK] = field(default_factory=dict)
    fetched: float = 0.0
    forced: float = float("-inf")  # the last refetch an unknown key id caused


class OidcClient:
    """Discovery, keys and tokens of every issuer this process talks to."""

    def __init__(
        self,
        connect: Connect,
        guard: Guard = no_guard,
        *,
        now: Callable[[], float] = time.time,
        skew_s: float = 60.0,
        max_age_s: float = 600.0,
        refetch_s: float = 30.0,
        cache_s: float = 3600.0,
    ) -> None:
        self.connect = connect
        self.guard = guard
        self.now = now
        self.skew_s = skew_s
        self.max_age_s = max_age_s
        self.refetch_s = refetch_s
        self.cache_s = cache_s
        self._discovered: dict[str, tuple[float, Discovery]] = {}
        self._keys: dict[str, _Keys] = {}
        self.jwks_fetches = 0  # read by the tests: each fetch of any issuer's key set

    # ------------------------------------------------------------ HTTP

    async def _json(self, method: str, url: str, **kw: Any) -> tuple[int, Any]:
        await self.guard(url)
        try:
            async with self.connect() as session:
                timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
                async with session.request(
                    method, url, allow_redirects=False, timeout=timeout, **kw
                ) as r:
                    raw = await r.content.read(MAX_BODY + 1)
                    status = r.status
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise ProviderUnreachable(f"{_host(url)} did not answer: {_short(e)}") from e
        if len(raw) > MAX_BODY:
            raise ProviderUnreachable(f"{_host(url)} answered more than {MAX_BODY} bytes")
        try:  # an organization's admin runs the provider: its JSON is bounded like a body
            return status, jsonbody.decode(raw)
        except (msgspec.DecodeError, jsonbody.BodyError) as e:
            raise ProviderUnreachable(f"{_host(url)} answered {status}, not JSON: {e}") from e

    # ------------------------------------------------------------ discovery

    async def discover(self, issuer: str, *, fresh: bool = False) -> Discovery:
        """The issuer's provider metadata (cached `cache_s`); OidcError if it has none or
        it names another issuer."""
        cached = self._discovered.get(issuer)
        if cached and not fresh and self.now() - cached[0] < self.cache_s:
            return cached[1]
        status, doc = await self._json("GET", issuer.rstrip("/") + WELL_KNOWN)
        if status != 200 or not isinstance(doc, dict):
            raise OidcError(
                f"{issuer} serves no OpenID configuration (HTTP {status})",
                reason="sso-unknown-issuer",
            )
        try:
            found = msgspec.convert(doc, Discovery)
        except msgspec.ValidationError as e:
            raise OidcError(f"{issuer}'s configuration: {e}", reason="sso-unknown-issuer") from e
        if found.issuer != issuer:
            raise OidcError(
                f"{issuer}'s configuration names another issuer ({found.issuer[:200]!r})",
                reason="sso-issuer-mismatch",
            )
        for url in (found.authorization_endpoint, found.token_endpoint, found.jwks_uri):
            if urlsplit(url).scheme not in ("https", urlsplit(issuer).scheme):
                raise OidcError(f"{issuer} names an endpoint that is no https:// URL")
        self._discovered[issuer] = (self.now(), found)
        return found

    # ------------------------------------------------------------ keys

    async def _fetch_keys(self, issuer: str) -> _Keys:
        found = await self.discover(issuer)
        self.jwks_fetches += 1
        status, doc = await self._json("GET", found.jwks_uri)
        if status != 200 or not isinstance(doc, dict) or not isinstance(doc.get("keys"), list):
            raise ProviderUnreachable(f"{issuer}'s key set is not a JWKS (HTTP {status})")
        keys: dict[str, jwt.PyJWK] = {}
        for raw in doc["keys"]:
            if not isinstance(raw, dict) or raw.get("use", "sig") != "sig":
                continue
            try:
                key = jwt.PyJWK(raw)
            except (jwt.PyJWKError, jwt.InvalidKeyError, ValueError, TypeError):
                continue  # a key of a type this side does not use
            keys[str(raw.get("kid", ""))] = key
        entry = self._keys.setdefault(issuer, _Keys())
        entry.keys, entry.fetched = keys, self.now()
        return entry

    async def key(self, issuer: str, kid: str) -> jwt.PyJWK:
        """The issuer's signing key `kid` ("" when the token names none: the set's only
        key). Refetches the set for a key id it does not hold, rate-limited."""
        entry = self._keys.get(issuer)
        if entry is None or self.now() - entry.fetched >= self.cache_s:
            entry = await self._fetch_keys(issuer)
        found = _pick(entry.keys, kid)
        if found is None and await self.refetch(issuer):
            found = _pick(self._keys[issuer].keys, kid)
        if found is None:
            raise TokenRefused(f"the token's key {kid[:64]!r} is not in {issuer}'s key set")
        return found

    async def refetch(self, issuer: str) -> bool:
        """Fetch the issuer's key set again unless an unknown key did within `refetch_s`
        (whatever tokens come, a provider is asked at most once per that time)."""
        entry = self._keys.setdefault(issuer, _Keys())
        if self.now() - entry.forced < self.refetch_s:
            return False
        entry.forced = self.now()
        await self._fetch_keys(issuer)
        return True

    # ------------------------------------------------------------ the code and the token

    async def exchange(
        self,
        found: Discovery,
        *,
        code: str,
        redirect_uri: str,
        verifier: str,
        client_id: str,
        client_secret: str,
    ) -> str:
        """The ID token the token endpoint gives for `code` (PKCE's verifier with it)."""
        form = {
            "grant_type": "authorization_code",
            "code": code,
            "redirect_uri": redirect_uri,
            "code_verifier": verifier,
            "client_id": client_id,
        }
        headers = {"Authorization": _basic(client_id, client_secret)} if client_secret else {}
        status, doc = await self._json("POST", found.token_endpoint, data=form, headers=headers)
        if status != 200 or not isinstance(doc, dict):
            error = doc.get("error", "") if isinstance(doc, dict) else ""
            raise TokenRefused(
                f"the provider refused the code (HTTP {status} {str(error)[:64]})".strip(),
                reason="sso-code-refused",
            )
        token = doc.get("id_token")
        if not isinstance(token, str) or not token:
            raise TokenRefused("the provider's answer has no ID token")
        return token

    async def verify(
        self, token: str, *, issuer: str, client_id: str, nonce: str
    ) -> dict[str, Any]:
        """The ID token's claims once every check of the module's docstring holds."""
        try:
            _shallow(token)
            header = jwt.get_unverified_header(token)
        except (jwt.DecodeError, jsonbody.BodyError) as e:
            raise TokenRefused(f"the ID token is not a JWT: {e}") from e
        alg = header.get("alg")
        if alg not in SIGNING_ALGS:
            raise TokenRefused(f"the ID token's algorithm {str(alg)[:16]!r} is not accepted")
        kid = str(header.get("kid", ""))
        try:
            claims = self._decode(token, await self.key(issuer, kid), alg, issuer, client_id)
        except jwt.InvalidSignatureError as e:
            # a token naming no key, signed by a key the provider rotated in since
            if kid or not await self.refetch(issuer):
                raise TokenRefused("the ID token's signature does not verify") from e
            try:
                claims = self._decode(token, await self.key(issuer, kid), alg, issuer, client_id)
            except jwt.InvalidSignatureError as again:
                raise TokenRefused("the ID token's signature does not verify") from again
        self._check_claims(claims, client_id=client_id, nonce=nonce)
        return claims

    def _decode(
        self, token: str, key: jwt.PyJWK, alg: str, issuer: str, client_id: str
    ) -> dict[str, Any]:
        if getattr(key, "algorithm_name", alg) not in (alg, None):
            raise TokenRefused("the ID token's algorithm is not its key's")
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                key,
                algorithms=[alg],
                audience=client_id,
                issuer=issuer,
                options={
                    "require": ["iss", "sub", "aud", "exp", "iat"],
                    "verify_exp": False,  # checked below against this side's clock
                    "verify_iat": False,
                    "verify_nbf": False,
                },
            )
        except jwt.InvalidAudienceError as e:
            raise TokenRefused(
                "the ID token is for another client", reason="sso-wrong-audience"
            ) from e
        except jwt.InvalidIssuerError as e:
            raise TokenRefused(
                "the ID token is another issuer's", reason="sso-issuer-mismatch"
            ) from e
        except jwt.InvalidSignatureError:
            raise
        except jwt.PyJWTError as e:
            raise TokenRefused(f"the ID token does not verify: {_short(e)}") from e
        return claims

    def _check_claims(self, claims: dict[str, Any], *, client_id: str, nonce: str) -> None:
        aud = claims["aud"]
        audiences = [aud] if isinstance(aud, str) else aud
        if (len(audiences) > 1 or "azp" in claims) and claims.get("azp") != client_id:
            raise TokenRefused(
                "the ID token was given to another party (azp)", reason="sso-wrong-audience"
            )
        now = self.now()
        exp, iat = claims["exp"], claims["iat"]
        if not all(isinstance(v, int | float) for v in (exp, iat)):
            raise TokenRefused("the ID token's exp and iat are not numbers")
        if exp + self.skew_s <= now:
            raise TokenRefused("the ID token has expired", reason="sso-token-expired")
        if iat - self.skew_s > now or iat + self.max_age_s < now:
            raise TokenRefused("the ID token was not issued now", reason="sso-token-expired")
        nbf = claims.get("nbf")
        if isinstance(nbf, int | float) and nbf - self.skew_s > now:
            raise TokenRefused("the ID token is not valid yet", reason="sso-token-expired")
        sent = claims.get("nonce")
        if not isinstance(sent, str) or not hmac.compare_digest(sent.encode(), nonce.encode()):
            raise TokenRefused("the ID token's nonce is not this sign-in's", reason="sso-replay")


def _basic(client_id: str, secret: str) -> str:
    """HTTP Basic credentials as OAuth 2.0 has a client send them (RFC 6749 2.3.1: each
    part form-encoded first, so a ':' in the id cannot move the split)."""
    pair = f"{quote_plus(client_id)}:{quote_plus(secret)}".encode()
    return "Basic " + base64.b64encode(pair).decode()


def _shallow(token: str) -> None:
    """jsonbody.TooDeep if the token's header or claims nest deeper than JSON bodies may
    (PyJWT's json.loads would recurse until RecursionError: a 500, not a refusal)."""
    for part in token.split(".")[:2]:
        try:
            raw = base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))
        except ValueError:
            continue  # not base64: PyJWT refuses it (DecodeError)
        jsonbody.check_depth(raw, 32)


def _pick(keys: dict[str, jwt.PyJWK], kid: str) -> jwt.PyJWK | None:
    if kid:
        return keys.get(kid)
    return next(iter(keys.values())) if len(keys) == 1 else None


def _host(url: str) -> str:
    try:
        return urlsplit(url).netloc or url[:64]
    except ValueError:
        return url[:64]


def _short(e: BaseException) -> str:
    return (str(e) or type(e).__name__)[:200]
