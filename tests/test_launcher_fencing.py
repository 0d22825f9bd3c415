"""Self-fencing: a node cut off from etcd (or stopped) longer than most of its lease kills its own workers."""

from __future__ import annotations

import os
import signal
import time

import pytest

from launcher.process_tree import child_pids
from launcher_harness import pid_alive

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_a_node_stopped_past_its_lease_drops_its_old_workers_at_once_and_rejoins(cluster):
    probe = cluster.probe(300, 0.05)
    agents = [cluster.start(n, probe, nnodes="2:3", nproc=1) for n in ("a", "b", "c")]
    cluster.wait_for_world(3, timeout=90)
    stopped = agents[2]
    old_workers = child_pids(stopped.pid)
    assert old_workers

    os.kill(stopped.pid, signal.SIGSTOP)  # the agent only: its workers keep running in the old world
    stopped_at = time.time()
    cluster.wait_for_world(2, timeout=60, after=stopped_at)  # the others moved on without it (lease 2 s)
    time.sleep(max(0.0, stopped_at + 2 + 3 - time.time()))
    os.kill(stopped.pid, signal.SIGCONT)
    resumed = time.monotonic()
    cluster.wait_for(lambda: not any(pid_alive(p) for p in old_workers), 5, "the stale workers to die")
    assert time.monotonic() - resumed < 2.5, "stale workers must go within about a second of the resume"

    cluster.wait_for_world(3, timeout=60, after=time.time())  # it rejoined and a scale-up round took it back
    assert any(e["node"] == "c" and e["reason"] == "lease expired" for e in cluster.events("node_lost"))
    assert [e for e in cluster.events("node_joined") if e["node"] == "c"][1:], "c registered again as a newcomer"
    for agent in agents:
        assert agent.wait(timeout=90) == 0, cluster.dump()
    assert not cluster.events("job_failed")


def test_workers_are_fenced_when_etcd_is_gone_for_most_of_the_lease_and_the_job_goes_on(cluster, etcd):
    agent = cluster.start("solo", cluster.probe(120, 0.05), nproc=2)
    cluster.wait_for_world(2, timeout=90)
    workers = child_pids(agent.pid)
    etcd.process.send_signal(signal.SIGSTOP)  # etcd answers nobody: this node cannot tell it is not alone
    try:
        cluster.wait_for(lambda: not any(pid_alive(p) for p in workers), 10, "the workers to be fenced")
    finally:
        etcd.process.send_signal(signal.SIGCONT)
    assert "killing the workers before the job moves on without them" in agent.text()
    assert agent.wait(timeout=90) == 0, cluster.dump()
    rounds = cluster.events("round_started")
    assert len(rounds) >= 2 and rounds[-1]["members"][0]["node"] == "solo"
    assert not cluster.events("restart"), "fencing is a membership change, not a counted restart"
