"""Posting to Slack's `response_url`: only to Slack's hooks unless the deployment says.

A `response_url` comes in a signed request, so only Slack or whoever holds the signing
secret (the organization's admin) chose it; still, runplane would POST there from inside
the deployment's network, so it must be Slack's (`https://hooks.slack.com/`) unless the
deployment lists other prefixes (`RP_SLACK_RESPONSE_URLS`, comma separated: tests and
`runplane up` on loopback). A refused or failed post is logged, never raised into the
command it reports on: the command stands.
"""

from __future__ import annotations

import os
from typing import Any

import aiohttp
import structlog
from yarl import URL

log = structlog.get_logger(__name__)

SLACK_HOOKS = "https://hooks.slack.com/"
ENV = "RP_SLACK_RESPONSE_URLS"
TIMEOUT_S = 5.0


def allowed_prefixes() -> tuple[str, ...]:
    extra = [p.strip() for p in os.environ.get(ENV, "").split(",") if p.strip()]
    return (SLACK_HOOKS, *extra)


def _origin(url: URL) -> tuple[str, str | None, int | None]:
    return url.scheme, url.host, url.port


class Poster:
    """POSTs messages to response URLs. Inside `async with` it keeps one HTTP session;
    outside, each post opens its own (a subscriber posts a few times per run)."""

    def __init__(self, prefixes: tuple[str, ...] | None = None) -> None:
        self.prefixes = prefixes if prefixes is not None else allowed_prefixes()
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Poster:
        timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
        self._session = aiohttp.ClientSession(timeout=timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def allowed(self, url: str) -> bool:
        """`url` starts with an allowed prefix and goes where that prefix does: the same
        scheme, host and port, no credentials (a prefix `http://127.0.0.1:8080` is a
        prefix of `http://127.0.0.1:8080@10.0.0.1/` too, which goes to 10.0.0.1)."""
        try:
            target = URL(url)
        except ValueError:
            return False
        if target.raw_user is not None or target.raw_password is not None:
            return False
        return any(url.startswith(p) and _origin(URL(p)) == _origin(target) for p in self.prefixes)

    async def post(self, url: str, message: dict[str, Any]) -> int:
        """POST `message`; the HTTP status, or 0 if it was not sent (refused, failed)."""
        if not url or not self.allowed(url):
            log.warning("slack_response_url_refused", url=url[:80])
            return 0
        try:
            if self._session is not None:
                return await self._send(self._session, url, message)
            timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                return await self._send(session, url, message)
        except (aiohttp.ClientError, TimeoutError) as e:
            log.warning("slack_post_failed", error=repr(e))
            return 0

    @staticmethod
    async def _send(session: aiohttp.ClientSession, url: str, message: dict[str, Any]) -> int:
        async with session.post(url, json=message, allow_redirects=False) as resp:
            await resp.read()
            if resp.status >= 400:
                log.warning("slack_post_failed", status=resp.status)
            return resp.status
