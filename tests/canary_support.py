"""Scanning for a canary secret in clear: every message of every JetStream stream (KV and
object store buckets are streams too) and every file under a directory (SQLite read
models and their WAL, the nats-server store, executor work directories); and the canary
values with the characters encoders treat specially, in each encoding. Holds no tests."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import nats.js.errors
from nats.js import JetStreamContext


def tricky_canary() -> tuple[str, list[str]]:
    """A two-line secret with every character an encoder treats specially (`<>&"\\`, a
    quote, non-ASCII, U+2028, `${`, `%{`, a tab), and the random core of each line: no
    encoding changes a core, so a core found anywhere is a leak, whatever the encoding."""
    cores = [secrets.token_hex(8), secrets.token_hex(8)]
    value = f"cnry-{cores[0]}-<>&\"\\'é✓\u2028$" + "\n" + f"cnry-{cores[1]}-${{x}}%{{y}}\t!"
    return value, cores


def encodings(value: str) -> list[bytes]:
    """`value` and each of its lines as they are, and as a JSON string would hold them:
    Python's json (ASCII-only or not) and Go's (`<>&` as `\\u003c...`, U+2028 escaped)."""
    out: set[str] = set()
    for text in {value, *value.split("\n")}:
        go = json.dumps(text, ensure_ascii=False)[1:-1]
        for ch, esc in (
            ("<", "\\u003c"),
            (">", "\\u003e"),
            ("&", "\\u0026"),
            ("\u2028", "\\u2028"),
        ):
            go = go.replace(ch, esc)
        out |= {text, json.dumps(text)[1:-1], json.dumps(text, ensure_ascii=False)[1:-1], go}
    return sorted(o.encode() for o in out if o)


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
        # an empty stream (a bucket nothing was put in yet) may say first_seq 0
        for seq in range(max(1, state.first_seq), state.last_seq + 1):
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
