"""The rendezvous bench's hand-framed gRPC transport (bench/grpc_wire.py): its HTTP/2 and HPACK encodings against
the RFCs' own examples, what it makes of etcd's frames, and simulated agents' leases kept alive through it by real
LeaseKeepers on a real etcd."""

from __future__ import annotations

import socket
import struct
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import grpc_wire  # noqa: E402 - bench/ is not a package
from grpc_wire import GrpcConnection  # noqa: E402
from rendezvous_host import SharedKeepAlive  # noqa: E402

from launcher.etcd import client as etcd_client  # noqa: E402
from launcher.etcd.lease_keeper import LeaseKeeper  # noqa: E402
from launcher.etcd.server import free_port  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def test_hpack_integers_match_rfc_7541_examples():
    assert grpc_wire.hpack_int(10, 5) == bytes([0x0A])  # C.1.1
    assert grpc_wire.hpack_int(1337, 5) == bytes([0x1F, 0x9A, 0x0A])  # C.1.2
    assert grpc_wire.hpack_int(42, 8) == bytes([0x2A])  # C.1.3


def test_a_header_field_is_a_literal_never_indexed():
    # RFC 7541 C.2.3: "password: secret" as a literal never indexed with a new name
    assert grpc_wire.hpack_literal("password", "secret") == bytes.fromhex("100870617373776f726406736563726574")


def test_frames_have_rfc_9113_headers():
    assert grpc_wire.frame(grpc_wire.PING, grpc_wire.ACK, 0, b"12345678") == (
        b"\x00\x00\x08" + b"\x06" + b"\x01" + b"\x00\x00\x00\x00" + b"12345678"
    )


class _Socket:
    def __init__(self) -> None:
        self.sent = b""

    def sendall(self, data: bytes) -> None:
        self.sent += data


def _connection() -> tuple[GrpcConnection, _Socket]:
    sock = _Socket()
    return GrpcConnection(sock, "127.0.0.1:2379"), sock  # type: ignore[arg-type]  # sendall is all it uses


def test_the_connection_opens_with_the_preface_and_the_largest_windows():
    connection, sock = _connection()
    assert sock.sent.startswith(grpc_wire.PREFACE)
    settings = grpc_wire.frame(grpc_wire.SETTINGS, 0, 0, struct.pack(">HIHI", 0x2, 0, 0x4, grpc_wire.MAX_WINDOW))
    update = grpc_wire.frame(grpc_wire.WINDOW_UPDATE, 0, 0, struct.pack(">I", grpc_wire.MAX_WINDOW - 65_535))
    assert sock.sent == grpc_wire.PREFACE + settings + update
    first, headers = connection.open_stream("/etcdserverpb.Lease/LeaseKeepAlive")
    second, _ = connection.open_stream("/etcdserverpb.Lease/LeaseKeepAlive")
    assert (first, second) == (1, 3)  # a client's streams are odd and rise
    assert headers[3] == grpc_wire.HEADERS and headers[4] == grpc_wire.END_HEADERS


def test_messages_split_across_reads_are_joined_and_control_frames_answered():
    connection, _ = _connection()
    message = grpc_wire.grpc_frame(b"answer-one") + grpc_wire.grpc_frame(b"answer-two")
    wire = (
        grpc_wire.frame(grpc_wire.SETTINGS, 0, 0, b"")
        + grpc_wire.frame(grpc_wire.PING, 0, 0, b"pingpong")
        + grpc_wire.frame(grpc_wire.DATA, 0, 1, message[:7])
        + grpc_wire.frame(grpc_wire.DATA, 0, 1, message[7:])
        + grpc_wire.frame(grpc_wire.HEADERS, grpc_wire.END_STREAM | grpc_wire.END_HEADERS, 3, b"\x88")
    )
    received, reply = connection.receive(wire[:20])  # a frame cut in the middle waits for the rest
    assert received.messages == [] and reply == grpc_wire.frame(grpc_wire.SETTINGS, grpc_wire.ACK, 0, b"")
    received, reply = connection.receive(wire[20:])
    assert received.messages == [(1, b"answer-one"), (1, b"answer-two")]
    assert received.ended == [3]  # trailers end a stream
    assert reply == grpc_wire.frame(grpc_wire.PING, grpc_wire.ACK, 0, b"pingpong")


def test_goaway_ends_the_connection():
    connection, _ = _connection()
    with pytest.raises(grpc_wire.ConnectionEnded, match="error code 2"):
        connection.receive(grpc_wire.frame(grpc_wire.GOAWAY, 0, 0, struct.pack(">II", 0, 2)))


def test_real_keepers_keep_leases_alive_on_one_connection(etcd):
    client = etcd_client.connect(etcd.endpoint)
    try:
        shared = SharedKeepAlive(client, silence_s=3.0)
        leases = [client.lease(2) for _ in range(16)]
        lost = threading.Event()
        keepers = [LeaseKeeper(lease, 0.5, lost.set, routes=shared).start() for lease in leases]
        try:
            # past the TTL (2 s): six refreshes each at 0.5 s, so only refreshes can have kept the leases
            began = time.monotonic()
            while shared.carried < 16 * 6 and not lost.is_set() and time.monotonic() - began < 10:
                time.sleep(0.1)
            assert time.monotonic() - began > 2.0
            assert not lost.is_set()
            assert all(lease.remaining_ttl > 0 for lease in leases)
            assert all(keeper.silent_for() < 1.5 for keeper in keepers)
            assert shared.carried >= 16 * 5
        finally:
            for keeper in keepers:
                keeper.stop()
        deadline = time.monotonic() + 10
        while any(lease.remaining_ttl > 0 for lease in leases) and time.monotonic() < deadline:
            time.sleep(0.2)  # no keeper refreshes now: etcd lets every lease end
        assert all(lease.remaining_ttl <= 0 for lease in leases)
    finally:
        client.close()


def test_a_refresh_asked_for_while_the_connection_is_down_goes_out_once_it_is_back(etcd, monkeypatch):
    """A gRPC client queues a call while its channel connects: the shared connection sends a refresh that waited for
    it at once, instead of letting it wait out its deadline unsent (which, near a lapsing lease, fences an agent)."""
    client = etcd_client.connect(etcd.endpoint)
    asked = threading.Event()
    connect = GrpcConnection.connect
    connections = []

    def connect_once_asked(endpoint: str, timeout_s: float) -> GrpcConnection:
        if connections:
            assert asked.wait(10), "the test asked for no refresh"
        connections.append(connect(endpoint, timeout_s))
        return connections[-1]

    monkeypatch.setattr(GrpcConnection, "connect", staticmethod(connect_once_asked))
    try:
        shared = SharedKeepAlive(client, silence_s=3.0)
        lease = client.lease(5)
        endpoint = shared.endpoints(lease)[0]
        assert shared.refresh(lease, 5.0, endpoint)[0].TTL > 0
        connections[0].sock.shutdown(socket.SHUT_RDWR)  # the member went away: the next connection waits for us
        answers: list = []
        refresh = threading.Thread(target=lambda: answers.append(shared.refresh(lease, 5.0, endpoint)))
        began = time.monotonic()
        refresh.start()
        while shared.carried < 2:  # counted as its waiter is queued
            time.sleep(0.01)
        asked.set()
        refresh.join(timeout=10)
        assert answers and answers[0][0].TTL > 0, "answered on the new connection"
        assert time.monotonic() - began < 2.0, "not after waiting out its 5 s deadline"
        assert len(connections) == 2
    finally:
        client.close()


def test_a_lease_whose_member_is_gone_is_kept_through_another_and_moves_there(etcd):
    """As a real agent's keeper: once its member left a refresh unanswered, the next goes out through the others
    too, and the lease then refreshes through the member that answered (before, a host's refreshes all went
    through one member)."""
    gone = f"127.0.0.1:{free_port()}"  # nothing listens there: a member that died
    granter = etcd_client.connect(etcd.endpoint)
    routes_client = etcd_client.connect(f"{gone},{etcd.endpoint}")
    routes_client.use_endpoint(gone)  # pyetcd starts on a member at random; this client makes no call to move it
    try:
        shared = SharedKeepAlive(routes_client, silence_s=3.0)
        lease = granter.lease(2)
        assert shared.endpoints(lease) == [gone]
        refresh = shared.refresh
        renewed_by_the_live_member = threading.Event()

        def noting_renewals(lease_, deadline: float, endpoint: str) -> list:
            answers = refresh(lease_, deadline, endpoint)
            if answers[0].TTL > 0 and shared.endpoints(lease_) == [etcd.endpoint]:
                renewed_by_the_live_member.set()  # etcd's own answer: it renewed the lease
            return answers

        shared.refresh = noting_renewals  # type: ignore[method-assign]  # the keeper's route, observed
        lost = threading.Event()
        keeper = LeaseKeeper(lease, 0.5, lost.set, routes=shared).start()
        try:
            assert renewed_by_the_live_member.wait(10)
            assert not lost.is_set() and lease.remaining_ttl > 0
            assert keeper.silent_for() < 1.5
            assert shared.endpoints(lease) == [etcd.endpoint]
        finally:
            keeper.stop()
    finally:
        granter.close()
        routes_client.close()
