"""The fast failure detector's probe: a live agent answers with its incarnation; a gone or stopped one does not."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.rendezvous.liveness import LivenessServer, Miss, probe

pytestmark = pytest.mark.timeout(30)


def test_a_live_agent_answers_with_its_incarnation():
    server = LivenessServer("127.0.0.1").start()
    server.incarnation = 0x1F2E
    try:
        assert probe("127.0.0.1", server.port, 0x1F2E, timeout=2.0) is None
        assert probe("127.0.0.1", server.port, 0x99, timeout=2.0) == Miss(
            "liveness probe answered by another incarnation (1f2e)", certain=True
        )
    finally:
        server.stop()
    assert probe("127.0.0.1", server.port, 0x1F2E, timeout=2.0) == Miss(
        "liveness probe refused: the agent is gone", certain=True
    ), "stopped: the port is closed"


def test_a_stopped_agent_does_not_answer_within_the_timeout():
    code = (
        "from launcher.rendezvous.liveness import LivenessServer; import sys; "
        "s = LivenessServer('127.0.0.1').start(); "
        "s.incarnation = 7; print(s.port, flush=True); sys.stdin.read()"  # lives until the test is done
    )
    agent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(agent.stdout.readline())
        assert probe("127.0.0.1", port, 7, timeout=2.0) is None
        os.kill(agent.pid, signal.SIGSTOP)  # the kernel still accepts the connection; nobody answers it
        while Path(f"/proc/{agent.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
            time.sleep(0.01)  # the stop takes effect asynchronously
        started = time.monotonic()
        assert probe("127.0.0.1", port, 7, timeout=0.3) == Miss(
            "no answer to a liveness probe within probe_timeout=0.3s", certain=False
        )
        assert time.monotonic() - started < 1.0
    finally:
        agent.kill()
        agent.wait()


def test_an_address_nobody_listens_on_is_refused_at_once():
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))
        port = placeholder.getsockname()[1]
    assert probe("127.0.0.1", port, 1, timeout=2.0).certain
