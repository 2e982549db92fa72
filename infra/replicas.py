"""How many copies JetStream keeps of what runplane declares, and why it never goes down.

The setting (`--replicas`, `RUNPLANE_REPLICAS`) decides; unset, it is 1 on a single
server and 3 on a cluster (or the cluster's size if smaller). Every process declares
the streams at its start, so a declaration keeps `max(existing, wanted)`: a process
started with a lower setting (or an older runplane) never takes copies away that an
operator or another process gave. Key-value buckets and object stores are streams
(`KV_<bucket>`, `OBJ_<bucket>`) and are raised the same way.
"""

from __future__ import annotations

import json
from typing import Any

from nats.aio.client import Client as NATS

MAX_REPLICAS = 5  # JetStream's own limit
CLUSTER_DEFAULT = 3


class ReplicationError(RuntimeError):
    """JetStream refused a declaration (e.g. more replicas than servers)."""

    retryable = False


def cluster_size(nc: NATS) -> int:
    """Servers in the cluster the connection is on (1: a single server).

    Read from the server's INFO: `cluster` is set on a clustered server and
    `connect_urls` lists the client URLs of the cluster's servers (its own included).
    A cluster that does not advertise them counts as the default size.
    """
    info: dict[str, Any] = nc._server_info  # nats-py keeps the server's INFO only here
    if not info.get("cluster"):
        return 1
    urls = set(info.get("connect_urls") or [])
    return len(urls) if urls else CLUSTER_DEFAULT


def wanted(nc: NATS, setting: int) -> int:
    """The replicas to declare: the setting, else the default for this server."""
    if setting:
        return setting
    return min(CLUSTER_DEFAULT, cluster_size(nc))


async def api(nc: NATS, subject: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    """One JetStream API request with a raw JSON answer (nats-py lacks newer fields)."""
    payload = json.dumps(body).encode() if body is not None else b""
    resp = await nc.request(subject, payload, timeout=10)
    answer: dict[str, Any] = json.loads(resp.data)
    return answer


async def stream_config(nc: NATS, name: str) -> dict[str, Any] | None:
    """The stream's raw configuration, or None when it does not exist."""
    answer = await api(nc, f"$JS.API.STREAM.INFO.{name}")
    if "error" in answer:
        if answer["error"].get("err_code") == 10059:  # stream not found
            return None
        raise ReplicationError(f"reading stream {name}: {answer['error'].get('description')}")
    config: dict[str, Any] = answer["config"]
    return config


def kept(existing: dict[str, Any] | None, want: int) -> int:
    """Never fewer replicas than the stream has."""
    have = int(existing.get("num_replicas") or 1) if existing else 0
    return max(have, want)


async def raise_stream(nc: NATS, name: str, want: int) -> bool:
    """Give an existing stream at least `want` replicas; True if it changed."""
    config = await stream_config(nc, name)
    if config is None or kept(config, 0) >= want:
        return False
    config["num_replicas"] = want
    answer = await api(nc, f"$JS.API.STREAM.UPDATE.{name}", config)
    if "error" in answer:
        raise ReplicationError(
            f"raising {name} to {want} replicas: {answer['error'].get('description')}"
        )
    return True


async def raise_consumer(nc: NATS, stream: str, name: str, want: int) -> bool:
    """A durable consumer pinned below `want` replicas follows its stream again (0:
    the stream's count, which a stream update then carries along); True if it changed."""
    answer = await api(nc, f"$JS.API.CONSUMER.INFO.{stream}.{name}")
    if "error" in answer:
        return False
    config: dict[str, Any] = answer["config"]
    pinned = int(config.get("num_replicas") or 0)
    if not config.get("durable_name") or pinned == 0 or pinned >= want:
        return False
    config["num_replicas"] = 0
    body = {"stream_name": stream, "config": config, "action": "update"}
    answer = await api(nc, f"$JS.API.CONSUMER.CREATE.{stream}.{name}", body)
    if "error" in answer:
        raise ReplicationError(
            f"raising consumer {stream}/{name}: {answer['error'].get('description')}"
        )
    return True
