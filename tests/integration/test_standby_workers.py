"""Standby workers (issue #17, item 4): workers run the script up to `elastic.run`, say they are ready, and take
the round they are handed as their first; a script that cannot wait there turns standby off."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher.config import LaunchConfig, Std
from launcher.workers.environment import node_worker_env
from launcher.workers.process_tree import child_pids, process_name
from launcher.workers.standby import StandbyWorkers
from launcher.workers.warm_interpreter import STANDBY_NAME
from launcher.workers.warm_pool import WarmPool

pytestmark = pytest.mark.timeout(90)

ADDR = "127.0.0.1"

WAITS_AT_RUN = """\
import json, os, sys, time
import elastic
print("before run: RANK", os.environ.get("RANK"), "standby", os.environ.get("ELASTIC_STANDBY"), flush=True)

def main(greeting):
    if "GO" in os.environ:  # the test looks at this worker of a round, then lets it finish
        deadline = time.monotonic() + 20
        while not os.path.exists(os.environ["GO"]) and time.monotonic() < deadline:
            time.sleep(0.05)
    print(json.dumps({"greeting": greeting, "pid": os.getpid(), "standby": os.environ.get("ELASTIC_STANDBY"),
                      **{k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "ELASTIC_ROUND")}}))

elastic.run(main, "hello")
"""

READS_RANK_FIRST = """\
import os
import elastic
rank = int(os.environ["RANK"])
elastic.run(lambda: None)
"""


@contextlib.contextmanager
def warm_pool() -> Iterator[WarmPool]:
    """The node's pool, made where the test runs: pytest changes the environment (PYTEST_CURRENT_TEST) between a
    fixture and its test, and a zygote serves only the environment it was started with."""
    warm = WarmPool(node_worker_env(ADDR, 1), nproc=1, argv=["train.py"])
    try:
        yield warm
    finally:
        warm.close()


def wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def config(tmp_path: Path, script: str) -> LaunchConfig:
    entrypoint = tmp_path / "train.py"
    entrypoint.write_text(script)
    return LaunchConfig(
        min_nodes=1,
        max_nodes=2,
        nproc_per_node=1,
        rdzv_endpoint="127.0.0.1:2379",
        rdzv_id="job",
        entrypoint=str(entrypoint),
        log_dir=tmp_path / "logs",
        redirects=Std.ALL,
        worker_stop_timeout=2,
        node_id="n",
    )


def test_a_standby_worker_waits_in_elastic_run_and_takes_its_first_round_as_main(tmp_path):
    out_path = tmp_path / "round-out"
    with warm_pool() as pool:
        standby = StandbyWorkers(config(tmp_path, WAITS_AT_RUN), pool)
        standby.fill()
        try:
            assert standby.wait_ready(60, lambda: False) is None
            standby_log = tmp_path / "logs" / "n" / "standby" / "0" / "stdout.log"
            assert standby_log.read_text() == "before run: RANK None standby 1\n"
            [pid] = standby.pids()
            assert process_name(pid) == STANDBY_NAME and pid not in child_pids(os.getpid()), "no round's worker yet"
            round_env = dict(pool.env, RANK="3", WORLD_SIZE="4", LOCAL_RANK="0", ELASTIC_ROUND="2")
            round_env["GO"] = str(tmp_path / "go")
            with open(out_path, "wb") as out:
                handed = standby.hand_over(0, lambda link: link.offer(round_env, out.fileno(), out.fileno()))
            assert handed is not None
            process, link = handed
            named = wait_for(lambda: process_name(pid) != STANDBY_NAME, 20)
            assert process_name(pid) == os.path.basename(sys.executable)[:15], "named as a cold worker would be"
            assert named and pid in child_pids(os.getpid()), "a round's worker now"
            (tmp_path / "go").touch()
            assert process.wait(timeout=30) == 0
            link.close()
            assert standby.workers == {}, "handed over: the rank has no standby worker until the next fill"
            standby.fill()
            assert standby.wait_ready(60, lambda: False) is None and standby.pids() != [pid]
        finally:
            standby.stop()
    [line] = [line for line in out_path.read_text().splitlines() if line.startswith("{")]
    assert json.loads(line) == {
        "greeting": "hello",
        "pid": pid,
        "standby": None,
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "0",
        "ELASTIC_ROUND": "2",
    }


def test_a_script_that_reads_its_rank_before_elastic_run_is_not_ready_and_says_where_to_look(tmp_path):
    with warm_pool() as pool:
        standby = StandbyWorkers(config(tmp_path, READS_RANK_FIRST), pool)
        standby.fill()
        try:
            why_not = standby.wait_ready(60, lambda: False)
            standby.fill()
            assert standby.workers == {}, "off for good: the ranks start as before"
        finally:
            standby.stop()
    stderr_log = tmp_path / "logs" / "n" / "standby" / "0" / "stderr.log"
    assert why_not == standby.unusable == f"local rank 0 exited (1) before it reached elastic.run; see {stderr_log}"
    assert "KeyError: 'RANK'" in stderr_log.read_text()


def test_a_standby_worker_that_never_gets_a_round_is_stopped_with_its_node(tmp_path):
    with warm_pool() as pool:
        standby = StandbyWorkers(config(tmp_path, WAITS_AT_RUN), pool)
        standby.fill()
        assert standby.wait_ready(60, lambda: False) is None
        [worker] = standby.pids()
        [process] = [w.process for w in standby.workers.values()]
        standby.stop(signal.SIGTERM)
        assert process.wait(timeout=10) is not None
    with pytest.raises(ProcessLookupError):
        os.kill(worker, 0)


def test_a_script_without_elastic_run_is_not_started_in_standby(tmp_path):
    with warm_pool() as pool:
        standby = StandbyWorkers(config(tmp_path, "print('trains at once')\n"), pool)
        standby.fill()
        assert standby.workers == {} and standby.unusable == "the script does not call elastic.run"
