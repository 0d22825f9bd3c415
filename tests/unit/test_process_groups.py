"""How a worker tells that a peer closed a connection of one of its groups (`process_groups.peer_closed`), and that
gloo closed all of them (`process_groups.connections_closed`), on real loopback TCP connections standing in for
gloo's."""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Iterator

import pytest

from elastic import process_groups


@pytest.fixture
def connection(monkeypatch) -> Iterator[tuple[object, socket.socket, socket.socket]]:
    """A group whose one connection is `ours`, and the peer's end of it."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        ours = socket.create_connection(listener.getsockname())
        theirs, _ = listener.accept()
    group = object()
    monkeypatch.setitem(
        process_groups._connections_of_group, id(group), {(ours.fileno(), os.fstat(ours.fileno()).st_ino)}
    )
    try:
        yield group, ours, theirs
    finally:
        ours.close()
        theirs.close()


def closed_soon(group: object) -> bool:
    deadline = time.monotonic() + 2.0  # loopback delivers the end at once; the deadline only bounds a failure
    while not process_groups.peer_closed(group):  # type: ignore[arg-type]
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_live_peer_closed_nothing(connection) -> None:
    group, ours, theirs = connection
    theirs.sendall(b"data we have not read")
    assert not process_groups.peer_closed(group)  # type: ignore[arg-type]
    assert not process_groups.peer_closed(None)


@pytest.mark.parametrize("linger", [False, True], ids=["closed (end of stream)", "reset"])
def test_a_peer_that_closes_or_resets_the_connection_is_seen(connection, linger: bool) -> None:
    group, ours, theirs = connection
    if linger:  # a zero linger time makes close send a reset, as a process killed with unread data does
        theirs.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    theirs.close()
    assert closed_soon(group)


def test_a_connection_gloo_closed_counts_as_closed_even_if_its_descriptor_is_reused(connection) -> None:
    group, ours, theirs = connection
    descriptor = ours.fileno()
    ours.close()
    assert process_groups.peer_closed(group)  # type: ignore[arg-type]
    with socket.socket() as reused:
        os.dup2(reused.fileno(), descriptor)
        try:
            assert process_groups.peer_closed(group)  # type: ignore[arg-type]
        finally:
            os.close(descriptor)


def test_the_groups_connections_count_as_closed_only_once_every_one_is(monkeypatch) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        ours = [socket.create_connection(listener.getsockname()) for _ in range(2)]
        theirs = [listener.accept()[0] for _ in ours]
    tracked = {(s.fileno(), os.fstat(s.fileno()).st_ino) for s in ours}
    monkeypatch.setattr(process_groups, "_group_connections", tracked)
    first = ours[0].fileno()
    try:
        assert not process_groups.connections_closed()
        ours[0].close()
        assert not process_groups.connections_closed(), "one connection is still open"
        with socket.socket() as reused:  # the closed one's descriptor, reused, is not it
            os.dup2(reused.fileno(), first)
        try:
            assert not process_groups.connections_closed()
            ours[1].close()
            assert process_groups.connections_closed()
        finally:
            os.close(first)
    finally:
        for s in ours + theirs:
            s.close()


def test_no_groups_connections_are_not_closed_ones(monkeypatch) -> None:
    """NCCL's groups (or none at all) leave no gloo connection to judge by: the fallback decides."""
    monkeypatch.setattr(process_groups, "_group_connections", set())
    assert not process_groups.connections_closed()
