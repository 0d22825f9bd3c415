"""The private etcd server: it finds its ports again when one is taken before it binds, but never on a restart."""

from __future__ import annotations

import socket
from contextlib import contextmanager

import pytest

from launcher.etcd import client as etcd_client
from launcher.etcd.server import EtcdServer, PortTaken

pytestmark = pytest.mark.timeout(60)


@contextmanager
def listening_on(port: int):
    """Another process's listener on ``port``, as a worker's store might hold it."""
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        yield


def test_etcd_starts_on_other_ports_when_its_port_was_taken_after_it_was_found_free():
    server = EtcdServer()
    taken = server.client_port
    try:
        with listening_on(taken):
            server.start()
        assert server.client_port != taken
        client = etcd_client.connect(server.endpoint, timeout=2.0)
        try:
            client.status()
        finally:
            client.close()
    finally:
        server.stop()


def test_a_restarted_etcd_keeps_its_ports_and_says_when_one_is_taken():
    server = EtcdServer().start()
    try:
        port = server.client_port
        assert server.process is not None
        server.process.kill()
        server.process.wait()
        with listening_on(port), pytest.raises(PortTaken, match="address already in use"):
            server.start()  # its clients look for it there: other ports would strand them
        assert server.client_port == port
    finally:
        server.stop()
