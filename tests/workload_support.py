"""Workload identity tokens checked as a cloud checks them (docs/workload-identity.md).
Holds no tests itself."""

from __future__ import annotations

import json
from typing import Any

import jwt
from jwt.algorithms import RSAAlgorithm

ISSUER = "http://127.0.0.1:8080"  # the test deployment's (no --public-url: http://<listen>)


def verify(token: str, jwks: dict[str, Any], audience: str, issuer: str = ISSUER) -> Any:
    """What a cloud does with a token: the key its `kid` names, then every check."""
    kid = jwt.get_unverified_header(token)["kid"]
    jwk = next(k for k in jwks["keys"] if k["kid"] == kid)
    key = RSAAlgorithm.from_jwk(json.dumps(jwk))
    return jwt.decode(
        token,
        key,  # type: ignore[arg-type]  # an RSA public key from a public JWK
        algorithms=["RS256"],
        audience=audience,
        issuer=issuer,
        options={"require": ["exp", "iat", "nbf", "sub", "iss", "aud", "jti"]},
    )
