"""A hung worker's stack dump is over once /proc shows it written (the signal delivered, bytes written, then
none more), not a fixed grace later; where /proc cannot tell, the grace decides."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from elastic.channel import DUMP_SIGNAL
from launcher.workers import watchdog
from launcher.workers.watchdog import DUMP_GRACE_S, StackDump

pytestmark = pytest.mark.timeout(60)

BLOCKED = f"""
import faulthandler, sys, threading
faulthandler.register({int(DUMP_SIGNAL)}, file=sys.stderr, all_threads=True, chain=False)
print("ready", flush=True)
threading.Event().wait()  # blocked in C, as a worker waiting in a collective is: no Python signal handler runs
"""


@pytest.fixture
def blocked_worker(tmp_path):
    stderr = tmp_path / "stderr"
    with open(stderr, "wb") as sink:
        process = subprocess.Popen([sys.executable, "-c", BLOCKED], stdout=subprocess.PIPE, stderr=sink)
    try:
        assert process.stdout is not None and process.stdout.readline() == b"ready\n"
        yield process, stderr
    finally:
        process.kill()
        process.wait()


def wait_over(dump: StackDump) -> float:
    """Seconds until the dump is over, checked as the agent's poll does (every 0.1 s)."""
    asked = time.monotonic()
    while not dump.over(time.monotonic()):
        time.sleep(0.1)
    return time.monotonic() - asked


@pytest.mark.parametrize("stopped", [False, True], ids=["blocked", "stopped"])
def test_a_dump_is_over_once_written_long_before_the_grace(blocked_worker, stopped):
    process, stderr = blocked_worker
    if stopped:
        os.kill(process.pid, signal.SIGSTOP)
    took = wait_over(StackDump.ask(process.pid, int(DUMP_SIGNAL), time.monotonic()))
    assert "most recent call first" in stderr.read_text()
    assert took < DUMP_GRACE_S / 2, f"over {took:.2f}s after the signal: the grace decided, not the evidence"


def test_a_worker_without_the_handler_gets_no_signal_and_no_wait(tmp_path):
    process = subprocess.Popen(
        [sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.read()"],  # until the test is done
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert process.stdout is not None and process.stdout.readline() == b"ready\n"
        now = time.monotonic()
        assert StackDump.ask(process.pid, int(DUMP_SIGNAL), now).over(now)
        assert process.poll() is None, "the signal, unhandled, would have killed it"
    finally:
        process.kill()
        process.wait()


def test_where_proc_cannot_tell_the_grace_decides(blocked_worker, monkeypatch):
    process, _ = blocked_worker
    monkeypatch.setattr(watchdog, "_bytes_written", lambda pid: None)
    asked = time.monotonic()
    dump = StackDump.ask(process.pid, int(DUMP_SIGNAL), asked)
    time.sleep(0.3)
    assert not dump.over(asked + DUMP_GRACE_S - 0.01)
    assert dump.over(asked + DUMP_GRACE_S)


def test_a_worker_still_writing_has_until_the_grace(monkeypatch):
    written = iter(range(100, 10_000, 7))  # grows at every look: the dump, or the worker's own output, goes on
    monkeypatch.setattr(watchdog, "_bytes_written", lambda pid: next(written))
    monkeypatch.setattr(watchdog, "_pending", lambda pid, signum: False)
    dump = StackDump(pid=1, signum=int(DUMP_SIGNAL), deadline=10.0, written_before=0)
    assert not any(dump.over(t / 10) for t in range(99))
    assert dump.over(10.0)


def test_no_dump_asked_is_over_at_once():
    assert StackDump.none(5.0).over(5.0)
