import pytest
from launcher_harness import Cluster

from launcher.etcd.server import EtcdServer

# At etcd's default timing a lone member elects itself after a random 0.1-1 s, which every test would wait out.
# Only start-up and etcd's shortest lease (1 s instead of 2) depend on it for a single member, and the tests ask
# for leases of 2 s and more; the clusters whose elections the tests are about set their own timing.
SINGLE_MEMBER_TIMING = ("--heartbeat-interval", "10", "--election-timeout", "100")

# The modules whose tests train or start many torch interpreters keep both cores busy (1.5 cores on average,
# measured per test from /proc/stat); the rest mostly wait, on leases, timeouts and etcd outages (0.7 cores).
# pytest-xdist (addopts: -n 2 --dist loadgroup) runs the first kind one at a time on one worker, in one group,
# while its second worker runs the rest beside them: two trainings never share the 2 cores, and the waiting no
# longer leaves them idle. The framework tests (test_integrations_frameworks: 2 workers, one framework import each,
# 0.65 cores by their processes' rusage) run on the second worker, which evens out the two workers' shares.
BUSY_MODULES = {
    "test_checkpoint_foreign_state",
    "test_checkpoint_memory",
    "test_checkpoint_reshard",
    "test_drain",
    "test_elastic_training",
    "test_inprocess_rounds",
    "test_launcher_scenarios",
    "test_multihost_netns",
    "test_progress_train",
    "test_scenario_script",
    "test_torchtitan",
    "test_warm_workers",
    "test_worker_wakeups",
}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.stem in BUSY_MODULES:
            item.add_marker(pytest.mark.xdist_group("busy"))


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
