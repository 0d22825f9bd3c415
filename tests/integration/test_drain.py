"""Drains before planned changes, end to end: examples/train.py under elastic-run grows from 2 to 3 nodes, or loses
one to SIGTERM, and no step is trained twice."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from launcher_harness import REPO
from test_elastic_training import TINY

from elastic.checkpoint.layout import scan
from launcher.workers.process_tree import child_pids

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TRAIN = REPO / "examples" / "train.py"


def steps_by_round(samples) -> dict[int, set[int]]:
    rounds: dict[int, set[int]] = {}
    for record in (json.loads(line) for line in samples.read_text().splitlines()):
        rounds.setdefault(record["round"], set()).add(record["step"])
    return rounds


def last_trained(samples) -> int:
    """The last step any round trained."""
    return max(max(steps_of_round) for steps_of_round in steps_by_round(samples).values())


def start_training(
    cluster, tmp_path, nodes: str, steps: int, script: Path = TRAIN, env: dict[str, str] | None = None
) -> tuple[list, Callable]:
    """`nodes` agents (--nnodes 2:3, one worker each) of `script` (examples/train.py, or a wrapper of it) with
    `env`, once they trained 5 steps; `start` starts another with the same arguments."""
    # --ckpt-every beyond the run: the only checkpoints are step 0, the drain's and the last
    args = [
        "--steps",
        str(steps),
        "--global-batch",
        "6",
        "--micro-batch",
        "1",
        "--ckpt-dir",
        str(tmp_path / "ckpt"),
        "--ckpt-every",
        "1000",
        "--sample-log",
        str(tmp_path / "samples.jsonl"),
        *TINY,
    ]

    def start(node: str):
        return cluster.start(node, args, nnodes="2:3", nproc=1, script=script, env=env)

    agents = [start(node) for node in nodes]
    samples = tmp_path / "samples.jsonl"
    cluster.wait_for(lambda: samples.is_file() and '"step": 5,' in samples.read_text(), 120, "step 5")
    return agents, start


def assert_nothing_redone(tmp_path, steps: int, cluster) -> dict[int, set[int]]:
    rounds = steps_by_round(tmp_path / "samples.jsonl")
    assert len(rounds) >= 2, rounds
    every = sorted(step for steps_of_round in rounds.values() for step in steps_of_round)
    assert every == list(range(1, steps + 1)), f"a step trained twice, or skipped: {every}\n{cluster.dump()}"
    return rounds


def test_a_scale_up_drains_first_so_no_step_is_trained_twice(cluster, tmp_path):
    """Once the grown round trained a step, every agent is told to stop: the job drains to disk and ends there."""
    # far more than the run gets to: ~0.1 s a step, and the joiner registers only once its zygote imported torch
    # (2 s here, more under a loaded suite; it drained at step 41 on an idle machine)
    steps = 400
    agents, start = start_training(cluster, tmp_path, "ab", steps)
    agents.append(start("c"))
    samples = tmp_path / "samples.jsonl"
    cluster.wait_for(lambda: len(steps_by_round(samples)) >= 2, 120, "a step in the grown round")
    cluster.stop_all(agents, timeout=90)

    last = last_trained(samples)
    rounds = assert_nothing_redone(tmp_path, last, cluster)
    drained = cluster.events("drain_committed")
    asked = [(e["reason"], e["in_memory"]) for e in cluster.events("drain_requested")]
    # then the stops: in memory while some nodes stay (the first SIGTERM can land well before the others)
    assert asked[0] == ("scale_up", True) and {reason for reason, _ in asked[1:]} == {"node_left"}, asked
    assert drained[0]["step"] == max(rounds[0]) == min(rounds[1]) - 1, "round 1 went on from the drain's step"
    on_disk = [entry.step for entry in scan(tmp_path / "ckpt") if entry.committed]
    assert drained[0]["step"] not in on_disk, "every node stays: a snapshot in memory answers the drain"
    assert max(on_disk) == last, f"the stop drained to disk at the last step {last}: {on_disk}"
    grown = cluster.events("round_started")[1]
    assert (grown["round"], grown["reason"], grown["world_size"]) == (1, "scale_up", 3)
    print(
        f"\nscale-up 2 -> 3 with a drain: round 0 trained steps 1-{max(rounds[0])}, drained at step "
        f"{drained[0]['step']}; round 1 went on from step {min(rounds[1])}; nothing redone"
    )


def test_an_agent_told_to_stop_drains_first_so_no_step_is_trained_twice(cluster, tmp_path):
    """The workers exit slowly on SIGTERM (slow_exit_train.py): drained, they wait at a committed step, so their
    agent leaves first and the next round forms while they stop; before, it waited out their grace period."""
    steps = 25  # the drain comes at step 6 or so: the rest is trained at 2 ranks
    marks = tmp_path / "sigterm.txt"
    script = Path(__file__).with_name("slow_exit_train.py")
    agents, _ = start_training(cluster, tmp_path, "abc", steps, script, env={"SLOW_EXIT_MARK": str(marks)})
    os.kill(agents[2].pid, signal.SIGTERM)  # a preemption notice
    assert agents[2].wait(timeout=90) == 128 + signal.SIGTERM, cluster.dump()
    received = marks.read_text().splitlines() if marks.exists() else []
    assert received, f"c's worker never received its SIGTERM\n{cluster.dump()}"
    # the first any of c's workers received (standby ones too, were the script to have them)
    sigterm_at = min(float(line.split()[1]) for line in received)
    for agent in agents[:2]:
        assert agent.wait(timeout=180) == 0, cluster.dump()

    rounds = assert_nothing_redone(tmp_path, steps, cluster)
    assert [(e["reason"], e["in_memory"]) for e in cluster.events("drain_requested")] == [("node_left", True)]
    drained = cluster.events("drain_committed")
    assert len(drained) == 1 and drained[0]["step"] == max(rounds[0]), f"{cluster.log()}\n{cluster.dump()}"
    on_disk = [entry.step for entry in scan(tmp_path / "ckpt") if entry.committed]
    assert drained[0]["step"] not in on_disk, "the 2 that stay go on, holding the snapshot: answered in memory"
    [left] = cluster.events("node_left")
    assert left["node"] == "c" and not cluster.events("node_lost")
    assert left["time"] < sigterm_at, "c left before its drained worker was told to stop"
    last = cluster.events("round_started")[-1]
    assert (last["reason"], last["world_size"]) == ("node_left", 2)
    print(
        f"\nSIGTERM to one of 3 with a drain: round 0 trained steps 1-{max(rounds[0])}, drained at step "
        f"{drained[0]['step']}; round 1 went on from step {min(rounds[1])}; nothing redone"
    )


def test_an_agent_told_to_stop_whose_worker_cannot_drain_leaves_at_once(cluster, tmp_path):
    """Issue #17: SIGTERM to an agent whose worker is stopped (it can answer no drain, and handles no SIGTERM)
    waited --drain-timeout (60 s) for the drain, then --shutdown-timeout (30 s) for the worker, while the job
    waited for it; the controller evicted it after close_timeout (30 s). The stopped worker shows the drain
    cannot happen: the agent answers it without a checkpoint, continues the worker with its SIGTERM, and leaves
    within seconds; the others go on from their newest snapshot."""
    steps = 30  # nothing trains while the worker is stopped: the rest is trained at 2 ranks, once c left
    agents, _ = start_training(cluster, tmp_path, "abc", steps)
    [worker] = child_pids(agents[2].pid)
    os.kill(worker, signal.SIGSTOP)
    os.kill(agents[2].pid, signal.SIGTERM)  # a preemption notice
    told = time.monotonic()
    assert agents[2].wait(timeout=60) == 128 + signal.SIGTERM, cluster.dump()
    left_s = time.monotonic() - told
    for agent in agents[:2]:
        assert agent.wait(timeout=180) == 0, cluster.dump()

    assert left_s < 10, f"the agent took {left_s:.1f}s to leave\n{cluster.dump()}"
    assert [e["node"] for e in cluster.events("node_left")] == ["c"] and not cluster.events("node_lost")
    last = cluster.events("round_started")[-1]
    assert (last["reason"], last["world_size"]) == ("node_left", 2)
    rounds = steps_by_round(tmp_path / "samples.jsonl")
    trained = set().union(*rounds.values())
    assert trained == set(range(1, steps + 1)), f"steps skipped: {sorted(set(range(1, steps + 1)) - trained)}"
    print(f"\nSIGTERM to one of 3 whose worker was stopped: it left after {left_s:.1f}s")


def test_every_agent_told_to_stop_at_once_drains_to_disk_so_the_next_launch_resumes_there(cluster, tmp_path):
    """A Slurm time limit (`--signal=B:TERM@180`) or a whole-job preemption SIGTERMs every node. No node stays to
    hold a snapshot in memory, so the drain goes to disk, and the next launch resumes at the last step trained."""
    steps = 400  # far more than the run gets to: it ends by the signals
    agents, _ = start_training(cluster, tmp_path, "abc", steps)
    cluster.stop_all(agents, timeout=90)

    trained = last_trained(tmp_path / "samples.jsonl")
    committed = [entry.step for entry in scan(tmp_path / "ckpt") if entry.committed]
    asked = cluster.events("drain_requested")
    assert {e["reason"] for e in asked} == {"node_left"} and not asked[-1]["in_memory"], cluster.log()
    assert max(committed) == trained, f"last step trained {trained}, newest on disk {committed}\n{cluster.log()}"
