import pytest
from launcher_harness import Cluster

from launcher.etcd.server import EtcdServer

# At etcd's default timing a lone member elects itself after a random 0.1-1 s, which every test would wait out.
# Only start-up and etcd's shortest lease (1 s instead of 2) depend on it for a single member, and the tests ask
# for leases of 2 s and more; the clusters whose elections the tests are about set their own timing.
SINGLE_MEMBER_TIMING = ("--heartbeat-interval", "10", "--election-timeout", "100")


@pytest.fixture
def etcd():
    """A real etcd on free loopback ports, stopped and its data removed after the test."""
    server = EtcdServer(flags=SINGLE_MEMBER_TIMING).start()
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
