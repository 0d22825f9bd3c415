"""Evidence of broken paths: error messages naming an unreachable peer, and a live process's stalled connections."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid

import pytest

from launcher.workers.failure_evidence import (
    path_refuses,
    says_peer_failed,
    says_unreachable,
    stalled_peers,
    unreachable_peers,
)
from tests.netns_harness import _ip, add_namespace

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    "message, peers",
    [
        (
            "RuntimeError: Gloo connectFullMesh failed with [../gloo/transport/tcp/pair.cc:144] no error\n"
            "connect [10.88.0.3]:41735: No route to host",
            ["10.88.0.3"],
        ),
        ("[c10d] The client socket has timed out after 60000ms while trying to connect to (10.0.0.2, 29500).", []),
        ("socket.cc:14 connect [fd00::2]:5000: Network is unreachable", ["fd00::2"]),
        ("Connect timeout [10.1.2.3]:4411", ["10.1.2.3"]),
        # a peer that died closes or resets its connections: not a broken path
        ("Read error [10.88.0.3]:41735: Connection reset by peer", []),
        ("Connection closed by peer [10.88.0.3]:41735", []),
        ("connect [10.88.0.3]:41735: Connection refused", []),
        ("", []),
    ],
)
def test_an_error_names_the_peers_it_could_not_reach(message, peers):
    assert unreachable_peers(message) == peers


@pytest.mark.parametrize(
    "message, unreachable, peer_failed",
    [
        (
            "RuntimeError: [enforce fail at gloo/transport/tcp/socket.cc:142] rv != -1. -1 vs -1. connect: No route to "
            "host",
            True,
            False,
        ),
        (
            "RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [10.77.0.3]:35205: Connection reset by peer. "
            "This is typically caused by a remote worker hanging",
            False,
            True,
        ),
        (
            "[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv operation to complete",
            False,
            True,
        ),
        ("ValueError: loss is nan", False, False),
        ("ZeroDivisionError: division by zero", False, False),
    ],
)
def test_an_error_tells_a_broken_path_and_a_failed_peer_from_a_failure_of_its_own(message, unreachable, peer_failed):
    assert (says_unreachable(message), says_peer_failed(message)) == (unreachable, peer_failed)


def test_a_connection_that_is_answered_is_not_stalled():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = (
            f"import socket, sys; s = socket.create_connection(('127.0.0.1', {port})); s.sendall(b'x' * 1000); "
            "print('up', flush=True); sys.stdin.read()"  # lives until the test closes its stdin, or dies
        )
        client = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        try:
            assert client.stdout.readline().strip() == "up"
            conn, _ = server.accept()  # accepted, never read: the kernel still acknowledges the bytes
            time.sleep(0.5)
            assert stalled_peers(client.pid) == []
            conn.close()
        finally:
            client.kill()
            client.wait()


def test_an_unknown_process_has_no_evidence():
    assert stalled_peers(2**22 + 12345) == []


def test_a_connect_the_host_answers_is_no_broken_path():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert not path_refuses("127.0.0.1", port)
    assert not path_refuses("127.0.0.1", port)  # closed now: refused, by a host that answers


@pytest.mark.parametrize("path", ["unreachable route", "silent link"])
def test_a_connect_the_path_refuses_or_never_answers_is_a_broken_path(path):
    """A firewall's unreachable route fails the connect at once; a link where nothing answers (a veth pair whose
    far end has no address: the neighbour is never found) leaves it unanswered past the check's timeout."""
    ns = f"elpath-{uuid.uuid4().hex[:8]}"
    add_namespace(ns)
    try:
        if path == "unreachable route":
            _ip("-n", ns, "route", "add", "unreachable", "10.98.0.1/32")
        else:
            _ip("-n", ns, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
            _ip("-n", ns, "addr", "add", "10.98.0.2/24", "dev", "v0")
            _ip("-n", ns, "link", "set", "v0", "up")
            _ip("-n", ns, "link", "set", "v1", "up")
        code = "from launcher.workers.failure_evidence import path_refuses; print(path_refuses('10.98.0.1', 29500))"
        started = time.monotonic()
        answer = subprocess.run(
            ["ip", "netns", "exec", ns, sys.executable, "-c", code], capture_output=True, text=True, timeout=20
        )
        assert answer.stdout.strip() == "True", answer.stderr
        assert time.monotonic() - started < 10
    finally:
        _ip("netns", "del", ns, check=False)
