"""How a runplane process reaches NATS: the server list and the credentials it presents.

Credentials are held here and handed to nats-py only: never on a command line (argv is
world-readable in `/proc`), never in a log line (`NatsAuth`'s repr shows which kinds are
set, not their values), never in a URL (a URL is printed in errors and logs, so one with
`user:password@` is refused).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import nats
import nats.errors
from nats.aio.client import Client as NATS

_SCHEMES = ("nats", "tls", "ws", "wss")


class NatsSettingError(ValueError):
    """A NATS setting is wrong or unusable; the message says which and how to fix it."""

    retryable = False


def server_list(values: Iterable[str]) -> list[str]:
    """`--nats-url` values (each may be comma separated) as a list of `scheme://host:port`.

    A bare `host:port` gets `nats://`; credentials inside a URL are refused (they would
    end up in argv, errors and logs).
    """
    urls: list[str] = []
    for value in values:
        for part in value.split(","):
            if part := part.strip():
                urls.append(_one_url(part))
    return urls


def _one_url(text: str) -> str:
    url = text if "://" in text else f"nats://{text}"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise NatsSettingError(f"bad NATS URL {text!r}: {e}") from e
    if parts.scheme not in _SCHEMES:
        raise NatsSettingError(f"bad NATS URL {text!r}: scheme must be one of {_SCHEMES}")
    if "@" in parts.netloc:
        raise NatsSettingError(
            f"NATS URL {parts.scheme}://...@{parts.hostname}: put credentials in "
            "RUNPLANE_NATS_USER/RUNPLANE_NATS_PASSWORD (or a token, nkey or creds file), "
            "not in the URL"
        )
    if not parts.hostname:
        raise NatsSettingError(f"bad NATS URL {text!r}: no host")
    return f"{parts.scheme}://{parts.netloc}" if port else f"{parts.scheme}://{parts.hostname}"


def _read_secret(path: Path, what: str) -> str:
    try:
        value = path.read_text().strip()
    except OSError as e:
        raise NatsSettingError(f"cannot read {what} file {path}: {e.strerror or e}") from e
    if not value:
        raise NatsSettingError(f"{what} file {path} is empty")
    return value


@dataclass(frozen=True)
class NatsAuth:
    """What a client presents to NATS. Secrets come from the environment or from files
    (`*_file`), read when connecting; `repr` never shows them."""

    user: str = ""
    password: str = field(default="", repr=False)
    password_file: Path | None = None
    token: str = field(default="", repr=False)
    token_file: Path | None = None
    nkey_seed: Path | None = None  # an nkey seed file
    creds: Path | None = None  # a `.creds` file (JWT and nkey seed)
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str], **flags: Any) -> NatsAuth:
        """Flags (non-empty ones) win over `RUNPLANE_NATS_*` environment variables."""

        def pick(name: str) -> str:
            flag = flags.get(name)
            return str(flag) if flag else env.get(f"RUNPLANE_NATS_{name.upper()}", "")

        def path(name: str) -> Path | None:
            value = pick(name)
            return Path(value) if value else None

        return cls(
            user=pick("user"),
            password=env.get("RUNPLANE_NATS_PASSWORD", ""),
            password_file=path("password_file"),
            token=env.get("RUNPLANE_NATS_TOKEN", ""),
            token_file=path("token_file"),
            nkey_seed=path("nkey"),
            creds=path("creds"),
            tls_ca=path("tls_ca"),
            tls_cert=path("tls_cert"),
            tls_key=path("tls_key"),
        )

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for `nats.connect` (files are read now)."""
        opts: dict[str, Any] = {}
        password = self.password or (
            _read_secret(self.password_file, "NATS password") if self.password_file else ""
        )
        token = self.token or (
            _read_secret(self.token_file, "NATS token") if self.token_file else ""
        )
        if password and not self.user:
            raise NatsSettingError("a NATS password needs a user (--nats-user)")
        if self.user:
            opts["user"], opts["password"] = self.user, password
        if token:
            opts["token"] = token
        for key, given in (("nkeys_seed", self.nkey_seed), ("user_credentials", self.creds)):
            if given is not None:
                _need_nkeys(given)
                opts[key] = str(given)
        if tls := self._tls():
            opts["tls"] = tls
        return opts

    def _tls(self) -> ssl.SSLContext | None:
        if self.tls_ca is None and self.tls_cert is None:
            return None
        if (self.tls_cert is None) != (self.tls_key is None):
            raise NatsSettingError("--nats-tls-cert and --nats-tls-key go together")
        try:
            ctx = ssl.create_default_context(
                cafile=str(self.tls_ca) if self.tls_ca is not None else None
            )
            if self.tls_cert is not None and self.tls_key is not None:
                ctx.load_cert_chain(str(self.tls_cert), str(self.tls_key))
        except (OSError, ssl.SSLError) as e:
            raise NatsSettingError(f"NATS TLS files: {e}") from e
        return ctx


def _need_nkeys(path: Path) -> None:
    if not path.is_file():
        raise NatsSettingError(f"NATS nkey/creds file {path} not found")
    try:
        import nkeys  # type: ignore[import-untyped,import-not-found,unused-ignore]  # noqa: F401
    except ImportError as e:
        raise NatsSettingError(
            "an nkey seed or creds file needs the nkeys package: pip install nkeys"
        ) from e


class NatsUnreachableError(ConnectionError):
    """No server of the list answered; the message names each one and why."""

    retryable = True


async def connect(servers: list[str], auth: NatsAuth, *, timeout: float, **kwargs: Any) -> NATS:
    """A connection that keeps reconnecting across `servers`. Not reached within
    `timeout`: `NatsUnreachableError` naming each server and what the client said."""
    options = auth.connect_options()
    try:
        return await asyncio.wait_for(
            nats.connect(
                servers=servers,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                **options,
                **kwargs,
            ),
            timeout,
        )
    except (TimeoutError, OSError, nats.errors.Error) as e:
        reasons = await asyncio.gather(*(_why(url, options) for url in servers))
        detail = ", ".join(f"{url} ({why})" for url, why in zip(servers, reasons, strict=True))
        raise NatsUnreachableError(f"cannot reach NATS at {detail}") from e


async def _why(url: str, options: dict[str, Any]) -> str:
    """One quick attempt at one server, to say why it failed. nats-py reports a socket
    error only to `error_cb` (it raises "no servers" after), so the first one is kept."""
    nc = NATS()
    seen: list[Exception] = []

    async def record(e: Exception) -> None:
        seen.append(e)

    try:
        await asyncio.wait_for(
            nc.connect(
                servers=[url],
                allow_reconnect=False,
                max_reconnect_attempts=1,
                reconnect_time_wait=0.1,  # type: ignore[arg-type]  # seconds, a float works
                connect_timeout=2,
                error_cb=record,
                **options,
            ),
            4,
        )
    except (TimeoutError, OSError, nats.errors.Error) as e:
        first = seen[0] if seen else e
        if isinstance(first, TimeoutError):
            return "TimeoutError: no answer"
        return f"{type(first).__name__}: {_reason(first)}"
    await nc.close()
    return "answered now, but not in time"


def _reason(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    if isinstance(e, OSError) and e.strerror:
        text = e.strerror
    return text.removeprefix("nats: ").strip("'")


def client_env(auth: NatsAuth) -> dict[str, str]:
    """The `RUNPLANE_NATS_*` variables that give a child runplane process these
    credentials (secrets travel in the environment, never in argv)."""
    env: dict[str, str] = {}
    if auth.user:
        env["RUNPLANE_NATS_USER"] = auth.user
    if auth.password:
        env["RUNPLANE_NATS_PASSWORD"] = auth.password
    if auth.token:
        env["RUNPLANE_NATS_TOKEN"] = auth.token
    return env


__all__ = [
    "NatsAuth",
    "NatsSettingError",
    "NatsUnreachableError",
    "client_env",
    "connect",
    "server_list",
]
