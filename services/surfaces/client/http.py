"""The HTTP side of the client: one aiohttp session per command, TLS verified.

Certificates are checked against the system's store (which honours `SSL_CERT_FILE` and
`SSL_CERT_DIR`) or, with `--ca-file`, against that file only; there is no way to turn
the check off. An answer is read up to `MAX_BODY` bytes (after decompression) and must
be JSON: a server is trusted with a token, not with the client's memory or terminal.
Errors become one `ClientError`: an API problem says its `detail` and `type`.
"""

from __future__ import annotations

import asyncio
import ssl
from types import TracebackType
from typing import Any, Self

import aiohttp
import msgspec

from services.surfaces.client.errors import ClientError

MAX_BODY = 16 << 20  # a page of 1,000 full runs is a few MiB
PROBLEMS = "https://runplane.dev/problems/"
CLIENT_HEADER = "X-Runplane-Client"  # tells the API a run it creates has cause `cli`
SEQ = "RP-Seq"
MIN_SEQ = "RP-Min-Seq"
_TIMEOUT = aiohttp.ClientTimeout(total=60, connect=10)
_RETRYABLE = frozenset({502, 503, 504})


class Answer(msgspec.Struct, frozen=True, kw_only=True):
    status: int
    body: Any
    seq: int = 0  # RP-Seq of a command's answer: send it back as RP-Min-Seq


def tls_context(ca_file: str) -> ssl.SSLContext:
    try:
        return ssl.create_default_context(cafile=ca_file or None)
    except (OSError, ssl.SSLError) as e:
        raise ClientError(f"--ca-file {ca_file}: {_reason(e)}", kind="tls") from e


class Api:
    """Calls one server's API with one token; an async context manager."""

    def __init__(self, url: str, token: str, *, ca_file: str = "") -> None:
        self.url = url
        self.token = token
        self.tls = tls_context(ca_file)
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        self._http = aiohttp.ClientSession(
            timeout=_TIMEOUT,
            connector=aiohttp.TCPConnector(ssl=self.tls),
            headers={
                "Authorization": f"Bearer {self.token}",
                "User-Agent": "runplane-cli",
                CLIENT_HEADER: "cli",
                "Accept": "application/json",
            },
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._http is not None:
            await self._http.close()

    async def get(self, path: str, *, query: dict[str, str] | None = None, min_seq: int = 0) -> Any:
        headers = {MIN_SEQ: str(min_seq)} if min_seq else {}
        return (await self.call("GET", path, query=query, headers=headers)).body

    async def post(self, path: str, body: dict[str, Any]) -> Answer:
        return await self.call("POST", path, json=body)

    async def call(
        self,
        method: str,
        path: str,
        *,
        query: dict[str, str] | None = None,
        json: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> Answer:
        """One request; its JSON answer, or a ClientError saying why not."""
        assert self._http is not None, "used inside `async with`"
        try:
            async with self._http.request(
                method,
                self.url + path,
                params=query,
                json=json,
                headers=headers,
                allow_redirects=False,  # the token goes to the URL logged in to, nowhere else
            ) as resp:
                raw = await _read(resp)
                status, seq = resp.status, resp.headers.get(SEQ, "")
                location = resp.headers.get("Location", "?")
        except aiohttp.InvalidURL as e:
            raise ClientError(f"bad server URL {self.url!r}", kind="bad-url") from e
        except aiohttp.ClientSSLError as e:
            raise ClientError(f"TLS with {self.url} failed: {_reason(e)}", kind="tls") from e
        except (aiohttp.ClientConnectionError, TimeoutError) as e:
            raise ClientError(
                f"cannot reach {self.url} ({_reason(e)})", kind="unreachable", retryable=True
            ) from e
        except aiohttp.ClientError as e:
            raise ClientError(f"bad answer from {self.url}: {_reason(e)}", kind="bad-answer") from e
        if 300 <= status < 400:
            raise ClientError(
                f"{self.url} redirects to {location} (HTTP {status}): log in to that URL instead",
                kind="redirect",
            )
        body = self._decode(raw, status)
        if status >= 400:
            raise problem(status, body)
        return Answer(status=status, body=body, seq=int(seq) if seq.isdecimal() else 0)

    def _decode(self, raw: bytes, status: int) -> Any:
        if not raw:
            return None
        try:
            return msgspec.json.decode(raw)
        except msgspec.DecodeError as e:
            if status >= 400:  # a proxy's HTML error page, say: the status says enough
                return None
            raise ClientError(
                f"bad answer from {self.url}: HTTP {status}, not JSON", kind="bad-answer"
            ) from e


async def _read(resp: aiohttp.ClientResponse) -> bytes:
    body = bytearray()
    async for chunk in resp.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > MAX_BODY:
            raise ClientError(
                f"bad answer: more than {MAX_BODY >> 20} MiB (HTTP {resp.status})",
                kind="bad-answer",
            )
    return bytes(body)


def problem(status: int, body: Any) -> ClientError:
    """The error of a refused request: the problem's detail and type, else the status."""
    info = body if isinstance(body, dict) else {}
    detail, kind = info.get("detail"), info.get("type")
    slug = kind.removeprefix(PROBLEMS) if isinstance(kind, str) and kind else f"http-{status}"
    text = detail if isinstance(detail, str) and detail else f"the server answered {status}"
    for extra in ("missing", "reasons"):  # what an approval still lacks, say
        if isinstance(info.get(extra), list) and info[extra]:
            text += f"; {extra}: " + ", ".join(str(x) for x in info[extra])
    return ClientError(
        f"{text} ({status} {slug})", kind=slug, status=status, retryable=status in _RETRYABLE
    )


def _reason(e: BaseException) -> str:
    os_error = getattr(e, "os_error", None) or getattr(e, "certificate_error", None)
    if isinstance(os_error, ssl.SSLCertVerificationError):
        return f"certificate verify failed: {os_error.verify_message or os_error.reason}"
    if isinstance(os_error, OSError) and os_error.strerror:
        return str(os_error.strerror)
    if isinstance(e, ssl.SSLError | OSError) and (e.strerror or getattr(e, "reason", None)):
        return str(e.strerror or getattr(e, "reason", ""))
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    return str(e) or type(e).__name__
