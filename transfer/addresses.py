"""Addresses peers exchange, parsed and validated before anything connects to them.

Two forms: the ZMQ endpoint of an engine's link listener (``tcp://host:port``) and the
``host:port`` of its data channel (``[v6addr]:port`` for IPv6). A string from the network
or a caller that does not parse is refused with PARAM_INVALID naming it, never passed on to
a socket call that could raise somewhere unexpected.
"""

from __future__ import annotations

import ipaddress
import re

from transfer.errors import StatusCode, TransferError

#: Longest host name accepted (DNS limit).
MAX_HOST = 253
_HOSTNAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?")
WILDCARDS = frozenset({"0.0.0.0", "::", ""})


def split_host_port(text: str, what: str = "address") -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); PARAM_INVALID otherwise."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        valid = _is_ip(host, 6)
    else:
        valid = ":" not in host and valid_host(host)
    if not sep or not valid or not port.isdigit() or not 0 < int(port) < 65536:
        raise TransferError(
            StatusCode.PARAM_INVALID, f"bad {what} {text[:80]!r}: expected host:port"
        )
    return host, int(port)


def parse_endpoint(address: str) -> tuple[str, int]:
    """``tcp://host:port`` (a link address) -> (host, port); PARAM_INVALID otherwise."""
    if not isinstance(address, str) or not address.startswith("tcp://"):
        raise TransferError(
            StatusCode.PARAM_INVALID,
            f"bad peer address {str(address)[:80]!r}: expected tcp://host:port",
        )
    return split_host_port(address.removeprefix("tcp://"), "peer address")


def join_host_port(host: str, port: int) -> str:
    """Inverse of :func:`split_host_port`."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def valid_host(host: str) -> bool:
    """A host name, an IPv4 address or a bare IPv6 address (no port)."""
    if not host or len(host) > MAX_HOST:
        return False
    return _is_ip(host, 4) or _is_ip(host, 6) or bool(_HOSTNAME.fullmatch(host))


def endpoint(host: str, port: int) -> str:
    """``tcp://host:port`` (IPv6 in brackets)."""
    return f"tcp://{join_host_port(host, port)}"


def is_ip(host: str) -> bool:
    """True for an IPv4 or IPv6 address literal (no name resolution needed)."""
    return _is_ip(host, 4) or _is_ip(host, 6)


def reachable(advertised: str, dialled_host: str) -> str:
    """A peer's advertised ``host:port`` with a wildcard host replaced by ``dialled_host``
    (the host we reached that peer's link by, or the address its connection came from)."""
    if not advertised or not dialled_host:
        return advertised
    host, port = split_host_port(advertised, "data address")
    return join_host_port(dialled_host, port) if host in WILDCARDS else advertised


def _is_ip(host: str, version: int) -> bool:
    try:
        return ipaddress.ip_address(host).version == version
    except ValueError:
        return False
