"""Scanning for a canary secret in clear: every message of every JetStream stream (KV and
object store buckets are streams too) and every file under a directory (SQLite read
models and their WAL, the nats-server store, executor work directories). Holds no tests."""

from __future__ import annotations

from pathlib import Path

import nats.js.errors
from nats.js import JetStreamContext


async def assert_no_stream_holds(
    js: JetStreamContext, needles: list[bytes], *, required: set[str] | None = None
) -> dict[str, int]:
    """Read every message of every stream, KV_* and OBJ_* included, data and headers;
    return how many messages each stream had. `required` streams must exist."""
    streams = await js.streams_info()
    names = {s.config.name for s in streams}
    expected = required or {"RP_EVENTS", "KV_rp-secrets", "OBJ_rp-state", "OBJ_rp-plans"}
    assert expected <= names, f"missing streams: {expected - names}"
    scanned: dict[str, int] = {}
    for info in streams:
        name, state = str(info.config.name), info.state
        scanned[name] = 0
        for seq in range(state.first_seq, state.last_seq + 1):
            try:
                msg = await js.get_msg(name, seq)
            except nats.js.errors.NotFoundError:
                continue
            scanned[name] += 1
            raw = (msg.data or b"") + repr(msg.headers).encode()
            for needle in needles:
                assert needle not in raw, f"{name} message {seq} holds a secret in clear"
    return scanned


def assert_no_file_holds(root: Path, needles: list[bytes]) -> int:
    """Every file under `root`; at least one SQLite file must be among them. Returns the
    number of files scanned."""
    sqlite = [p for p in root.rglob("*.sqlite*") if p.is_file()]
    assert sqlite, "the read model's SQLite files are scanned"
    count = 0
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            count += 1
            data = path.read_bytes()
            for needle in needles:
                assert needle not in data, f"{path} holds a secret in clear"
    return count
