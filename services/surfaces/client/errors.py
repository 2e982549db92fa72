"""The client's one error: what the user is told, in one line, before a non-zero exit."""

from __future__ import annotations


class ClientError(Exception):
    """Something went wrong talking to the API (or before): `kind` says what, stably
    (`bad-url`, `credentials`, `unreachable`, `tls`, `bad-answer`, or the API problem's
    slug); `retryable` when the same request may succeed later (a 503, a dropped
    connection), which `--wait` does a bounded number of times."""

    def __init__(
        self, message: str, *, kind: str, status: int = 0, retryable: bool = False
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status
        self.retryable = retryable
