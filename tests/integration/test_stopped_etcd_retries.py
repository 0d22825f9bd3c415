"""A real etcd that stops answering (SIGSTOP, as a member starved of CPU or behind a long apply backlog looks):
each retry of a call waits twice as long as the one before, so a slow etcd is sent fewer copies of the same
request, and the call gets its answer once etcd answers again."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from launcher.etcd import client as etcd_client
from launcher.etcd.errors import EtcdTimedOut

pytestmark = pytest.mark.timeout(60)

TIMEOUT_S = 0.4


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
        os.kill(pid, signal.SIGSTOP)
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
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(EtcdTimedOut):
            etcd_client.call_with_retry(timed(lambda: client.get("/patience"), durations), deadline_s=2.0)
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
