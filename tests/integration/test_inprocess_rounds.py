"""In-process rounds (issue #17): workers of examples/train.py, which runs under `elastic.run`, take a new round
in the same process when a node is lost, stopped, joins, or one of their peers crashes; the data and the
steps stay exactly those of a job whose workers all restarted."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launcher_harness import FAST_RDZV, REPO
from test_elastic_training import committed_history

from elastic import channel
from elastic.channel import HEARTBEAT_ENV
from elastic.node_memory import MEMORY_DIR_ENV
from elastic.rounds import ROUND_FD_ENV, ROUND_WAIT_ENV
from launcher.etcd.server import free_port
from launcher.workers.process_tree import child_pids
from launcher.workers.round_link import RoundLink

pytestmark = pytest.mark.slow

TRAIN = REPO / "examples" / "train.py"
STUBBORN = REPO / "tests" / "integration" / "stubborn_worker.py"
RANK_SWAP = REPO / "tests" / "integration" / "rank_swap_worker.py"
QUEUED_SEND = REPO / "tests" / "integration" / "queued_send_worker.py"
# every node takes part in round 0, however slowly a loaded machine starts the second agent
BOTH = FAST_RDZV.replace("last_call_timeout=1", "last_call_timeout=60")
# train.py's default model on a small corpus: steps slow enough (about 0.1 s) for a fault to land mid-run
SMALL = ["--seq-len", "32", "--corpus-chars", "60000"]
STANDBY_READY = "standby worker(s) ready (pids"  # the agent, once each local rank has a standby worker


def args(samples, tmp_path, steps: int) -> list[str]:
    return [
        "--steps",
        str(steps),
        "--global-batch",
        "8",
        "--micro-batch",
        "2",
        "--ckpt-dir",
        str(tmp_path / "ckpt"),
        "--ckpt-every",
        "50",
        "--memory-every",
        "1",
        "--sample-log",
        str(samples),
        *SMALL,
    ]


def records(samples) -> list[dict]:
    return [json.loads(line) for line in samples.read_text().splitlines()] if samples.is_file() else []


def newest(samples) -> dict | None:
    found = records(samples)
    return max(found, key=lambda r: (r["time"], r["rank"])) if found else None


def reached(samples, world_size: int, step_after: int = 0):
    return lambda: any(r["world_size"] == world_size and r["step"] > step_after for r in records(samples))


def assert_every_sample_once(samples, steps: int, global_batch: int = 8) -> None:
    history = committed_history(samples)
    assert sorted(history) == list(range(1, steps + 1))
    used = [i for step in history.values() for r in step for i in r["samples"]]
    assert len(used) == steps * global_batch and len(set(used)) == len(used), "every sample once, none skipped"


def workers_started(cluster) -> list[dict]:
    return cluster.events("workers_started")


def stuck_and_replaced(agent_output: str, round_: int) -> int:
    """Survivors that could not re-enter and were started anew in this round. Known gap, now and then on a loaded
    2-core machine: the abort does not end a send gloo queued behind the stopped peer (test_gloo_abort.py); the
    worker finds itself blocked and leaves (`UNWIND_STUCK_EXIT`), or, failing that, --inprocess-timeout ends it."""
    left = rf"round {round_}: worker local_rank \d+ could not unwind"
    timed_out = rf"round {round_}: worker local_rank \d+ did not re-enter within"
    return len(re.findall(left, agent_output)) + len(re.findall(timed_out, agent_output))


@pytest.mark.timeout(240)
def test_survivors_blocked_on_a_stopped_node_reenter_and_reenter_again_when_a_node_joins(cluster, tmp_path):
    """Node b is SIGSTOPped: a's workers block in a collective on it (gloo would wait 30 minutes). b's lease
    expires, the new round is offered, and aborting the process groups' connections unblocks them: they take the
    smaller round in process (the same pids train on). Node c then joins: its workers start in standby and are
    ready before it registers, so before the drain that makes room for it; then a's workers take the larger round
    in process, and c's standby workers take it as their first. Once they trained a step, both agents are told to
    stop: the job drains to disk and ends there."""
    samples = tmp_path / "samples.jsonl"
    # far more than the run gets to: c joined at step 53 on an idle machine, and in a loaded CI run a's two ranks
    # trained 80 steps during c's 8 s start-up
    steps = 400
    a, b = (cluster.start(n, args(samples, tmp_path, steps), nnodes="1:2", rdzv_conf=BOTH, script=TRAIN) for n in "ab")
    cluster.wait_for(reached(samples, 4, 10), 120, "step 10 at 4 ranks")
    a_pids = set(child_pids(a.pid)) & {r["pid"] for r in records(samples)}
    assert len(a_pids) == 2, (a_pids, records(samples)[-4:])
    os.killpg(b.pid, signal.SIGSTOP)
    try:
        cluster.wait_for(reached(samples, 2), 60, "a step at 2 ranks")
    finally:
        os.killpg(b.pid, signal.SIGKILL)
    survivors = {r["pid"] for r in records(samples) if r["world_size"] == 2}
    smaller = min(r["round"] for r in records(samples) if r["world_size"] == 2)
    assert len(survivors) == 2 and len(survivors & a_pids) == 2 - stuck_and_replaced(a.text(), smaller), (
        "a's workers train on in the same processes"
    )
    assert "aborted the process groups" in a.text(), "the new round's offer unblocked the collective"
    step_before_join = newest(samples)["step"]
    c = cluster.start("c", args(samples, tmp_path, steps), nnodes="1:2", script=TRAIN)
    cluster.wait_for(reached(samples, 4, step_before_join), 120, "a step at 4 ranks after c joined")
    cluster.stop_all([a, c], timeout=120)

    assert_every_sample_once(samples, max(committed_history(samples)))
    shrunk = max(r["round"] for r in records(samples) if r["world_size"] == 2)
    after_join = {r["pid"] for r in records(samples) if r["world_size"] == 4 and r["round"] > shrunk}
    assert survivors <= after_join and len(after_join) == 4, "a's workers re-entered again"
    assert after_join - survivors == standby_pids(c.text()), "c's workers are those that waited in standby"
    started = workers_started(cluster)
    started_by = sorted((e["node"], e["inprocess"], e.get("prepared"), e["fresh"]) for e in started)
    assert started_by == [("a", 2, None, 0), ("a", 2, None, 0), ("c", 0, 2, 0)], started
    log = cluster.log()
    joined = next(i for i, e in enumerate(log) if e["event"] == "node_joined" and e["node"] == "c")
    assert log[joined].get("prepared") == 2, log[joined]
    drained = [i for i, e in enumerate(log) if e["event"] == "drain_requested" and i > joined]
    assert drained, "the drain that made room for c was asked for once c's workers were ready"
    assert "re-entering main in process" in a.text()  # the workers' output goes to the agent's


def standby_pids(agent_output: str) -> set[int]:
    found = re.search(r"ready in standby \(pids ([\d, ]+)\)", agent_output)
    assert found, agent_output[-3000:]
    return {int(pid) for pid in found.group(1).split(", ")}


@pytest.mark.timeout(240)
def test_a_crashed_and_then_a_stopped_worker_are_replaced_while_their_peers_reenter(cluster, tmp_path):
    """One worker is SIGKILLed: its rank takes its node's standby worker, while its local peer and node b's
    workers, whose collectives failed, wait for the next round and take it in process. Then one worker is
    SIGSTOPped: every worker falls silent and is found hung; the stopped one is killed and replaced, and the
    others, which only wait in a collective on it, are left alive and take the round after in process."""
    samples = tmp_path / "samples.jsonl"
    steps = 60  # round 2 began at step 17 on an idle machine; nothing trains while the worker is stopped
    extra = ["--max-restarts", "2", "--watchdog-min", "2"]
    for n in "ab":
        cluster.start(n, args(samples, tmp_path, steps), nnodes="1:2", rdzv_conf=BOTH, script=TRAIN, extra=extra)
    cluster.wait_for(reached(samples, 4, 10), 120, "step 10 at 4 ranks")
    # started once round 0 trains; on a loaded machine a standby worker was still starting at step 10
    cluster.wait_for(lambda: all(STANDBY_READY in agent.text() for agent in cluster.agents), 60, "standby workers")
    round_0 = {r["rank"]: r["pid"] for r in records(samples) if r["round"] == 0}
    os.kill(round_0[0], signal.SIGKILL)
    cluster.wait_for(lambda: any(r["round"] == 1 for r in records(samples)), 60, "a step in the round after the crash")
    round_1 = {r["rank"]: r["pid"] for r in records(samples) if r["round"] == 1}
    assert round_0[0] not in round_1.values() and len(set(round_1.values()) & set(round_0.values())) == 3, (
        cluster.dump()
    )
    os.kill(round_1[3], signal.SIGSTOP)
    try:
        cluster.wait_for(lambda: any(r["round"] == 2 for r in records(samples)), 60, "a step after the hang")
    finally:
        with contextlib.suppress(ProcessLookupError):  # the watchdog killed it, as it should
            os.kill(round_1[3], signal.SIGKILL)
    for agent in cluster.agents:
        assert agent.wait(timeout=120) == 0, cluster.dump()

    assert_every_sample_once(samples, steps)
    round_2 = {r["pid"] for r in records(samples) if r["round"] == 2}
    stuck = sum(stuck_and_replaced(agent.text(), 2) for agent in cluster.agents)
    assert round_1[3] not in round_2 and len(round_2 & set(round_1.values())) == 3 - stuck, cluster.dump()
    fates = {e["rank"]: e["message"] for e in cluster.events("worker_hung") if e["round"] == 1}
    assert fates.get(3, "").endswith("process group killed"), json.dumps(cluster.log("job"), indent=0)  # stopped
    spared = [message for rank, message in fates.items() if rank != 3]
    assert all(m.endswith("left alive to take the next round in process") for m in spared), fates
    counts = {
        n: sorted(
            (e["inprocess"], e.get("prepared") or 0, e["fresh"]) for e in workers_started(cluster) if e["round"] == n
        )
        for n in (1, 2)
    }
    # the crashed worker's rank took its node's standby worker, ready before the crash; the hung one's took a
    # standby worker too, unless the refill after round 1 was not ready
    assert counts[1] == [(1, 1, 0), (2, 0, 0)], workers_started(cluster)
    assert counts[2] in ([(1, 1, 0), (2, 0, 0)], [(1, 0, 1), (2, 0, 0)]), workers_started(cluster)


@pytest.mark.timeout(180)
def test_a_worker_that_does_not_unwind_is_replaced_and_no_inprocess_restarts_everyone(cluster, tmp_path):
    """A worker whose main never returns to a heartbeat or a collective is killed after --inprocess-timeout and
    its rank starts in a new process; with --no-inprocess every worker is a new process in every round."""
    marks = tmp_path / "marks.jsonl"
    script_args = ["--marks", str(marks)]
    a = cluster.start(
        "a", script_args, nnodes="1:2", rdzv_conf=BOTH, script=STUBBORN, extra=["--inprocess-timeout", "2"]
    )
    b = cluster.start("b", script_args, nnodes="1:2", rdzv_conf=BOTH, script=STUBBORN)
    cluster.wait_for(lambda: len(records(marks)) >= 4, 90, "4 workers in round 0")
    os.killpg(b.pid, signal.SIGKILL)
    assert a.wait(timeout=90) == 0, cluster.dump()
    assert "did not re-enter within --inprocess-timeout 2s: dumping its stacks" in a.text(), a.text()[-3000:]
    assert "stubborn_worker.py" in a.text().split("dumping its stacks")[1], "its stack shows where it was stuck"
    round_1 = [r for r in records(marks) if r["round"] == 1]
    stubborn = {r["pid"] for r in records(marks) if r["round"] == 0 and r["stubborn"] and r["node"] == "a"}
    assert len(round_1) == 2 and not stubborn & {r["pid"] for r in round_1}, records(marks)
    assert {r["reentered"] for r in round_1} == {True, False}, "the other worker re-entered in process"

    marks.unlink()
    c = cluster.start(
        "c",
        script_args,
        nnodes="1:2",
        rdzv_id="plain",
        rdzv_conf=BOTH,
        script=STUBBORN,
        extra=["--no-inprocess"],
        env={"STUBBORN": "0"},
    )
    d = cluster.start(
        "d", script_args, nnodes="1:2", rdzv_id="plain", rdzv_conf=BOTH, script=STUBBORN, env={"STUBBORN": "0"}
    )
    cluster.wait_for(lambda: len(records(marks)) >= 4, 90, "4 workers in round 0")
    os.killpg(d.pid, signal.SIGKILL)
    assert c.wait(timeout=90) == 0, cluster.dump()
    round_1 = [r for r in records(marks) if r["round"] == 1]
    assert len(round_1) == 2 and not any(r["reentered"] for r in round_1)
    assert not cluster.events("workers_started", rdzv_id="plain")


@pytest.mark.timeout(120)
def test_a_round_at_another_rank_shards_as_that_rank(tmp_path):
    """Two processes swap ranks between rounds, ended as elastic.run ends one. A DeviceMesh equals any other of
    the same shape whatever the rank, so DTensor's caches handed the second round the first round's mesh, and FSDP
    held (and DCP saved) the old rank's rows: the plans of two ranks covered half of each tensor."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    store = str(tmp_path / "store")
    workers = [
        subprocess.Popen(
            [sys.executable, str(RANK_SWAP), str(rank), store], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO
        )
        for rank in (0, 1)
    ]
    for worker in workers:
        out, _ = worker.communicate(timeout=100)
        assert worker.returncode == 0
        rounds = [json.loads(line) for line in out.splitlines()]
        assert [r["coordinate"] for r in rounds] == [[r["rank"]] for r in rounds], rounds


@pytest.mark.timeout(120)
def test_a_worker_blocked_where_no_abort_reaches_leaves_and_is_started_anew_without_the_timeout(cluster, tmp_path):
    """Node a's worker sends to node b's, which stopped reading: gloo queues the send, and shutting the connections
    down does not end it (test_gloo_abort.py). Node b stops; in the round without it, a's worker finds itself
    still blocked inside torch.distributed once gloo closed every connection of its group (nothing can end the send
    then) and exits with UNWIND_STUCK_EXIT; a starts its rank anew at once, long before --inprocess-timeout, and the
    job finishes."""
    marks = tmp_path / "marks.jsonl"
    script_args = ["--marks", str(marks)]
    timeout = ["--inprocess-timeout", "60"]  # the fallback would come far too late for this test
    a = cluster.start("a", script_args, nproc=1, nnodes="1:2", rdzv_conf=BOTH, script=QUEUED_SEND, extra=timeout)
    b = cluster.start("b", script_args, nproc=1, nnodes="1:2", rdzv_conf=BOTH, script=QUEUED_SEND)
    cluster.wait_for((tmp_path / "posted").exists, 90, "b's receive posted")
    os.killpg(b.pid, signal.SIGSTOP)
    try:
        assert a.wait(timeout=60) == 0, cluster.dump()
    finally:
        os.killpg(b.pid, signal.SIGKILL)
    assert "could not unwind (blocked where no abort reaches" in a.text(), a.text()[-3000:]
    assert "did not re-enter within" not in a.text()
    assert "leaving for elastic-run to start this rank anew" in a.text(), "the worker said why it left"
    assert "though gloo closed every connection of its groups" in a.text(), "it left once nothing could end its wait"
    sent = next(r["pid"] for r in records(marks) if r["round"] == 0 and r["node"] == "a")
    later = [r for r in records(marks) if r["round"] > 0]
    assert later and all(r["pid"] != sent and not r["reentered"] for r in later), records(marks)


def process_usage(pid: int) -> tuple[int, int, int]:
    """(open descriptors, threads, resident kB) of a running process, from /proc."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return len(os.listdir(f"/proc/{pid}/fd")), int(status["Threads"]), int(status["VmRSS"].split()[0])


@pytest.mark.timeout(300)
def test_thirty_rounds_in_process_leak_no_descriptor_thread_or_memory(tmp_path):
    """Two workers of examples/train.py under elastic.run take 30 planned rounds in a row in process, as an agent
    hands them over (launcher.workers.round_link): each round drained first (a checkpoint at a step boundary),
    then offered with a new store port, channel, stdout and stderr; the workers build the model anew and load
    the drain's snapshot from memory. Whatever a round leaves behind (a process group's sockets, a channel's
    mapping, a round's output descriptors, a manager's threads, snapshot mappings) would add up over a long
    job's changes: a descriptor or a thread a round, or 0.2 % of the memory a round, shows in the 25 measured."""
    rounds, warm = 30, 5
    samples = tmp_path / "samples.jsonl"
    links = [RoundLink.pair() for _ in range(2)]
    node_env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        LOCAL_WORLD_SIZE="2",
        GROUP_WORLD_SIZE="1",
        ROLE_WORLD_SIZE="2",
        WORLD_SIZE="2",
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        TORCHELASTIC_RUN_ID="leaks",
        **{MEMORY_DIR_ENV: str(tmp_path / "memory"), ROUND_WAIT_ENV: "30"},
    )

    def heartbeat_file(round_: int, rank: int) -> Path:
        return tmp_path / f"attempt_{round_}" / str(rank) / "heartbeat"

    def round_env(round_: int, rank: int, port: int) -> dict[str, str]:
        heartbeat_file(round_, rank).parent.mkdir(parents=True)
        channel.create_channel(heartbeat_file(round_, rank))
        return {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "ROLE_RANK": str(rank),
            "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": "0",
            "ELASTIC_ROUND": str(round_),
            HEARTBEAT_ENV: str(heartbeat_file(round_, rank)),
        }

    def output(round_: int, rank: int, name: str):
        return open(heartbeat_file(round_, rank).with_name(name), "wb")

    def stepped_twice(round_: int) -> bool:
        return {r["rank"] for r in records(samples) if r["round"] == round_ and r["step"] >= 2} == {0, 1}

    def drained(round_: int) -> bool:
        return all(channel.read_drain(heartbeat_file(round_, r).read_bytes()).done == round_ + 1 for r in range(2))

    def wait_until(done, round_: int, what: str) -> None:
        deadline = time.monotonic() + 60
        while not done(round_):
            assert all(w.poll() is None for w in workers), f"a worker exited {what}; see {tmp_path}"
            assert time.monotonic() < deadline, f"timed out {what}; see {tmp_path}"
            time.sleep(0.02)

    tiny = ["--seq-len", "16", "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--corpus-chars", "6000"]
    command = [sys.executable, str(TRAIN), "--steps", "100000", "--global-batch", "4", *tiny]
    command += ["--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "100000", "--sample-log", str(samples)]
    port = free_port()
    workers: list[subprocess.Popen] = []
    usage: dict[int, list[tuple[int, int, int]]] = {}
    try:
        for rank, link in enumerate(links):
            env = dict(node_env, **round_env(0, rank, port), **{ROUND_FD_ENV: str(link.worker_fd)})
            with output(0, rank, "stdout") as out:
                workers.append(
                    subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, pass_fds=[link.worker_fd])
                )
            link.started()
        for round_ in range(rounds + 1):
            wait_until(stepped_twice, round_, f"before two steps in round {round_}")
            if round_ in (warm, rounds):
                usage[round_] = [process_usage(w.pid) for w in workers]
            if round_ == rounds:
                break
            for rank in range(2):  # a planned change: every worker checkpoints at a step boundary, and waits
                channel.request_drain(heartbeat_file(round_, rank), round_ + 1)
            wait_until(drained, round_, f"draining round {round_}")
            port = free_port()
            for rank, link in enumerate(links):
                env = dict(node_env, **round_env(round_ + 1, rank, port))
                with output(round_ + 1, rank, "stdout") as out, output(round_ + 1, rank, "stderr") as err:
                    assert link.offer(env, out.fileno(), err.fileno())
    finally:
        for worker in workers:
            worker.kill()
            worker.wait(timeout=30)
        for link in links:
            link.close()

    found = records(samples)
    assert {r["pid"] for r in found} == {w.pid for w in workers}, "every round in the same two processes"
    assert min(r["step"] for r in found if r["round"] == rounds) > rounds, "each round went on from the drain's step"
    for (fds, threads, rss), (fds_then, threads_then, rss_then) in zip(usage[rounds], usage[warm]):
        print(
            f"\nafter round {warm}: {fds_then} fds, {threads_then} threads, {rss_then} kB; after round {rounds}: "
            f"{fds} fds, {threads} threads, {rss} kB"
        )
        assert fds <= fds_then and threads <= threads_then, usage
        assert rss < 1.05 * rss_then, usage
