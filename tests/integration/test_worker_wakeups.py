"""The agent wakes on its workers' exits and on their rings (`launcher.workers.wakeups`), not only at its polls.

The scenario tests run agents whose `--monitor-interval` is a minute: a fault is seen within seconds only if the
evidence itself woke the agent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from launcher_harness import FAST_RDZV

from elastic import channel
from launcher.workers.wakeups import WorkerWakeups

SLOW_POLL = ["--monitor-interval", "60"]  # a poll never comes within the tests' time


class Wakes:
    """Counts wake-ups and lets a test wait for the next one."""

    def __init__(self) -> None:
        self.count = 0
        self._changed = threading.Condition()

    def __call__(self) -> None:
        with self._changed:
            self.count += 1
            self._changed.notify_all()

    def wait_beyond(self, count: int, timeout: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self.count > count, timeout)


@pytest.fixture
def wakeups():
    wakes = Wakes()
    watcher = WorkerWakeups("node-under-test", wakes)
    try:
        yield watcher, wakes
    finally:
        watcher.close()


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


@pytest.mark.timeout(30)
def test_an_exit_wakes_once_and_the_exited_pid_is_not_watched_again(wakeups):
    watcher, wakes = wakeups
    worker = sleeper()
    try:
        watcher.watch([worker.pid])
        time.sleep(0.2)
        assert wakes.count == 0, "a running worker wakes nobody"
        killed = time.monotonic()
        worker.kill()
        assert wakes.wait_beyond(0, 5), "the worker's exit woke the agent"
        assert time.monotonic() - killed < 1.0
        for _ in range(5):  # the agent lists it until its round ends; its pidfd would be readable forever
            watcher.watch([worker.pid])
        worker.wait()  # reaped: pidfd_open would now fail
        watcher.watch([worker.pid])
        assert not wakes.wait_beyond(1, 0.3), f"woken {wakes.count} times by one exit"
    finally:
        worker.kill()
        worker.wait()


@pytest.mark.timeout(30)
def test_a_ring_on_the_doorbell_wakes_and_a_forgotten_worker_does_not(wakeups, monkeypatch):
    watcher, wakes = wakeups
    forgotten = sleeper()
    try:
        watcher.watch([forgotten.pid])
        watcher.watch([])  # its round ended: no longer the agent's concern
        forgotten.kill()
        forgotten.wait()
        assert not wakes.wait_beyond(0, 0.3), "a worker no longer watched woke the agent"
    finally:
        forgotten.kill()
        forgotten.wait()
    monkeypatch.setenv(channel.AGENT_DOORBELL_ENV, watcher.address)
    for _ in range(3):
        channel.ring_agent()
    assert wakes.wait_beyond(0, 5), "the ring woke the agent"


@pytest.mark.timeout(30)
def test_closing_releases_the_thread_the_pidfds_and_the_doorbell(monkeypatch):
    before = set(os.listdir("/proc/self/fd"))
    wakes = Wakes()
    watcher = WorkerWakeups("node-under-test", wakes)
    workers = [sleeper() for _ in range(3)]
    try:
        watcher.watch(worker.pid for worker in workers)
        assert any(t.name == "worker-wakeups" for t in threading.enumerate())
        watcher.close()
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()
    assert not any(t.name == "worker-wakeups" for t in threading.enumerate())
    assert set(os.listdir("/proc/self/fd")) <= before
    monkeypatch.setenv(channel.AGENT_DOORBELL_ENV, watcher.address)
    channel.ring_agent()  # nobody listens: a no-op, no error
    assert wakes.count == 0


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_killed_worker_is_seen_at_its_exit_not_at_the_next_poll(cluster):
    """One node of 2 plain torchrun-style workers (warm, forked from the zygote): rank 1 is SIGKILLed, rank 0's
    collective fails, and the round after trains within seconds, with the agent's poll a minute away."""
    cluster.start("a", cluster.probe(400, 0.05), nproc=2, extra=[*SLOW_POLL, "--max-restarts", "1"])
    first = cluster.wait_for_world(2, timeout=90)
    victim = next(c["pid"] for c in reversed(cluster.collectives()) if c["rank"] == 1)
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    again = cluster.wait_for(
        lambda: next((c for c in cluster.collectives() if c["round"] > first["round"]), None),
        30,
        "a collective in the round after the kill",
    )
    failed = next(e for e in cluster.events("worker_failed") if e["time"] > killed_at)
    cluster.stop_training()
    print(
        f"\nworker SIGKILLed: worker_failed {failed['time'] - killed_at:.2f}s and the next round's first "
        f"collective {again['time'] - killed_at:.2f}s after the kill (--monitor-interval 60)"
    )
    assert failed["time"] - killed_at < 5, cluster.dump()


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("victim_role", ["member", "controller"])
def test_a_survivor_whose_collective_failed_rings_its_agent(cluster, victim_role):
    """One of two nodes is SIGKILLed. The survivor's worker, under elastic.run, fails in its collective and waits
    for the next round: it rings its agent, which reports the failure; the controller finds the dead node gone, or,
    when the dead node held the controller, the survivor deposes it and claims the seat without waiting for a poll.
    The lease (10 s) and the poll (a minute) are both far away."""
    long_lease = FAST_RDZV.replace(
        "keep_alive_interval=0.5,keep_alive_max_attempt=3", "keep_alive_interval=2,keep_alive_max_attempt=5"
    )
    probe = cluster.probe(400, 0.05, "--inprocess")
    agents = {n: cluster.start(n, probe, nnodes="1:2", nproc=1, rdzv_conf=long_lease, extra=SLOW_POLL) for n in "ab"}
    cluster.wait_for_world(2, timeout=90)
    controller = cluster.controller()
    victim = next(n for n in agents if (n == controller) == (victim_role == "controller"))
    survivor = next(n for n in agents if n != victim)
    killed_at = time.time()
    os.killpg(agents[victim].pid, signal.SIGKILL)
    again = cluster.wait_for_world(1, timeout=30, after=killed_at)
    cluster.stop_training()
    assert agents[survivor].wait(timeout=60) == 0, cluster.dump()
    failed = next(e for e in cluster.events("worker_failed") if e["time"] > killed_at and e["node"] == survivor)
    print(
        f"\nthe {victim_role}'s node SIGKILLed: the survivor's worker_failed {failed['time'] - killed_at:.2f}s and the "
        f"first collective at world 1 {again['time'] - killed_at:.2f}s after the kill (lease 10 s, "
        "--monitor-interval 60)"
    )
    assert again["time"] - killed_at < 8, cluster.dump()
