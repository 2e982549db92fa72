"""`runplane nats status [--repair]`: the replication of everything runplane declares.

One line per stream, bucket and consumer: replicas (configured/wanted), leader, the
other replicas (current, or how far behind: a raised stream catches up in the
background) and messages (consumers: pending and unacked).
`--repair` raises what is below the setting (`--replicas`, or the server's default) the
way a process start does, without restarting anything. Exit 1 while something stays
below the setting, so a check in a script sees it.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from nats.aio.client import Client as NATS

from infra import replicas as rep
from infra import streams
from infra.kv import BUCKETS
from infra.natsserver import URL_FILE, server_credentials
from infra.options import ConfigError, Options
from services.root.runtime import connected, embedded_or_given

STREAMS = (streams.EVENTS, streams.AUDIT, streams.DISPATCH, streams.HEARTBEATS, streams.LOGS)


def declared() -> list[tuple[str, str]]:
    """(kind, stream) of everything runplane declares, in the order it is listed."""
    return (
        [("stream", name) for name in STREAMS]
        + [("kv", f"KV_{b}") for b in BUCKETS]
        + [("object", f"OBJ_{b}") for b in streams.OBJECT_BUCKETS]
    )


@dataclass
class Row:
    kind: str
    name: str
    have: int
    leader: str
    peers: str
    messages: str
    durable: bool = True

    def line(self, want: int) -> str:
        wanted = f"{self.have}/{want}" if self.durable else f"{self.have} (ephemeral)"
        return (
            f"{self.kind:<9} {self.name:<38} {wanted:<15} {self.leader:<10} "
            f"{self.peers:<28} {self.messages}"
        )

    def below(self, want: int) -> bool:
        return self.durable and self.have < want


def _peers(cluster: dict[str, Any]) -> str:
    """The non-leader replicas: `current`, or their lag in operations."""
    out = []
    for peer in cluster.get("replicas") or []:
        state = "offline" if peer.get("offline") else None
        if state is None and peer.get("current"):
            state = "current"
        elif state is None:
            state = f"lag {peer['lag']}" if peer.get("lag") else "catching up"
        out.append(f"{peer.get('name', '?')} {state}")
    return ", ".join(out) or "-"


def _label(kind: str, stream: str) -> str:
    return stream.split("_", 1)[1] if kind in ("kv", "object") else stream


async def _stream_rows(nc: NATS, kind: str, stream: str) -> list[Row]:
    info = await rep.api(nc, f"$JS.API.STREAM.INFO.{stream}")
    if "error" in info:
        return [Row(kind, _label(kind, stream), 0, "-", "missing", "-")]
    cluster = info.get("cluster") or {}
    have = int(info["config"].get("num_replicas") or 1)
    rows = [
        Row(
            kind,
            _label(kind, stream),
            have,
            cluster.get("leader") or "-",
            _peers(cluster),
            str(info["state"].get("messages", 0)),
        )
    ]
    return rows + await _consumer_rows(nc, stream, have)


async def _consumer_rows(nc: NATS, stream: str, stream_replicas: int) -> list[Row]:
    """The stream's consumers; one that does not pin its replicas has the stream's (what
    JetStream is asked to keep: the other replicas column shows how far it got)."""
    rows, offset = [], 0
    while True:
        page = await rep.api(nc, f"$JS.API.CONSUMER.LIST.{stream}", {"offset": offset})
        found = page.get("consumers") or []
        for c in found:
            cluster = c.get("cluster") or {}
            config = c.get("config") or {}
            rows.append(
                Row(
                    "consumer",
                    f"{stream} > {c['name']}",
                    int(config.get("num_replicas") or stream_replicas),
                    cluster.get("leader") or "-",
                    _peers(cluster),
                    f"pending {c.get('num_pending', 0)}, unacked {c.get('num_ack_pending', 0)}",
                    durable=bool(config.get("durable_name")),
                )
            )
        offset += len(found)
        if not found or offset >= int(page.get("total", 0)):
            return rows


async def collect(nc: NATS) -> list[Row]:
    rows: list[Row] = []
    for kind, stream in declared():
        rows += await _stream_rows(nc, kind, stream)
    return rows


async def raise_all(nc: NATS, want: int) -> list[str]:
    """Raise every declared stream (and consumer pinned below it) to `want`."""
    changed = []
    for _, stream in declared():
        if await rep.raise_stream(nc, stream, want):
            changed.append(stream)
        page = await rep.api(nc, f"$JS.API.CONSUMER.NAMES.{stream}", {"offset": 0})
        for name in page.get("consumers") or []:
            if await rep.raise_consumer(nc, stream, name, want):
                changed.append(f"{stream} > {name}")
    return changed


async def connect(opts: Options, stack: AsyncExitStack) -> NATS:
    """The given servers; else the embedded server of a running `runplane up` on this
    data directory; else the embedded server started here (as `replay` does)."""
    if not opts.nats_url:
        nats_dir = opts.data_dir / "nats"
        if (url := _running_url(nats_dir)) is not None:
            try:
                running = connected([url], server_credentials(nats_dir), timeout=3)
                return await stack.enter_async_context(running)
            except ConfigError:
                pass  # not running any more: start it below
    servers, auth = await embedded_or_given(opts, stack)
    return await stack.enter_async_context(connected(servers, auth))


def _running_url(nats_dir: Path) -> str | None:
    try:
        return (nats_dir / URL_FILE).read_text().strip() or None
    except OSError:
        return None


async def status(opts: Options, stack: AsyncExitStack, *, repair: bool, out: TextIO) -> int:
    nc = await connect(opts, stack)
    want = rep.wanted(nc, opts.replicas)
    if repair:
        try:
            for name in await raise_all(nc, want):
                print(f"raised {name} to {want} replicas", file=out)
        except rep.ReplicationError as e:
            raise ConfigError(str(e)) from e
    rows = await collect(nc)
    print(
        f"{'KIND':<9} {'NAME':<38} {'REPLICAS':<15} {'LEADER':<10} {'OTHER REPLICAS':<28} MESSAGES",
        file=out,
    )
    for row in rows:
        print(row.line(want), file=out)
    low = [r.name for r in rows if r.below(want)]
    where = f"cluster of {rep.cluster_size(nc)}" if rep.cluster_size(nc) > 1 else "one server"
    if low:
        print(
            f"replication: {len(low)} below {want} ({where}): {', '.join(low)}; "
            "run `runplane nats status --repair`",
            file=out,
        )
        return 1
    print(f"replication: everything at {want} or more ({where})", file=out)
    return 0


__all__ = ["collect", "declared", "raise_all", "status"]
