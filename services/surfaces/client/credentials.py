"""The servers a user logged in to and their tokens: `$XDG_CONFIG_HOME/runplane/
credentials.json` (default `~/.config`).

A token is as good as a password, so the directory is 0700 and the file 0600 from its
first byte: it is written to a new file created with mode 0600 (`O_CREAT | O_EXCL`: the
umask can only take bits away, and an existing file or symlink is never reused), flushed,
then renamed over the old one, so a reader sees the old file or the new one, never a
half-written one, and nobody else ever sees either.

Several servers may be stored; the last one logged in to is the default.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec

from services.surfaces.client.errors import ClientError

FILE = "credentials.json"


class Login(msgspec.Struct, kw_only=True):
    """One server's token and who the server said it is."""

    token: str
    user: str = ""
    role: str = ""
    org: str | None = None


class _File(msgspec.Struct, kw_only=True):
    default: str = ""
    servers: dict[str, Login] = {}


def config_dir(env: Mapping[str, str] = os.environ) -> Path:
    base = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "runplane"


def normal_url(url: str) -> str:
    """The server's URL as stored: scheme and host lower case, no trailing slash; a URL
    that is not http(s)://host... is refused."""
    parts = urlsplit(url.strip())
    if parts.scheme.lower() not in ("http", "https") or not parts.netloc:
        raise ClientError(f"not an http(s) URL: {url!r}", kind="bad-url")
    if parts.query or parts.fragment:
        raise ClientError(f"a server URL has no query or fragment: {url!r}", kind="bad-url")
    path = parts.path.rstrip("/")
    return f"{parts.scheme.lower()}://{parts.netloc.lower()}{path}"


@dataclass
class Credentials:
    """The credentials file, loaded; `save()` writes it back."""

    path: Path
    default: str = ""
    servers: dict[str, Login] = field(default_factory=dict)

    @classmethod
    def load(cls, directory: Path | None = None) -> Credentials:
        path = (directory or config_dir()) / FILE
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return cls(path)
        except OSError as e:
            raise ClientError(f"cannot read {path}: {e.strerror}", kind="credentials") from e
        try:
            data = msgspec.json.decode(raw, type=_File)
        except msgspec.DecodeError as e:
            raise ClientError(
                f"{path} is not a credentials file ({e}); remove it and log in again",
                kind="credentials",
            ) from e
        return cls(path, data.default, dict(data.servers))

    def pick(self, server: str) -> tuple[str, Login | None]:
        """The server asked for (`--server` / RUNPLANE_URL), else the default; its login
        if there is one."""
        url = normal_url(server) if server else self.default
        return url, self.servers.get(url)

    def add(self, url: str, login: Login) -> None:
        """Store `login` for `url`, which becomes the default."""
        self.servers.pop(url, None)
        self.servers[url] = login  # last: the order says which login is the newest
        self.default = url

    def remove(self, url: str) -> bool:
        """Forget `url`; the newest login left becomes the default."""
        if self.servers.pop(url, None) is None:
            return False
        if self.default == url:
            self.default = next(reversed(self.servers), "")
        return True

    def save(self) -> None:
        data = msgspec.json.format(
            msgspec.json.encode(_File(default=self.default, servers=self.servers))
        )
        write_private(self.path, data + b"\n")


def write_private(path: Path, data: bytes) -> None:
    """Replace `path` with `data`, atomically, readable by its owner only."""
    directory = path.parent
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)  # one made earlier with a wider mode is tightened
    temp = directory / f".{path.name}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        temp.unlink()  # a leftover of a write that was killed
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
    _sync_dir(directory)


def _sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def describe(login: Login) -> dict[str, Any]:
    """What `login` shows of a stored login: never the token."""
    return {"user": login.user, "role": login.role, "org": login.org}
