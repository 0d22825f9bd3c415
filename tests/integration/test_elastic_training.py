"""The three parts together: examples/train.py under elastic-run loses a node and finishes in a smaller world."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time

import pytest
from launcher_harness import FAST_RDZV, PROBE_MISSED, REPO, events, resume

from elastic.checkpoint.layout import scan
from launcher.workers.process_tree import child_pids, descendant_pids, is_running

pytestmark = pytest.mark.slow

TINY = ["--seq-len", "16", "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--corpus-chars", "6000"]


def train_args(samples, ckpt, steps: int, global_batch: int, ckpt_every: int, memory_every: int) -> list[str]:
    """examples/train.py's flags for a tiny model in micro-batches of 2, logging every rank's samples."""
    return [
        "--steps",
        str(steps),
        "--global-batch",
        str(global_batch),
        "--micro-batch",
        "2",
        "--ckpt-dir",
        str(ckpt),
        "--ckpt-every",
        str(ckpt_every),
        "--memory-every",
        str(memory_every),
        "--sample-log",
        str(samples),
        *TINY,
    ]


def committed_history(sample_log) -> dict[int, list[dict]]:
    """step -> the records of the last round that ran it: what the final model was trained on."""
    by_step: dict[int, list[dict]] = {}
    for record in (json.loads(line) for line in sample_log.read_text().splitlines()):
        kept = by_step.setdefault(record["step"], [])
        if kept and record["round"] > kept[0]["round"]:
            kept.clear()
        if not kept or record["round"] == kept[0]["round"]:
            kept.append(record)
    return by_step


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("memory_every", "ckpt_every"), [(0, 8), (1, 50)], ids=["disk only", "memory every step"])
def test_training_survives_a_lost_node_using_every_sample_once(cluster, tmp_path, memory_every, ckpt_every):
    """Disk only: commits at steps 8, 16, 24; the kill comes once step 10 ran at 3 ranks and (disk only) the save of
    step 8 is committed, which on a loaded machine can take several steps: the new round resumes from step 8, and
    the steps after it are redone (polled every 0.02 s, so that the commit at 16 does not come first: 5 more steps
    ran under cluster.wait_for's 0.2 s poll in one run; in another the kill came before step 8 was committed, and
    every step was redone at 2 ranks). With a snapshot in memory
    every step and no disk commit after step 0, the survivors load the newest snapshot (the lost node's part from
    its copy on a survivor) and redo at most the step the kill interrupted."""
    samples = tmp_path / "samples.jsonl"
    steps, global_batch = 30, 6
    args = train_args(samples, tmp_path / "ckpt", steps, global_batch, ckpt_every, memory_every)
    # round 0 forms once all three joined, however slowly a loaded machine starts the third agent
    all_three = FAST_RDZV.replace("last_call_timeout=1", "last_call_timeout=60")
    agents = [
        cluster.start(n, args, nnodes="2:3", nproc=1, rdzv_conf=all_three, script=REPO / "examples" / "train.py")
        for n in "abc"
    ]

    def time_to_kill() -> bool:
        ran = samples.is_file() and '"step": 10,' in samples.read_text()
        return ran and (memory_every > 0 or ckpt_every in committed_steps(tmp_path / "ckpt"))

    deadline = time.monotonic() + 120
    while not time_to_kill():
        assert time.monotonic() < deadline, "timed out waiting for step 10 at 3 ranks\n" + cluster.dump()
        time.sleep(0.02)
    killed_at = time.time()
    os.kill(agents[2].pid, signal.SIGKILL)
    for agent in agents[:2]:
        assert agent.wait(timeout=150) == 0, cluster.dump()

    history = committed_history(samples)
    assert sorted(history) == list(range(1, steps + 1))
    worlds = [history[s][0]["world_size"] for s in sorted(history)]
    assert worlds[0] == 3 and worlds[-1] == 2, worlds
    used = [i for records in history.values() for r in records for i in r["samples"]]
    assert len(used) == steps * global_batch and len(set(used)) == len(used), "every sample once, none skipped"

    all_records = [json.loads(line) for line in samples.read_text().splitlines()]
    redone = {r["step"] for r in all_records if r["round"] == 0} & {r["step"] for r in all_records if r["round"] > 0}
    print(f"\nsteps redone after the kill: {sorted(redone)}")
    if memory_every:
        assert len(redone) <= 1, f"steps {sorted(redone)} redone after loading the newest snapshot in memory"
    else:
        assert redone, "steps after the last commit are redone in the new round"
    for step in redone:
        # the killed rank may die before logging the step it was on, so round 0 can hold part of the batch only
        first = {i for r in all_records if r["step"] == step and r["round"] == 0 for i in r["samples"]}
        final = {i for r in history[step] for i in r["samples"]}
        assert first and first <= final and len(final) == global_batch, f"step {step} was redone on other samples"
        assert {r["lr"] for r in all_records if r["step"] == step} == {history[step][0]["lr"]}

    log = agents[0].membership()
    assert [e["node"] for e in log if e["event"] == "node_lost"] == ["c"]
    assert events(agents[0], "round_started")[-1]["world_size"] == 2
    assert log[-1]["event"] == "job_finished" and log[-1]["time"] > killed_at


def committed_steps(directory, rounds_up_to: int | None = None) -> list[int]:
    """The steps of the committed checkpoints in `directory`, oldest first; only those saved by a round up to
    `rounds_up_to` when given."""
    if not directory.is_dir():
        return []
    entries = [entry for entry in scan(directory) if entry.committed]
    return [e.step for e in entries if rounds_up_to is None or (e.record.round or 0) <= rounds_up_to]


def logged(sample_log) -> list[dict]:
    return [json.loads(line) for line in sample_log.read_text().splitlines()] if sample_log.is_file() else []


@pytest.mark.timeout(300)
def test_a_node_paused_past_the_probe_timeout_is_fenced_rejoins_and_nothing_committed_is_lost(cluster, tmp_path):
    """A false suspicion while training (issue #9): a node, agent and workers, is paused for 5 s, shorter than its
    lease (8 s) but past probe_timeout (0.5 s), while the worker of another node crashes. The controller probes the
    paused node, gets no answer and revokes its lease, and the other two go on without it from the newest snapshot
    in memory. Once resumed, it finds its lease gone, kills its old workers and rejoins as a newcomer; the others
    drain (a disk commit) and train on at 3 ranks, until every agent is told to stop and the job drains to disk.
    Nothing committed is lost: every step and sample once in the final history, at most the interrupted step redone
    (a snapshot in memory every step) and none at the planned scale-up, no step that a disk checkpoint committed
    before the fault holds trained again, and those checkpoints deleted only by retention (keep=3 newer commits).

    The pause comes two steps after a disk-checkpoint step, once a commit after step 0 exists, so that the fault
    round has committed checkpoints to lose."""
    samples, ckpt = tmp_path / "samples.jsonl", tmp_path / "ckpt"
    # steps: far more than the run gets to, it ends by the signals; keep: what examples/train.py gives
    # CheckpointManager
    steps, global_batch, ckpt_every, keep = 300, 6, 5, 3
    args = [
        *train_args(samples, ckpt, steps, global_batch, ckpt_every, memory_every=1),
        "--corpus-chars",
        "30000",  # 1,874 sequences of 16 characters: the 1,800 samples the job could take all differ
    ]
    long_lease = "keep_alive_interval=0.5,keep_alive_max_attempt=16,last_call_timeout=1,join_timeout=60"
    agents = [
        cluster.start(
            n,
            args,
            nnodes="2:3",
            nproc=1,
            script=REPO / "examples" / "train.py",
            rdzv_conf=long_lease,
            extra=["--max-restarts", "3"],
        )
        for n in "abc"
    ]
    cluster.wait_for(lambda: logged(samples), 120, "the first step")
    # neither the paused node nor the crashing one may be the controller: it must decide meanwhile
    controller = cluster.controller()
    victim, crashing = [agent for agent in agents if agent.node_id != controller][:2]

    def time_to_pause() -> bool:
        """All 3 ranks logged step 2 after a disk-checkpoint step, once some disk checkpoint after step 0 is
        committed (polled faster than cluster.wait_for, so the pause comes before the next disk step)."""
        done = [r["step"] for r in logged(samples) if r["world_size"] == 3]
        ready = [s for s in set(done) if done.count(s) == 3 and s % ckpt_every == 2 and s > ckpt_every]
        return bool(ready) and any(s >= ckpt_every for s in committed_steps(ckpt))

    deadline = time.monotonic() + 120
    while not time_to_pause():
        assert time.monotonic() < deadline, "timed out waiting for a disk commit and step 7 or later\n" + cluster.dump()
        time.sleep(0.02)
    os.kill(victim.pid, signal.SIGSTOP)  # the agent first, so that it starts nothing while its tree is paused
    paused = [victim.pid, *descendant_pids(victim.pid)]
    for pid in paused[1:]:
        os.kill(pid, signal.SIGSTOP)
    crashed_at = time.time()
    try:
        old_workers = child_pids(victim.pid)
        committed_before = committed_steps(ckpt)
        before = logged(samples)
        fault_round, fault_step = max(r["round"] for r in before), max(r["step"] for r in before)
        os.kill(child_pids(crashing.pid)[0], signal.SIGKILL)
        lost = cluster.wait_for(lambda: cluster.events("node_lost"), 10, f"{victim.node_id} lost on its probe")
        cluster.wait_for(
            lambda: [
                e
                for e in cluster.events("round_started")
                if e["time"] > crashed_at and victim.node_id not in {m["node"] for m in e["members"]}
            ],
            30,
            f"a round without {victim.node_id}",
        )
    finally:
        resume(paused)
    assert old_workers and committed_before and committed_before[-1] >= ckpt_every
    assert [e["node"] for e in lost] == [victim.node_id] and PROBE_MISSED.fullmatch(lost[0]["reason"]), lost
    assert lost[0]["time"] - crashed_at < 4, "before the lease could have ended"
    cluster.wait_for(lambda: not any(is_running(p) for p in old_workers), 10, "the paused node's old workers to go")
    cluster.wait_for(lambda: any(r["round"] > fault_round for r in logged(samples)), 120, "a step after the fault")
    # what the old round committed, up to its end (rank 0 may have committed a save in flight after the pause)
    old_commits = sorted({*committed_before, *committed_steps(ckpt, rounds_up_to=fault_round)})
    now = committed_steps(ckpt)
    for step in committed_before:
        assert step in now or len([s for s in now if s > step]) >= keep, f"step-{step} gone after the fault: {now}"
    cluster.wait_for(
        lambda: any(r["round"] > fault_round and r["world_size"] == 3 for r in logged(samples)),
        120,
        f"a step at 3 ranks with {victim.node_id} back",
    )
    cluster.stop_all(agents, timeout=120)
    assert not cluster.events("job_failed")
    rejoined = [e for e in cluster.events("node_joined") if e["node"] == victim.node_id]
    assert len(rejoined) == 2, "it came back as a newcomer"
    assert "rejoining as a newcomer" in victim.text()
    reasons = {e["round"]: e["reason"] for e in cluster.events("round_started")}
    assert cluster.events("round_started")[-1]["world_size"] == 3

    records = logged(samples)
    after = [r for r in records if r["round"] > fault_round]
    resumed_from = min(r["step"] for r in after) - 1
    redone = sorted({r["step"] for r in records if r["round"] <= fault_round} & {r["step"] for r in after})
    trained = {n: {r["step"] for r in records if r["round"] == n} for n in sorted({r["round"] for r in after})}
    earlier = {n: {r["step"] for r in after if r["round"] < n} for n in trained}  # by the rounds since the fault
    planned = {n: sorted(s & earlier[n]) for n, s in trained.items() if reasons[n] == "scale_up"}
    final = committed_steps(ckpt)
    rounds: dict[tuple[int, int], set[int]] = {}
    for r in records:
        rounds.setdefault((r["round"], r["world_size"]), set()).add(r["step"])
    loads = [
        f"{agent.node_id}: {line}"
        for agent in agents
        for line in agent.text().splitlines()
        if "INFO train: round" in line or " loaded " in line or "could not" in line
    ]
    print(
        f"\n{victim.node_id} paused after step {fault_step} (commits then: {committed_before}, the old round's in "
        f"all: {old_commits}); the next round resumed from step {resumed_from}; steps redone: {redone}; commits at "
        f"the end: {final}; rounds (number, world size: steps): "
        + ", ".join(f"{n}, {w}: {min(s)}-{max(s)}" for (n, w), s in sorted(rounds.items()))
    )
    history = committed_history(samples)
    last_step = max(history)
    assert sorted(history) == list(range(1, last_step + 1))
    worlds = [history[s][0]["world_size"] for s in sorted(history)]
    assert worlds[0] == 3 and worlds[-1] == 3, worlds
    used = [i for kept in history.values() for r in kept for i in r["samples"]]
    assert len(used) == last_step * global_batch and len(set(used)) == len(used), "every sample once, none skipped"

    assert resumed_from >= old_commits[-1], "a step committed before the fault was trained again:\n" + "\n".join(loads)
    assert len(redone) <= 1, f"steps {redone} redone after the fault; where each round started:\n" + "\n".join(loads)
    assert planned and not any(planned.values()), f"steps redone after the drain: {planned}\n" + "\n".join(loads)
    for step in redone:
        first = {i for r in records if r["step"] == step and r["round"] <= fault_round for i in r["samples"]}
        assert first <= {i for r in history[step] for i in r["samples"]}, f"step {step} was redone on other samples"
        assert {r["lr"] for r in records if r["step"] == step} == {history[step][0]["lr"]}
    assert final[-1] == last_step, f"last step trained {last_step}, newest on disk {final}"
    for step in committed_before:
        assert step in final or len([s for s in final if s > step]) >= keep, f"step-{step} deleted, not by retention"


@pytest.mark.timeout(180)
def test_a_job_whose_node_memory_is_too_small_for_a_snapshot_trains_on_to_disk(tmp_path):
    """The job a user starts in a container with its default 64 MB /dev/shm and a real model; here /dev/shm is
    256 KB (in a mount namespace of the job's own) and the tiny model's snapshot is larger. Every worker died of
    SIGBUS at its first snapshot, in every round, until the job failed. Now the job trains to the end in round 0,
    on disk checkpoints, having said once why snapshots in memory are off and how to give them room."""
    ckpt = tmp_path / "ckpt"
    command = (
        "mount -t tmpfs -o size=256k tmpfs /dev/shm && exec elastic-run --standalone --nproc-per-node 2 "
        f"--log-dir {tmp_path / 'logs'} {REPO / 'examples' / 'train.py'} --steps 12 --ckpt-dir {ckpt} --ckpt-every 6 "
        "--d-model 128"
    )
    if os.geteuid() != 0:
        pytest.skip("a mount namespace needs root")
    job = subprocess.Popen(
        ["unshare", "--mount", "sh", "-c", command],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        output, _ = job.communicate(timeout=150)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, output[-3000:]
    assert "Bus error" not in output
    assert output.count("snapshots in memory are off") == 1, output[-3000:]
    assert "round 1" not in output
    assert [entry.step for entry in scan(ckpt) if entry.committed] == [0, 6, 12]
