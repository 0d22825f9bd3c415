"""elastic.run without I/O beyond a socket pair: main once outside elastic-run, again in each offered round."""

from __future__ import annotations

import gc
import json
import os
import socket
import threading
import time

import pytest

import elastic
from elastic import channel, rounds


@pytest.fixture
def agent_end(monkeypatch):
    """The agent's end of a round socket whose worker end is in ELASTIC_ROUND_FD, as elastic-run starts a worker."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    monkeypatch.setenv(rounds.ROUND_FD_ENV, str(theirs.detach()))
    monkeypatch.setenv(rounds.ROUND_WAIT_ENV, "5")
    monkeypatch.setenv("ELASTIC_ROUND", "0")
    yield ours
    ours.close()
    channel.round_check = None


def offer(agent_end: socket.socket, round_number: int, after_s: float = 0.0) -> None:
    def send() -> None:
        time.sleep(after_s)
        env = {"ELASTIC_ROUND": str(round_number), "RANK": "3", "WORLD_SIZE": "4"}
        socket.send_fds(agent_end, [json.dumps({"env": env}).encode()], [os.dup(1), os.dup(2)])

    threading.Thread(target=send, daemon=True).start()


def test_outside_elastic_run_main_runs_once(monkeypatch):
    monkeypatch.delenv(rounds.ROUND_FD_ENV, raising=False)
    calls = []
    assert elastic.run(lambda x: calls.append(x) or "done", 7) == "done"
    assert calls == [7]
    with pytest.raises(RuntimeError, match="no round"):
        elastic.run(lambda: (_ for _ in ()).throw(RuntimeError("no round to wait for")))


def test_a_failed_collective_waits_for_the_next_round_and_main_runs_again_in_it(agent_end, monkeypatch):
    rounds_seen = []

    def main() -> str:
        rounds_seen.append((os.environ["ELASTIC_ROUND"], os.environ.get("RANK")))
        if len(rounds_seen) == 1:
            offer(agent_end, 1, after_s=0.2)
            raise RuntimeError("Connection closed by peer")  # what gloo raises when a peer died
        return "trained"

    assert elastic.run(main) == "trained"
    assert rounds_seen == [("0", None), ("1", "3")]
    monkeypatch.delenv("RANK")


def test_heartbeat_raises_round_changed_once_a_round_is_offered(agent_end, monkeypatch):
    calls = []

    def main() -> int:
        calls.append(os.environ["ELASTIC_ROUND"])
        if len(calls) == 1:
            offer(agent_end, 5)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                elastic.heartbeat(1)  # RoundChanged once the offer arrived
                time.sleep(0.01)
            raise AssertionError("heartbeat never raised RoundChanged")
        return len(calls)

    assert elastic.run(main) == 2
    assert calls == ["0", "5"]
    monkeypatch.delenv("RANK")


def test_an_error_that_is_not_distributed_ends_the_worker_at_once(agent_end):
    started = time.monotonic()
    with pytest.raises(ValueError):
        elastic.run(lambda: (_ for _ in ()).throw(ValueError("a bug in the script")))
    assert time.monotonic() - started < 1.0, "it did not wait ELASTIC_ROUND_WAIT for a round"


def test_what_the_script_built_before_run_is_out_of_the_collections_and_what_main_builds_is_not(agent_end, request):
    """A re-entry collects the last round's garbage (its model and optimizer hold cycles): the collection walked
    every object the script had built as well (0.01-0.05 s at 6 ranks on 2 cores), now only what `main` built."""
    request.addfinalizer(gc.unfreeze)  # run froze this process's objects, pytest's among them
    before: list[object] = []
    before.append(before)  # a cycle the script built before elastic.run, as its data or its device

    def main() -> tuple[bool, bool]:
        built: list[object] = []
        built.append(built)  # a cycle of this round: garbage once the round is over
        tracked = gc.get_objects()
        return any(obj is before for obj in tracked), any(obj is built for obj in tracked)

    assert elastic.run(main) == (False, True)
