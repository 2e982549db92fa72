"""Where a notification may be sent: the SSRF guard.

A tenant names the URL, so a destination could point the control plane at itself, at the
cloud's metadata service (169.254.169.254) or at anything on the private network. Every
address a destination's host resolves to is judged: loopback, private (RFC 1918, ULA,
CGNAT), link-local (the metadata service with it), multicast, unspecified and reserved
ranges are refused unless the deployment allows them (`RUNPLANE_NOTIFY_ALLOW`: a comma
list of `loopback`, `private`; `runplane up` allows `loopback`).

The check runs when a configuration is saved and again when it is sent to: the sender's
connector resolves through `GuardedResolver`, so the address actually connected to is the
one judged (a name that resolved to a public address at save time and to 127.0.0.1 now,
DNS rebinding, is refused), and redirects are never followed.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
from collections.abc import Iterable
from urllib.parse import urlsplit

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver

from services.processes.notifications import Refused

ENV_VAR = "RUNPLANE_NOTIFY_ALLOW"
KINDS = ("loopback", "private")
IP = ipaddress.IPv4Address | ipaddress.IPv6Address


def allowed_from_env() -> frozenset[str]:
    raw = os.environ.get(ENV_VAR, "")
    return frozenset(k.strip() for k in raw.split(",") if k.strip() in KINDS)


def kind_of(ip: IP) -> str:
    """ "public", "loopback", "private", or why it is never allowed. An IPv6 address that
    embeds an IPv4 one (mapped, NAT64, 6to4, Teredo) is judged by it too: routed through
    a NAT64 gateway or a 6to4 relay, 64:ff9b::a9fe:a9fe reaches 169.254.169.254."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return kind_of(ip.ipv4_mapped)
        for inner in _embedded(ip):
            if (kind := kind_of(inner)) != "public":
                return kind
        if ip in _NAT64:  # DNS64's synthesized address of a public IPv4 host
            return "public"
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"  # 169.254.169.254, the metadata service, among them
    if ip.is_multicast:
        return "multicast"
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_private or (isinstance(ip, ipaddress.IPv4Address) and ip in _CGNAT):
        return "private"
    if ip.is_reserved or not ip.is_global:
        return "reserved"
    return "public"


_CGNAT = ipaddress.IPv4Network("100.64.0.0/10")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052's well-known prefix
_NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")  # RFC 8215: any RFC 6052 length


def _embedded(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses `ip` may carry: NAT64's (the local-use prefix's at every place
    RFC 6052 allows, since its length is the operator's choice), 6to4's, Teredo's server
    and client."""
    n = int(ip)
    if ip in _NAT64:
        return [ipaddress.IPv4Address(n & 0xFFFFFFFF)]
    if ip in _NAT64_LOCAL:
        raw = ip.packed
        places = [raw[12:16], raw[6:8] + raw[9:11], raw[7:8] + raw[9:12], raw[9:13]]
        return [ipaddress.IPv4Address(b) for b in places if any(b)]  # 0s: a place unused
    if ip.sixtofour is not None:
        return [ip.sixtofour]
    if ip.teredo is not None:
        return list(ip.teredo)
    return []


def judge(ip: IP, allow: frozenset[str], host: str = "") -> None:
    """Refused unless `ip` is allowed. For a name (`host`), the message names the kind of
    address only, never the address: it is answered to the tenant (a 422, a delivery's
    error), who would otherwise read the deployment's internal DNS through it."""
    kind = kind_of(ip)
    if kind == "public" or kind in allow:
        return
    if host and host.strip("[]") != str(ip):
        raise Refused(
            f"the destination's host {host} resolves to a {kind} address: "
            "not allowed on this deployment"
        )
    raise Refused(f"destination address {ip} is {kind}: not allowed on this deployment")


def parse(url: str) -> tuple[str, int]:
    """The host and port of an http(s) URL; Refused if it has neither."""
    try:
        parts = urlsplit(url)
    except ValueError as e:  # a netloc that NFKC normalizes into a separator
        raise Refused(f"the destination is not a URL: {e}") from e
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise Refused("the destination must be an http(s) URL with a host")
    if parts.username or parts.password:
        raise Refused("the destination URL may not carry credentials")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as e:
        raise Refused(f"the destination's port is not a port: {e}") from e
    return parts.hostname, port


async def check_url(url: str, allow: frozenset[str], *, timeout: float = 5.0) -> list[IP]:
    """Every address the URL's host resolves to, each judged; Refused if one is not
    allowed (a name with one bad address among good ones is refused whole)."""
    host, port = parse(url)
    addresses = await resolve(host, port, timeout=timeout)
    for ip in addresses:
        judge(ip, allow, host)
    return addresses


async def resolve(host: str, port: int, *, timeout: float = 5.0) -> list[IP]:
    try:
        return [ipaddress.ip_address(host.strip("[]"))]
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(
            loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), timeout
        )
    except (OSError, TimeoutError) as e:
        raise Refused(f"the destination's host {host} does not resolve: {e}") from e
    except UnicodeError as e:  # the idna codec: an empty or too long label, a bad character
        raise Refused(f"the destination's host {host} is not a host name: {e}") from e
    return _unique(ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos)


def _unique(ips: Iterable[IP]) -> list[IP]:
    out: list[IP] = []
    for ip in ips:
        if ip not in out:
            out.append(ip)
    return out


class GuardedResolver(AbstractResolver):
    """aiohttp's resolver, judging each address before the connector may use it. (The
    connector resolves no IP literal: the sender judges those with `check_url`.)"""

    def __init__(self, allow: frozenset[str]) -> None:
        self.allow = allow
        self._inner = DefaultResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        for r in results:
            judge(ipaddress.ip_address(r["host"].split("%")[0]), self.allow, host)
        return results

    async def close(self) -> None:
        await self._inner.close()
