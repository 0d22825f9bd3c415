"""A real etcd that stops answering (SIGSTOP, as a member starved of CPU or behind a long apply backlog looks):
each retry of a call waits twice as long as the one before, so a slow etcd is sent fewer copies of the same
request, and the call gets its answer once etcd answers again."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from launcher.etcd import client as etcd_client
from launcher.etcd.errors import EtcdTimedOut

pytestmark = pytest.mark.timeout(60)

TIMEOUT_S = 0.4


def stop_every_thread(pid: int) -> None:
    """SIGSTOP `pid`, and return once each of its threads stopped. Each thread stops in its own time, 1 to 4 ms
    after the signal here: a CI run's call was answered by a thread still running (the call that had to time out
    returned etcd's value)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while True:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except OSError:
                continue  # a thread that ended meanwhile
        if all(state == "T" for state in states):
            return
        assert time.monotonic() < deadline, f"etcd's threads did not all stop: {states}"
        time.sleep(0.001)


def timed(call, durations: list[float]):
    def timed_call():
        start = time.monotonic()
        try:
            return call()
        finally:
            durations.append(time.monotonic() - start)

    return timed_call


def test_a_stopped_etcd_is_asked_again_with_twice_the_time_each_time(etcd) -> None:
    client = etcd_client.connect(etcd.endpoint, timeout=TIMEOUT_S)
    client.put("/patience", "here")
    pid = etcd.process.pid
    resume = threading.Timer(2.0, os.kill, (pid, signal.SIGCONT))
    durations: list[float] = []
    try:
        stop_every_thread(pid)
        resume.start()
        value, _ = etcd_client.call_with_retry(timed(lambda: client.get("/patience"), durations), deadline_s=20)
    finally:
        resume.cancel()
        os.kill(pid, signal.SIGCONT)
        client.close()
    assert value == b"here"
    # 0.4 s, then 0.8 s, then a third attempt of 1.6 s that etcd answers once it runs again at 2 s (at a fixed
    # 0.4 s it would have been the fifth or sixth)
    assert len(durations) == 3, durations
    assert 0.35 <= durations[0] < 0.8, durations  # a loaded machine may answer a deadline late, never early
    assert 0.75 <= durations[1] < 1.4, durations


def test_the_attempts_end_by_the_calls_deadline(etcd) -> None:
    client = etcd_client.connect(etcd.endpoint, timeout=TIMEOUT_S)
    client.put("/patience", "here")
    pid = etcd.process.pid
    durations: list[float] = []
    start = time.monotonic()
    try:
        stop_every_thread(pid)
        with pytest.raises(EtcdTimedOut):
            answer = etcd_client.call_with_retry(timed(lambda: client.get("/patience"), durations), deadline_s=2.0)
            print(f"a stopped etcd answered {answer} after {durations}")
    finally:
        os.kill(pid, signal.SIGCONT)
    took = time.monotonic() - start
    try:
        assert client.get("/patience")[0] == b"here"  # the next call has the client's own time again, and gets it
    finally:
        client.close()
    assert 2.0 <= took < 2.0 + TIMEOUT_S + 1.0, durations
    assert 0.35 <= durations[0] < 0.8, durations
    assert 0.75 <= durations[1] < 1.4, durations
