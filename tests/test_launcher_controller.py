"""The round controller's decisions, tick by tick, against a real etcd with hand-placed agent records."""

from __future__ import annotations

import time

import pytest

from launcher import etcd_client
from launcher.config import LaunchConfig, RendezvousSettings
from launcher.controller import RoundController
from launcher.job_state import read_snapshot
from launcher.membership_log import read_events
from launcher.records import JobKeys, NodeFailure, NodeRecord, WorkerFailure

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def job(etcd):
    client = etcd_client.connect(etcd.endpoint)
    keys = JobKeys("ctl")
    leases = {}

    def join(node: str) -> None:
        leases[node] = client.lease(2)
        record = NodeRecord(node=node, addr="127.0.0.1", nproc=1, pid=1, joined_at=len(leases))
        client.put(keys.node(node), record.dumps(), lease=leases[node].id)

    def controller(max_restarts: int) -> RoundController:
        config = LaunchConfig(
            min_nodes=1, max_nodes=2, nproc_per_node=1, rdzv_endpoint=etcd.endpoint, rdzv_id="ctl", node_id="a",
            entrypoint="train.py", max_restarts=max_restarts,
            rdzv=RendezvousSettings(keep_alive_interval=0.5, keep_alive_max_attempt=3, last_call_timeout=0),
        )  # fmt: skip
        return RoundController(client, keys, config, lambda: leases["a"].id)

    def fail(node: str, round_: int) -> None:
        failure = WorkerFailure(node=node, round=round_, local_rank=0, rank=0, exit_code=1, time=time.time())
        client.put(keys.failed(round_, node), NodeFailure(node=node, round=round_, failures=[failure]).dumps())

    def two_node_round(max_restarts: int) -> RoundController:
        """a and b joined; a's controller formed round 0."""
        join("a")
        join("b")
        ctl = controller(max_restarts)
        ctl.tick()
        assert read_snapshot(client, keys).round.round == 0
        return ctl

    yield client, keys, two_node_round, fail, leases
    client.close()


def test_peer_failures_while_a_member_is_silent_wait_for_its_lease(job):
    client, keys, two_node_round, fail, leases = job
    ctl = two_node_round(max_restarts=0)

    fail("a", 0)  # b's death broke a's all_reduce; b itself never reports
    ctl.tick()
    snap = read_snapshot(client, keys)
    assert snap.round.round == 0 and snap.status is None, "must wait: b may be dead, not a's fault"

    leases["b"].revoke()  # what etcd does when b's lease expires
    ctl.tick()
    snap = read_snapshot(client, keys)
    assert (snap.round.round, snap.round.reason, snap.round.restart_count) == (1, "node_lost", 0)
    assert snap.status is None
    assert [e.event for e in read_events(client, keys)] == ["round_started", "node_lost", "round_started"]


def test_a_failure_with_every_member_alive_counts_against_max_restarts(job):
    client, keys, two_node_round, fail, leases = job
    ctl = two_node_round(max_restarts=1)
    fail("a", 0)
    deadline = time.monotonic() + ctl._lease_expiry_bound() + 2
    while read_snapshot(client, keys).round.round == 0:
        assert time.monotonic() < deadline, "a failure with b alive must restart after the lease bound"
        for node in leases.values():
            node.refresh()
        ctl.tick()
        time.sleep(0.2)
    snap = read_snapshot(client, keys)
    assert (snap.round.reason, snap.round.restart_count) == ("worker_failed", 1)

    fail("b", 1)  # the earlier failure is the root cause
    fail("a", 1)  # everyone reported: no waiting, and the budget of 1 is spent
    ctl.tick()
    snap = read_snapshot(client, keys)
    assert snap.status is not None and snap.status.state == "failed"
    assert "root cause node b, rank 0 (local_rank 0), exit code 1, in round 1" in snap.status.summary
