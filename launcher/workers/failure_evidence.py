"""What a failed worker's traces say about who caused the failure: a broken network path, or a peer.

When two nodes lose each other but both still reach etcd, every rank of the job fails or hangs, and the
earliest failure names a node at random. The evidence read here lets
`launcher.rendezvous.decisions.charged_nodes` charge
the right ones:

- **a broken path**, from a hung worker's own TCP connections (Linux `/proc/<pid>/net/tcp*`, read before the
  watchdog kills it): a connection whose peer stopped acknowledging retransmits, a connect that never completed
  sits in SYN_SENT retrying, and data the path refuses to carry (an unreachable route) waits unsent behind
  window probes that get no answer. A peer that is merely slow or stopped (SIGSTOP) leaves none of these: its
  kernel still acknowledges what it receives, window probes included. A worker hung in its start-up without
  such connections may be retrying a connect the path refuses at once (the round's store, behind a firewall
  rule): the agent tries that connect itself (`path_refuses`). Or from a failed worker's error: a
  connect refused by the path (no route to host, network unreachable) or timed out, with the address it was
  for when the message names it.
- **a consequence**: a worker that failed because a peer did: its error says the peer closed or reset the
  connection or a collective timed out waiting for it, or it was found hung inside a torch.distributed call.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import re
import socket
from pathlib import Path

_SYN_SENT = 0x02
PATH_CHECK_TIMEOUT_S = 0.5  # a connect on a working path is answered (accepted or refused) well within this
_STALLED_AFTER = 2  # retransmits, or window probes without an answer: one can be a lost packet
_TABLES = ("tcp", "tcp6")


def _decode_address(text: str) -> str:
    """An address of /proc/net/tcp (hex, each 32-bit word in host byte order, which is little-endian here)."""
    hex_ip = text.split(":")[0]
    raw = b"".join(bytes.fromhex(hex_ip[i : i + 8])[::-1] for i in range(0, len(hex_ip), 8))
    address = ipaddress.ip_address(raw)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return str(address)


def _socket_inodes(pid: int) -> set[int]:
    inodes: set[int] = set()
    try:
        entries = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for entry in entries:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{entry}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def stalled_peers(pid: int) -> list[str]:
    """Remote addresses of `pid`'s TCP connections that look cut off (see the module docstring); [] if unknown."""
    inodes = _socket_inodes(pid)
    peers: set[str] = set()
    for table in _TABLES:
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            try:
                state, unsent = int(fields[3], 16), int(fields[4].split(":")[0], 16)
                retransmits, probes, inode = int(fields[6], 16), int(fields[8]), int(fields[9])
            except (IndexError, ValueError):
                continue
            if inode in inodes and _stalled(state, unsent, retransmits, probes):
                peers.add(_decode_address(fields[2]))
    return sorted(peers)


def path_refuses(addr: str, port: int, timeout: float = PATH_CHECK_TIMEOUT_S) -> bool:
    """Whether a connect to `addr`:`port` fails on the way (no route, network unreachable, or no answer within
    `timeout`); a refused connect reached the host, whose path works."""
    try:
        socket.create_connection((addr, port), timeout=timeout).close()
    except (ConnectionRefusedError, ConnectionResetError):
        return False
    except OSError as exc:
        return isinstance(exc, TimeoutError) or exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH)
    return False


def _stalled(state: int, unsent: int, retransmits: int, unanswered_probes: int) -> bool:
    if state == _SYN_SENT:
        return retransmits >= 1  # the first SYN went unanswered for its whole timeout (1 s)
    return retransmits >= _STALLED_AFTER or (unsent > 0 and unanswered_probes >= _STALLED_AFTER)


# a connect the path refused or that timed out; an address as gloo and c10d print it
_UNREACHABLE = re.compile(
    r"no route to host|network is unreachable|connect(?:ion)? timed? ?out|"
    r"timed out.{0,40}connect",
    re.IGNORECASE,
)
_ADDRESS = re.compile(r"\[?(?P<ip>(?:\d{1,3}\.){3}\d{1,3}|[0-9a-fA-F:]*:[0-9a-fA-F:]+)\]?:\d+")
# a peer that died closes or resets its connections; a collective that timed out waited for a peer
_PEER_GONE = re.compile(
    r"reset by peer|closed by peer|connection closed|broken pipe|connection refused|"
    r"timed out waiting|collective operation timeout",
    re.IGNORECASE,
)


def says_unreachable(message: str) -> bool:
    """Whether an error `message` says a network path refused a connect or timed it out."""
    return bool(_UNREACHABLE.search(message))


def unreachable_peers(message: str) -> list[str]:
    """Peer addresses named on the lines of an error `message` that say they could not be reached."""
    peers: set[str] = set()
    for line in message.splitlines():
        if not _UNREACHABLE.search(line):
            continue
        for match in _ADDRESS.finditer(line):
            try:
                address = ipaddress.ip_address(match["ip"])
            except ValueError:
                continue
            if not address.is_unspecified:
                peers.add(str(address))
    return sorted(peers)


def says_peer_failed(message: str) -> bool:
    """Whether an error `message` is a consequence of a peer's failure rather than a failure of its own."""
    return bool(_PEER_GONE.search(message)) and not says_unreachable(message)
