"""Bind what is configured, advertise what peers can reach: checked before a worker starts.

A worker on another host is reached at the address it advertises (a pod's DNS name, a
bare-metal host's entry). If that name does not lead back to the address the worker binds,
every peer would connect somewhere else and each request would wait for a timeout; here it
is a clear error at start instead:

    bind 10.0.0.2, advertise node-b  ->  node-b resolves to 10.0.0.3: not where it listens
    bind 0.0.0.0                     ->  the transfer data channel would advertise 0.0.0.0

Name resolution is retried for a while (DNS may lag behind a new pod), then it fails.
"""

from __future__ import annotations

import ipaddress
import socket
import time

from hetero_pd import envs

WILDCARDS = ("", "0.0.0.0", "::", "*")


class AddressError(ValueError):
    """A worker's bind and advertised addresses do not match; the message says how."""


def resolve(name: str) -> list[str]:
    """Every IP address `name` resolves to here (an address resolves to itself)."""
    infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def is_local(address: str) -> bool:
    """Whether `address` belongs to this host (a socket can bind it)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((address, 0))
        except OSError:
            return False
    return True


def bind_address(host: str, wait_s: float = 15.0) -> str:
    """The IP address to bind for `host` (an address or a name of this host)."""
    try:
        ipaddress.ip_address(host)
        ip = host
    except ValueError:
        ip = _resolve_within(host, wait_s, f"{host!r} (this host's entry)")[0]
    if not is_local(ip):
        raise AddressError(
            f"{host} ({ip}) is not an address of this host, so nothing here can listen on it: "
            "run this part on the host the file names (check --host-id / --host)"
        )
    return ip


def check_advertised(bind: str, advertised: str, what: str, wait_s: float | None = None) -> None:
    """Raises AddressError unless peers that connect to `advertised` reach a socket bound to
    `bind` on this host. `what` names the socket in the message ("worker decode-0");
    `wait_s` defaults to $HETERO_PD_ADVERTISE_WAIT_S (`envs.advertise_wait_s`)."""
    wait_s = envs.advertise_wait_s() if wait_s is None else wait_s
    if bind in WILDCARDS:
        raise AddressError(
            f"{what} binds {bind or 'every address'}, but its KV transfer data channel "
            f"advertises the address it binds: peers would be sent to {bind or '0.0.0.0'}. "
            "Bind the address peers reach it at (Kubernetes: --host $(POD_IP))"
        )
    deadline = time.monotonic() + wait_s
    while True:
        found = _resolve_within(advertised, max(0.0, deadline - time.monotonic()), what)
        if bind in found:
            return
        if time.monotonic() >= deadline:
            raise AddressError(
                f"{what} advertises {advertised}, which resolves to {', '.join(found)}, but it "
                f"binds {bind}: peers would connect to {found[0]}, where it does not listen. "
                "Fix the name's DNS/hosts entry or the address it binds"
            )
        time.sleep(0.5)


def _resolve_within(name: str, wait_s: float, what: str) -> list[str]:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return resolve(name)
        except (socket.gaierror, UnicodeError) as e:
            if time.monotonic() >= deadline:
                raise AddressError(
                    f"{what}: {name!r} does not resolve on this host ({e}); peers could not "
                    "reach it by that name either"
                ) from None
        time.sleep(0.5)
