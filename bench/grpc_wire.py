"""The client side of gRPC streams on one HTTP/2 connection, framed by hand: what the simulated hosts of
bench/rendezvous_bench.py send their lease refreshes on (rendezvous_host.SharedKeepAlive).

Only what a client of long-lived gRPC streams needs (RFC 9113):
- the connection preface, SETTINGS with the largest receive window (2^31 - 1) and push off, and the connection's
  receive window raised to match, topped up once half of it was used;
- a stream per call: one HEADERS frame, its header fields as HPACK literals that are never indexed, so no
  dynamic table is kept; then a DATA frame per message (a gRPC message: flag byte, length, bytes);
- from etcd: DATA (a stream's messages), the end of a stream (HEADERS with END_STREAM: the trailers; or
  RST_STREAM), SETTINGS and PING (acknowledged), GOAWAY (the connection is over). Header blocks are not decoded,
  as nothing in them is needed: the DATA frames carry the answers and END_STREAM the end.

The `h2` package did the same at about 0.18 ms of host CPU per refresh with 256 streams; most of it went to
frame objects, their state machines and window accounting per message, a cost a bench packing thousands of
agents on two cores pays for nothing.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass, field

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7, 0x8
END_STREAM = ACK = 0x1
END_HEADERS, PADDED = 0x4, 0x8
SETTINGS_ENABLE_PUSH, SETTINGS_INITIAL_WINDOW_SIZE = 0x2, 0x4
MAX_WINDOW = (1 << 31) - 1
DEFAULT_WINDOW = 65_535
_HEADER = struct.Struct(">I")  # the frame header's 24-bit length is read as the high bytes of a 32-bit word


class ConnectionEnded(Exception):
    """etcd closed the connection or sent GOAWAY."""


def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", kind, flags, stream) + payload


def hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """An HPACK integer (RFC 7541 5.1) in a prefix of `prefix_bits`, ORed into `first`."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    out.append(value)
    return bytes(out)


def hpack_literal(name: str, value: str) -> bytes:
    """A header field as a literal never indexed, with a literal name (RFC 7541 6.2.3): no table to keep."""
    raw_name, raw_value = name.encode(), value.encode()
    return b"\x10" + hpack_int(len(raw_name), 7) + raw_name + hpack_int(len(raw_value), 7) + raw_value


def grpc_frame(message: bytes) -> bytes:
    """One gRPC message on the wire: not compressed, its length, its bytes."""
    return b"\0" + struct.pack(">I", len(message)) + message


def grpc_messages(received: bytes) -> tuple[list[bytes], bytes]:
    """The whole gRPC messages at the start of `received`, and the rest (a message still arriving)."""
    messages = []
    while len(received) >= 5:
        size = struct.unpack(">I", received[1:5])[0]
        if len(received) < 5 + size:
            break
        messages.append(received[5 : 5 + size])
        received = received[5 + size :]
    return messages, received


@dataclass
class Received:
    """What one read from etcd brought: whole messages per stream, and the streams that ended."""

    messages: list[tuple[int, bytes]] = field(default_factory=list)
    ended: list[int] = field(default_factory=list)


class GrpcConnection:
    """One HTTP/2 connection carrying gRPC streams to `authority`. Not thread-safe, but its halves are apart:
    one thread may `receive` while another (one at a time) opens streams and frames messages."""

    def __init__(self, sock: socket.socket, authority: str) -> None:
        self.sock = sock
        self._authority = authority
        self._next_stream = 1
        self._buffer = b""
        self._partial: dict[int, bytes] = {}  # stream -> bytes of a gRPC message still arriving
        self._unacknowledged = 0  # bytes of DATA received since the connection's window was last topped up
        settings = struct.pack(">HIHI", SETTINGS_ENABLE_PUSH, 0, SETTINGS_INITIAL_WINDOW_SIZE, MAX_WINDOW)
        # each stream's window is 2^31 - 1 from the start and is never topped up: a lease's stream carries an
        # answer of ~20 bytes per refresh, a hundred million refreshes before it would run out
        self.sock.sendall(
            PREFACE
            + frame(SETTINGS, 0, 0, settings)
            + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", MAX_WINDOW - DEFAULT_WINDOW))
        )

    @classmethod
    def connect(cls, endpoint: str, timeout_s: float) -> GrpcConnection:
        host, port = endpoint.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(sock, endpoint)

    def open_stream(self, path: str) -> tuple[int, bytes]:
        """A new stream for a call to `path`: its id, and the HEADERS frame to send before its first message."""
        stream = self._next_stream
        self._next_stream += 2
        fields = (
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", self._authority),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        )
        block = b"".join(hpack_literal(name, value) for name, value in fields)
        return stream, frame(HEADERS, END_HEADERS, stream, block)

    @staticmethod
    def message(stream: int, message: bytes) -> bytes:
        """The DATA frame that sends one gRPC message on `stream`."""
        return frame(DATA, 0, stream, grpc_frame(message))

    def receive(self, data: bytes) -> tuple[Received, bytes]:
        """Parse what etcd sent; returns what it brought and the bytes to send back (acknowledgements)."""
        buffer = self._buffer + data
        received, reply = Received(), bytearray()
        offset = 0
        while len(buffer) - offset >= 9:
            length = _HEADER.unpack_from(buffer, offset)[0] >> 8
            end = offset + 9 + length
            if end > len(buffer):
                break
            kind, flags = buffer[offset + 3], buffer[offset + 4]
            stream = _HEADER.unpack_from(buffer, offset + 5)[0] & MAX_WINDOW
            payload = buffer[offset + 9 : end]
            offset = end
            if kind == DATA:
                self._unacknowledged += length
                if flags & PADDED:
                    payload = payload[1 : len(payload) - payload[0]]
                messages, self._partial[stream] = grpc_messages(self._partial.get(stream, b"") + payload)
                received.messages.extend((stream, message) for message in messages)
                if flags & END_STREAM:
                    received.ended.append(stream)
            elif kind == HEADERS and flags & END_STREAM or kind == RST_STREAM:
                received.ended.append(stream)
            elif kind == SETTINGS and not flags & ACK:
                reply += frame(SETTINGS, ACK, 0, b"")
            elif kind == PING and not flags & ACK:
                reply += frame(PING, ACK, 0, payload)
            elif kind == GOAWAY:
                raise ConnectionEnded(f"etcd sent GOAWAY (error code {struct.unpack('>I', payload[4:8])[0]})")
        self._buffer = buffer[offset:]
        for stream in received.ended:
            self._partial.pop(stream, None)
        if self._unacknowledged > MAX_WINDOW // 2:
            reply += frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self._unacknowledged))
            self._unacknowledged = 0
        return received, bytes(reply)
