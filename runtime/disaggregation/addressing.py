"""Where the pair's sockets live: loopback checks and the local address towards the peer."""

from __future__ import annotations

import ipaddress
import socket


def is_loopback(host: str) -> bool:
    """True when every address ``host`` resolves to is a loopback one."""
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except socket.gaierror:
        return False
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def local_address_towards(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (where the decode side's gloo listens)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0][0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))  # a UDP connect sends nothing: it only picks the route
        return s.getsockname()[0]

