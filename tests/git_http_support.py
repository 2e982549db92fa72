"""A git server over HTTP that wants a password: `git http-backend` (git's own smart HTTP
server, as CGI) behind HTTP Basic authentication, on 127.0.0.1, offline. Every request
without the right `Authorization` is 401 (and counted), as a private repository on a
forge answers. Holds no tests itself."""

from __future__ import annotations

import base64
import os
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.executor_support import git


@dataclass
class GitServer:
    """Serves the bare repositories under `root` at `url`/<name>.git to any of `accounts`
    (user -> password)."""

    root: Path
    accounts: dict[str, str]
    url: str = ""
    refused: int = 0  # requests without a valid credential (401)
    served: list[str] = field(default_factory=list)  # the user of each request served
    seen_auth: list[str] = field(default_factory=list)  # every Authorization header sent

    def repository(self, name: str, work: Path) -> str:
        """A bare copy of the work repository `work` served as `<name>.git`; its URL."""
        bare = self.root / f"{name}.git"
        git(self.root, "clone", "-q", "--bare", str(work), str(bare))
        git(bare, "config", "http.receivepack", "false")
        return f"{self.url}/{name}.git"

    def credential_line(self, user: str) -> str:
        """`user`'s credential as `~/.git-credentials` stores it."""
        host = self.url.split("://", 1)[1]
        return f"http://{user}:{self.accounts[user]}@{host}\n"


def _handler(server: GitServer) -> type[BaseHTTPRequestHandler]:
    wanted = {
        "Basic " + base64.b64encode(f"{user}:{pw}".encode()).decode(): user
        for user, pw in server.accounts.items()
    }

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            self._serve()

        def do_POST(self) -> None:
            self._serve()

        def _serve(self) -> None:
            given = self.headers.get("Authorization", "")
            if given:
                server.seen_auth.append(given)
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            user = wanted.get(given)
            if user is None:
                server.refused += 1
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Basic realm="private"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            server.served.append(user)
            self._backend(body, user)

        def _backend(self, body: bytes, user: str) -> None:
            path, _, query = self.path.partition("?")
            env = {
                "PATH": os.environ.get("PATH", os.defpath),
                "HOME": str(server.root),
                "GIT_PROJECT_ROOT": str(server.root),
                "GIT_HTTP_EXPORT_ALL": "1",
                "PATH_INFO": path,
                "QUERY_STRING": query,
                "REQUEST_METHOD": self.command,
                "CONTENT_TYPE": self.headers.get("Content-Type", ""),
                "CONTENT_LENGTH": str(len(body)),
                "HTTP_CONTENT_ENCODING": self.headers.get("Content-Encoding", ""),
                "GIT_PROTOCOL": self.headers.get("Git-Protocol", ""),
                "REMOTE_USER": user,
                "REMOTE_ADDR": "127.0.0.1",
            }
            done = subprocess.run(
                ["git", "http-backend"], input=body, env=env, capture_output=True, check=False
            )
            head, _, payload = done.stdout.partition(b"\r\n\r\n")
            status, headers = 200, []
            for line in head.decode("latin-1").split("\r\n"):
                name, _, value = line.partition(":")
                if name.lower() == "status":
                    status = int(value.split()[0])
                elif name:
                    headers.append((name, value.strip()))
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    return Handler


@contextmanager
def git_server(root: Path, accounts: dict[str, str]) -> Iterator[GitServer]:
    """A `GitServer` on a free port of 127.0.0.1 for the block."""
    root.mkdir(parents=True, exist_ok=True)
    server = GitServer(root, dict(accounts))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(server))
    server.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        httpd.shutdown()
        httpd.server_close()
