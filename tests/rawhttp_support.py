"""A raw HTTP/1.1 client over an asyncio socket, for what aiohttp's client never does: send
a request's headers and only the first bytes of the body its Content-Length promises,
then wait for the answer. An answer that arrives is one the server gave without reading
the body (it was never sent); a server that reads first gives none, and the wait fails.
Holds no tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec

PROBLEM = "application/problem+json"
PROMPT_S = 5.0  # an answer "at once", on a loaded machine


@dataclass(frozen=True)
class Raw:
    """An answer: its status, headers (names in lower case) and body."""

    status: int
    headers: dict[str, str]
    body: bytes

    def problem(self, slug: str, status: int) -> dict[str, Any]:
        """Assert this is the problem `slug` with `status`; return its body."""
        assert self.status == status, (self.status, self.body[:300])
        assert self.headers.get("content-type", "").startswith(PROBLEM), self.headers
        doc: dict[str, Any] = msgspec.json.decode(self.body)
        assert doc["type"] == f"https://runplane.dev/problems/{slug}", doc
        assert doc["status"] == status and doc["title"] and doc["detail"], doc
        return doc

    @property
    def closes(self) -> bool:
        """Whether the server closes the connection after this answer."""
        return self.headers.get("connection", "").lower() == "close"


@dataclass
class Pending:
    """A request whose headers and first bytes were sent, its body unfinished."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    async def answer(self, timeout: float = PROMPT_S) -> Raw:
        """The server's answer, or TimeoutError if none comes within `timeout`."""
        async with asyncio.timeout(timeout):
            status_line = await self.reader.readline()
            assert status_line.startswith(b"HTTP/1.1 "), status_line
            headers: dict[str, str] = {}
            while (line := await self.reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            body = await self.reader.readexactly(int(headers.get("content-length", "0")))
        return Raw(status=int(status_line.split()[1]), headers=headers, body=body)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


@dataclass(frozen=True)
class RawClient:
    host: str
    port: int

    async def start(
        self,
        path: str,
        headers: dict[str, str],
        *,
        declared: int | None,
        sent: bytes = b"{",
    ) -> Pending:
        """POST `path` with `headers`, a Content-Length of `declared` (None: chunked,
        `sent` then being the first chunks as written) and only `sent` of the body."""
        reader, writer = await asyncio.open_connection(self.host, self.port)
        lines = [f"POST {path} HTTP/1.1", f"Host: {self.host}:{self.port}"]
        if declared is None:
            lines.append("Transfer-Encoding: chunked")
        else:
            lines.append(f"Content-Length: {declared}")
        lines += [f"{k}: {v}" for k, v in headers.items()]
        pending = Pending(reader, writer)
        await pending.send(("\r\n".join(lines) + "\r\n\r\n").encode() + sent)
        return pending

    async def early(
        self, path: str, headers: dict[str, str], *, declared: int, sent: bytes = b"{"
    ) -> Raw:
        """The answer to a request of which only `sent` of `declared` bytes were sent."""
        pending = await self.start(path, headers, declared=declared, sent=sent)
        try:
            return await pending.answer()
        finally:
            await pending.close()

    @contextlib.asynccontextmanager
    async def holding(
        self, count: int, path: str, headers: dict[str, str], *, declared: int
    ) -> AsyncIterator[list[Pending]]:
        """`count` requests left waiting for the rest of their bodies, closed at the end."""
        pending = [await self.start(path, headers, declared=declared) for _ in range(count)]
        try:
            yield pending
        finally:
            for p in pending:
                await p.close()


def chunk(data: bytes) -> bytes:
    """`data` as one chunk of a chunked body."""
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"
