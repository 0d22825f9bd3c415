"""Tell gloo which network interface to use: the one that holds the node's advertised address.

Left to itself, gloo finds its own address by resolving the hostname. On many hosts that is 127.0.0.1 or
127.0.1.1 (/etc/hosts), so every rank announces a loopback address to its peers and a multi-node job fails in
connectFullMesh with "Connection refused, remote=[127.0.0.1]". The advertised address (--local-addr, or the
address that routes to etcd) is the one other nodes already reach this node at, so the interface holding it
is where gloo should bind.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import shutil
import socket
import struct
import subprocess
from collections.abc import Mapping

logger = logging.getLogger(__name__)

GLOO_IFNAME = "GLOO_SOCKET_IFNAME"

# linux/sockios.h: read an interface's (primary) IPv4 address into struct ifreq
_SIOCGIFADDR = 0x8915
# struct ifreq is a 16-byte name followed by a sockaddr_in whose address sits at bytes 4..8 of it
_IFNAMSIZ = 16
_IFREQ_ADDR = slice(_IFNAMSIZ + 4, _IFNAMSIZ + 8)

# (address, user's value) -> what was decided; worker_env runs once per worker and round, the log line once
_decided: dict[tuple[str, str | None], dict[str, str]] = {}


def _ipv4_by_ioctl(addr: str) -> str | None:
    """The interface whose primary IPv4 address is `addr`, asking the kernel directly (no subprocess)."""
    packed = socket.inet_aton(addr)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[: _IFNAMSIZ - 1])
            try:
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on this interface
                continue
            if reply[_IFREQ_ADDR] == packed:
                return name
    return None


def _by_ip_command(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """The interface holding `addr` per `ip -o addr`: also sees secondary IPv4 and IPv6 addresses."""
    ip = shutil.which("ip")
    if ip is None:
        return None
    try:
        listing = subprocess.run([ip, "-o", "addr", "show"], capture_output=True, text=True, timeout=5, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    # "2: eth0    inet 10.0.0.5/24 brd ... scope global eth0" -> interface, family, address/prefix
    for line in listing.stdout.splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[2] in ("inet", "inet6"):
            try:
                if ipaddress.ip_interface(fields[3]).ip == addr:
                    return fields[1].split("@")[0]
            except ValueError:
                continue
    return None


def interface_holding(addr: str) -> str | None:
    """The name of the local network interface that has the IP address `addr`, or None when none has it."""
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return None
    if ip.version == 4:
        name = _ipv4_by_ioctl(str(ip))
        if name is not None:
            return name
    return _by_ip_command(ip)


def _as_ip(addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """`addr` as an IP address; a host name (--local-addr may be one) is resolved."""
    try:
        return ipaddress.ip_address(addr)
    except ValueError:
        pass
    try:
        return ipaddress.ip_address(socket.getaddrinfo(addr, None, proto=socket.IPPROTO_TCP)[0][4][0])
    except (OSError, IndexError, ValueError):
        return None


def gloo_interface_env(addr: str, environ: Mapping[str, str]) -> dict[str, str]:
    """{"GLOO_SOCKET_IFNAME": <interface holding addr>} for the workers, or {} when there is nothing to add.

    Nothing is added when the user set GLOO_SOCKET_IFNAME (theirs wins), when `addr` is a loopback address (a
    single-host job: gloo's own choice already works) or when no local interface holds it (a NAT'd
    --local-addr, say: guessing would be worse than gloo's default).
    """
    user = environ.get(GLOO_IFNAME)
    key = (addr, user)
    if key in _decided:
        return dict(_decided[key])
    result: dict[str, str] = {}
    ip = _as_ip(addr)
    if user is not None:
        logger.info("%s=%s is set; passing it to the workers unchanged", GLOO_IFNAME, user)
    elif ip is None:
        logger.info("advertised address %s does not resolve; %s not set", addr, GLOO_IFNAME)
    elif ip.is_loopback:
        logger.debug("advertised address %s is loopback; %s not set", addr, GLOO_IFNAME)
    else:
        name = interface_holding(str(ip))
        if name is None:
            logger.info("no local interface holds the advertised address %s; %s not set", addr, GLOO_IFNAME)
        else:
            result[GLOO_IFNAME] = name
            logger.info(
                "workers get %s=%s (the interface holding %s); set %s yourself to override",
                GLOO_IFNAME,
                name,
                addr,
                GLOO_IFNAME,
            )
    _decided[key] = result
    return dict(result)
