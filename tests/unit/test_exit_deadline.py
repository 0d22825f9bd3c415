"""An agent whose job is over exits within its deadline, with the status it decided and the stacks of what held it,
and never waits on the interpreter's teardown."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(60)

HELD = """
import threading, time
from launcher.node import exit_deadline
exit_deadline.arm(7, stop_s=0.2, margin_s=0.3)
threading.Thread(target=time.sleep, args=(60,), name="holds-the-exit").start()  # not a daemon: exit waits on it
"""

HELD_IN_TEARDOWN = """
import logging, sys, threading, time, types
from launcher.node import exit_deadline
logging.basicConfig(stream=sys.stderr, format="%(message)s")
lock, locked = threading.Lock(), threading.Event()
threading.Thread(target=lambda: (lock.acquire(), locked.set(), time.sleep(60)), daemon=True).start()
locked.wait()  # a daemon thread holds the lock, as grpc's threads hold their calls' locks

class Call:
    def __init__(self, lock):
        self.lock = lock
    def __del__(self):  # run in the teardown, once the daemon thread was stopped with the lock held
        with self.lock:
            pass

library = sys.modules["library"] = types.ModuleType("library")
library.call = Call(lock)
exit_deadline.arm(7, stop_s=0.2, margin_s=20)
logging.getLogger("agent").warning("job finished")
print("the last line", end="")  # still buffered at the exit
"""

FREE = """
from launcher.node import exit_deadline
exit_deadline.arm(7, stop_s=0.2, margin_s=20)
"""


def test_an_exit_held_past_the_deadline_ends_with_the_decided_status_and_the_stacks():
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-c", HELD], capture_output=True, text=True, timeout=30)
    assert done.returncode == 7, done.stderr
    assert time.monotonic() - began < 10
    assert "the agent's exit took over 0.5s" in done.stderr
    assert done.stderr.count("most recent call first") >= 2, done.stderr  # every thread: the main one and its holder


def test_the_interpreters_teardown_cannot_hold_the_exit_and_nothing_logged_is_lost():
    """In one CI run an agent logged its job finished and then hung in the teardown, in a grpc call's finaliser
    that waited on a lock a stopped daemon thread held."""
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-c", HELD_IN_TEARDOWN], capture_output=True, text=True, timeout=30)
    assert done.returncode == 7, done.stderr
    assert time.monotonic() - began < 10, "well within the deadline: the teardown is skipped, not timed out"
    assert done.stderr == "job finished\n" and done.stdout == "the last line"


def test_an_exit_not_held_ends_at_once_with_the_decided_status():
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-c", FREE], capture_output=True, text=True, timeout=30)
    assert done.returncode == 7 and done.stderr == ""
    assert time.monotonic() - began < 10, "the deadline's thread does not hold the exit itself"
