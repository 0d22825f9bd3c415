"""The fast failure detector's probe: a live agent answers with its incarnation; a gone or stopped one does not."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, wait
from pathlib import Path

import pytest

from launcher.rendezvous import liveness
from launcher.rendezvous.liveness import (
    SILENCE_FLOOR_S,
    LivenessServer,
    Miss,
    Target,
    probe,
    probe_all,
    silence_deadline,
)

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
            "no answer to a liveness probe within probe_timeout=0.3s", certain=False, silent=True
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


@pytest.mark.parametrize(
    ("answered_in", "waiting", "deadline"),
    [
        ([], 0, 0.5),  # no peer to compare with: probe_timeout
        ([0.002], 1, 0.5),  # a peer's answer is still awaited
        ([0.002, 0.004], 0, SILENCE_FLOOR_S),  # peers answered in milliseconds: the floor
        ([0.002, 0.05], 0, 0.25),  # five times the slowest peer
        ([0.3], 0, 0.5),  # peers as slow as that: never past probe_timeout
    ],
)
def test_a_suspect_is_silent_once_it_took_much_longer_than_its_peers(answered_in, waiting, deadline):
    assert silence_deadline(answered_in, waiting, timeout=0.5) == pytest.approx(deadline)


def listening_but_never_answering() -> socket.socket:
    """What a stopped agent's port looks like: the kernel completes the connection, nobody writes."""
    return socket.create_server(("127.0.0.1", 0), backlog=8)


def test_a_stopped_suspect_is_found_once_its_peers_answered_not_at_probe_timeout():
    peers = [LivenessServer("127.0.0.1").start() for _ in range(2)]
    live = LivenessServer("127.0.0.1").start()
    for number, server in enumerate([*peers, live], start=1):
        server.incarnation = number
    with listening_but_never_answering() as stopped:
        suspects = {
            "stopped": Target("127.0.0.1", stopped.getsockname()[1], 9),
            "live": Target("127.0.0.1", live.port, 3),
        }
        others = {f"peer{n}": Target("127.0.0.1", s.port, n) for n, s in enumerate(peers, start=1)}
        try:
            started = time.monotonic()
            misses = probe_all(suspects, others, timeout=5.0)
            took = time.monotonic() - started
            assert list(misses) == ["stopped"], "the live suspect answered"
            assert misses["stopped"].reason.startswith("no answer to a liveness probe within 0.")
            assert "while 2 other member(s) answered within" in misses["stopped"].reason
            assert not misses["stopped"].certain
            assert SILENCE_FLOOR_S <= took < 2.0, f"{took:.2f}s: waited for probe_timeout, not for its peers"

            # with no peer to compare with, the suspect has probe_timeout
            started = time.monotonic()
            alone = probe_all({"stopped": suspects["stopped"]}, {}, timeout=0.6)
            assert alone["stopped"] == Miss(
                "no answer to a liveness probe within probe_timeout=0.6s", certain=False, silent=True
            )
            assert time.monotonic() - started >= 0.6
        finally:
            for server in [*peers, live]:
                server.stop()


def test_a_suspect_waiting_for_a_free_thread_is_judged_from_when_its_own_probe_went_out(monkeypatch):
    """One probe at a time: the live suspect's probe goes out only once the stopped one's timed out, long after
    the peers set the deadline; it still answers, and only the stopped suspect is lost."""
    monkeypatch.setattr(liveness, "MAX_PARALLEL_PROBES", 1)
    peer, live = LivenessServer("127.0.0.1").start(), LivenessServer("127.0.0.1").start()
    peer.incarnation, live.incarnation = 1, 2
    with listening_but_never_answering() as stopped:
        try:
            started = time.monotonic()
            misses = probe_all(
                {
                    "stopped": Target("127.0.0.1", stopped.getsockname()[1], 9),
                    "live": Target("127.0.0.1", live.port, 2),
                },
                {"peer": Target("127.0.0.1", peer.port, 1)},
                timeout=0.8,
            )
            assert list(misses) == ["stopped"]
            assert time.monotonic() - started >= 0.8, "the live suspect's probe waited for the stopped one's thread"
        finally:
            peer.stop()
            live.stop()


def test_a_suspect_silent_until_its_own_probe_times_out_is_still_judged_against_its_peers(monkeypatch):
    """Peers as slow as probe_timeout / PEER_FACTOR leave the suspect the whole probe_timeout, so its own probe's
    timeout and the peers' deadline fall due together; on a loaded host the prober wakes late and finds the
    suspect's probe timed out first. Either way the reason names the peers (a CI run on a slow stretch of the
    machine lost a node 'within probe_timeout' alone, as if nobody had answered)."""
    timeout = 0.3

    def waking_late(futures, timeout=None, return_when=FIRST_COMPLETED):
        wait(futures, timeout=timeout, return_when=return_when)
        time.sleep(0.05)  # descheduled: the suspect's own probe times out meanwhile
        return wait(futures, timeout=0, return_when=return_when)

    monkeypatch.setattr(liveness, "wait", waking_late)
    with socket.create_server(("127.0.0.1", 0), backlog=8) as slow, listening_but_never_answering() as stopped:

        def answer_slowly() -> None:
            while True:
                try:
                    connection, _ = slow.accept()
                except OSError:
                    return  # closed: the test is over
                with connection:
                    time.sleep(timeout / liveness.PEER_FACTOR * 1.5)
                    connection.sendall(b"1\n")

        threading.Thread(target=answer_slowly, daemon=True).start()
        misses = probe_all(
            {"stopped": Target("127.0.0.1", stopped.getsockname()[1], 9)},
            {"slow": Target("127.0.0.1", slow.getsockname()[1], 1)},
            timeout=timeout,
        )
    assert list(misses) == ["stopped"]
    assert "while 1 other member(s) answered within" in misses["stopped"].reason, misses
    assert not misses["stopped"].certain
