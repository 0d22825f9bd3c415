"""Self-fencing: a node cut off from etcd (or stopped) longer than most of its lease kills its own workers."""

from __future__ import annotations

import os
import signal
import time

import pytest
from launcher_harness import PROBE_MISSED, resume

from launcher.workers.process_tree import child_pids, is_running

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
    smaller = cluster.wait_for_world(2, timeout=60, after=stopped_at)  # the others moved on without it (lease 2 s)
    cluster.wait_for(
        lambda: [e for e in cluster.events("node_lost") if e["node"] == "c" and e["reason"] == "lease expired"],
        30,
        "node c's lease to end",
    )
    os.kill(stopped.pid, signal.SIGCONT)
    resumed, resumed_at = time.monotonic(), time.time()
    cluster.wait_for(lambda: not any(is_running(p) for p in old_workers), 5, "the stale workers to die")
    stale_s = time.monotonic() - resumed
    assert stale_s < 2.5, "stale workers must go within about a second of the resume"

    back = cluster.wait_for_world(3, timeout=60, after=time.time())  # it rejoined and a scale-up round took it back
    cluster.stop_training()
    own = [line for line in stopped.text().splitlines() if "WARNING" in line or "ERROR" in line or "joined" in line]
    print(
        f"\nSIGSTOP node c past its lease: the others' first collective at world 2 {smaller['time'] - stopped_at:.1f}s "
        f"after the stop; after SIGCONT its stale workers were gone in {stale_s:.2f}s, world 3 again "
        f"{back['time'] - resumed_at:.1f}s after it; its own log:\n  " + "\n  ".join(own)
    )
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
        cluster.wait_for(lambda: not any(is_running(p) for p in workers), 10, "the workers to be fenced")
    finally:
        etcd.process.send_signal(signal.SIGCONT)
    # said once the kill returned, which waits for the workers' supervisors too: a moment after they are gone
    cluster.wait_for(lambda: "before the job moves on without them" in agent.text(), 5, "the fence's warning")
    cluster.wait_for(lambda: len(cluster.events("round_started")) >= 2, 30, "the node to rejoin in a new round")
    cluster.stop_training()
    assert agent.wait(timeout=90) == 0, cluster.dump()
    rounds = cluster.events("round_started")
    assert len(rounds) >= 2 and rounds[-1]["members"][0]["node"] == "solo"
    assert not cluster.events("restart"), "fencing is a membership change, not a counted restart"


def test_a_node_paused_past_the_probe_timeout_while_a_peer_fails_is_fenced_and_rejoins(cluster):
    """A false suspicion: c (agent and workers) is paused for 2 s, shorter than its lease (4 s here), while a worker
    of a crashes. c misses the roll call and the liveness probe (probe_timeout 0.5 s), so it is lost at once and
    its lease revoked; once resumed it finds its lease gone, drops its old workers and rejoins as a newcomer."""
    long_lease = "keep_alive_interval=0.5,keep_alive_max_attempt=8,last_call_timeout=1,join_timeout=60"
    probe = cluster.probe(300, 0.05)
    agents = [
        cluster.start(n, probe, nnodes="2:3", nproc=1, rdzv_conf=long_lease, extra=["--max-restarts", "3"])
        for n in ("a", "b", "c")
    ]
    cluster.wait_for_world(3, timeout=90)
    # neither the paused node nor the crashing one may be the controller: it must decide meanwhile
    victim, crashing = [agent for agent in agents if "now controls" not in agent.text()][:2]
    paused = [victim.pid, *child_pids(victim.pid)]
    old_workers = child_pids(victim.pid)
    for pid in paused:
        os.kill(pid, signal.SIGSTOP)
    crashed_at = time.time()
    try:
        os.kill(child_pids(crashing.pid)[0], signal.SIGKILL)
        lost = cluster.wait_for(lambda: cluster.events("node_lost"), 10, f"{victim.node_id} lost on its probe")
    finally:
        time.sleep(max(0.0, crashed_at + 2 - time.time()))
        resume(paused)
    assert [e["node"] for e in lost] == [victim.node_id] and PROBE_MISSED.fullmatch(lost[0]["reason"]), lost
    assert lost[0]["time"] - crashed_at < 4, "before the lease could have ended"
    cluster.wait_for(lambda: not any(is_running(p) for p in old_workers), 10, "the paused node's old workers to go")
    cluster.wait_for_world(3, timeout=60, after=time.time())  # it rejoined; a scale-up round took it back
    cluster.stop_training()
    rejoined = [e for e in cluster.events("node_joined") if e["node"] == victim.node_id]
    assert len(rejoined) == 2, "it came back as a newcomer"
    for agent in agents:
        assert agent.wait(timeout=90) == 0, cluster.dump()
    assert not cluster.events("job_failed")


def test_an_agent_whose_etcd_never_comes_back_gives_up_after_join_timeout(cluster, etcd):
    short_wait = "keep_alive_interval=0.5,keep_alive_max_attempt=3,last_call_timeout=1,join_timeout=3"
    agent = cluster.start("solo", cluster.probe(300, 0.05), nproc=1, rdzv_conf=short_wait)
    cluster.wait_for_world(1, timeout=90)
    workers = child_pids(agent.pid)
    etcd.process.kill()  # gone for good
    killed_at = time.monotonic()
    assert agent.wait(timeout=30) == 1, cluster.dump()
    assert time.monotonic() - killed_at < 2 + 3 + 5, "the lease (2 s) plus join_timeout (3 s), and little more"
    assert "has not answered for" in agent.text() and "giving up" in agent.text()
    assert not any(is_running(p) for p in workers)
