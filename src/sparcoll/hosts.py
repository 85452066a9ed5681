"""Which address a rank listens at where nobody said (its aggregator, its end of the ring), and what
kind of address one is. No torch here: the `sparcoll aggregator` command checks its --host before
it imports torch."""
from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

SIOCGIFADDR = 0x8915     # Linux's ioctl for an interface's IPv4 address


def local_host() -> str:
    """The address peers can reach this process at, where host= and $SPARCOLL_HOST say none: that
    of $GLOO_SOCKET_IFNAME's interface, as torch's gloo groups use it (the aggregators and the ring
    went over the network that routes to MASTER_ADDR whatever it said: a review of docs/cluster.md;
    of a list of interfaces, the first: gloo's groups use them all), of MASTER_ADDR's family where
    the interface has one; else that of the interface that routes to MASTER_ADDR (no packet is
    sent); else loopback."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        family, _, _, _, address = socket.getaddrinfo(master, 9, type=socket.SOCK_DGRAM)[0]
    except OSError:
        family, address = socket.AF_INET, None
    interface = next(filter(None, (name.strip() for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(","))),
                     None)
    if interface:
        other = socket.AF_INET if family == socket.AF_INET6 else socket.AF_INET6
        found = interface_address(interface, family) or interface_address(interface, other)
        if found is None:
            raise ValueError(f"$GLOO_SOCKET_IFNAME={interface}: no address on that interface of this host, where "
                             f"this rank's aggregator and ring would listen; set $SPARCOLL_HOST to the address "
                             f"peers reach this rank at")
        return found
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return probe.getsockname()[0]
    except (OSError, TypeError):
        return "127.0.0.1"


def interface_address(name: str, family: int = socket.AF_INET) -> str | None:
    """The address of network interface `name` of `family` (an IPv6 one of global scope, else
    loopback's; never a link-local one, which needs its interface named to be reached), if it has
    one."""
    if family == socket.AF_INET6:
        try:
            with open("/proc/net/if_inet6") as f:
                scoped = {scope: digits for digits, _, _, scope, _, device in map(str.split, f) if device == name}
            digits = scoped.get("00") or scoped.get("10")       # global, else host (loopback)
            return str(ipaddress.IPv6Address(bytes.fromhex(digits))) if digits else None
        except (OSError, ValueError):
            return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            request = struct.pack("256s", name.encode()[:15])
            return socket.inet_ntoa(fcntl.ioctl(probe.fileno(), SIOCGIFADDR, request)[20:24])
    except OSError:
        return None


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:      # a name
        return host == "localhost"
