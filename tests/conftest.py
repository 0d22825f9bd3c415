import pytest
from launcher_harness import Cluster

from launcher.etcd.server import EtcdServer


@pytest.fixture
def etcd():
    """A real etcd on free loopback ports, stopped and its data removed after the test."""
    server = EtcdServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def cluster(etcd, tmp_path):
    """elastic-run agents on that etcd; every process group they started is killed after the test."""
    nodes = Cluster(etcd.endpoint, tmp_path)
    try:
        yield nodes
    finally:
        nodes.close()
