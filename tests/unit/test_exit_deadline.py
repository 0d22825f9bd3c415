"""An agent whose job is over exits within its deadline, with the status it decided and the stacks of what held it;
an exit that is not held is left alone."""

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


def test_an_exit_not_held_is_not_changed():
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-c", FREE], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stderr == ""
    assert time.monotonic() - began < 10, "the deadline's thread does not hold the exit itself"
