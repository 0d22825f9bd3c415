"""elastic-run end to end: real agents, real workers, a real etcd; nodes killed, stopped, added."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from launcher_harness import FAST_RDZV, PROBE_MISSED, REPO, Cluster, elastic_run_command, events, membership_changes

from elastic import channel
from launcher.etcd.server import free_port
from launcher.workers.process_tree import child_pids as children
from launcher.workers.process_tree import descendant_pids, is_running

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_unmodified_torchrun_script_gets_torchruns_environment(cluster, tmp_path, warm):
    """The same contract whether a worker starts in a pre-started interpreter or a new one: environment, argv,
    sys.path[0], __main__, __file__, exit code."""
    out = tmp_path / "env"
    out.mkdir()
    script = REPO / "tests" / "workers" / "env_dump.py"
    extra = [] if warm else ["--no-warm-workers"]
    agents = [
        cluster.start(
            f"node{i}", [str(out), "3"], nnodes="2", nproc=2, script=script, extra=extra, env={"OMP_NUM_THREADS": None}
        )
        for i in range(2)
    ]
    for agent in agents:
        assert agent.wait(timeout=90) == 1, cluster.dump()
    failures = cluster.events("worker_failed")
    assert failures and {e["exit_code"] for e in failures} == {3}, "the script's exit code is the worker's"

    records = {int(p.stem.removeprefix("rank")): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    assert sorted(records) == [0, 1, 2, 3]
    round_ = cluster.events("round_started")[0]
    for rank, env in records.items():
        member = next(m for m in round_["members"] if m["first_rank"] <= rank <= m["last_rank"])
        local_rank = rank - member["first_rank"]
        assert env["RANK"] == env["ROLE_RANK"] == str(rank)
        assert env["LOCAL_RANK"] == str(local_rank)
        assert env["GROUP_RANK"] == str(member["group_rank"])
        assert env["WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "4"
        assert env["LOCAL_WORLD_SIZE"] == "2" and env["GROUP_WORLD_SIZE"] == "2"
        assert env["ROLE_NAME"] == "default"
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0" and env["TORCHELASTIC_MAX_RESTARTS"] == "0"
        assert env["TORCHELASTIC_RUN_ID"] == "job"
        assert env["TORCHELASTIC_ERROR_FILE"] == str(
            tmp_path / member["node"] / member["node"] / "attempt_0" / str(local_rank) / "error.json"
        )
        assert env["OMP_NUM_THREADS"] == "1"
        assert env["ELASTIC_ROUND"] == "0"
        assert env["all_reduce"] == 4.0
        assert env["started_warm"] is warm
        assert env["argv"] == [str(script), str(out), "3"] and env["path0"] == str(script.parent)
        assert env["file"] == str(script) and env["name"] == "__main__" and env["main_is_this"]
    assert len({env["MASTER_PORT"] for env in records.values()}) == 1
    # group rank 0's zygote serves the store once it is ready (round 0 may start before), else rank 0 does
    assert len({env["TORCHELASTIC_USE_AGENT_STORE"] for env in records.values()}) == 1
    assert warm or records[0]["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    memory_dirs = {env["ELASTIC_MEMORY_DIR"] for env in records.values()}  # one per node, there while it ran
    assert len(memory_dirs) == 2 and all(env["memory_dir_is_dir"] for env in records.values())
    assert not any(Path(folder).exists() for folder in memory_dirs), "the agents free the snapshots' memory"


def test_worker_crash_restarts_every_node_in_a_fresh_round(cluster, tmp_path):
    probe = cluster.probe(8, 0.05, "--fail-rank", "1", "--fail-step", "2", "--fail-restarts", "1")
    agent = cluster.start("solo", probe, nproc=2, extra=["--max-restarts", "1"])
    assert agent.wait(timeout=90) == 0, cluster.dump()

    failed = events(agent, "worker_failed")
    assert [(e["rank"], e["local_rank"], e["exit_code"], e["round"]) for e in failed][:1] == [(1, 1, 1, 0)]
    assert "injected failure" in failed[0]["message"]
    assert [e["restart_count"] for e in events(agent, "restart")] == [1]
    rounds = events(agent, "round_started")
    assert [(r["round"], r["reason"], r["restart_count"]) for r in rounds] == [
        (0, "initial", 0),
        (1, "worker_failed", 1),
    ]
    assert [e["event"] for e in agent.membership()][-1] == "job_finished"

    finished = [c for c in cluster.collectives() if c["round"] == 1]
    assert {c["restarts"] for c in finished} == {1} and {c["rank"] for c in finished} == {0, 1}
    assert max(c["step"] for c in finished) == 7
    ports = {c["round"]: c["master_port"] for c in cluster.collectives()}
    assert ports[0] != ports[1], "a new round must rendezvous on a fresh store"

    # the membership log CLI shows the same events as the log file, as JSON and as a table
    log = [*elastic_run_command(), "log", "--rdzv-endpoint", cluster.endpoint, "--rdzv-id", "job"]
    as_json = subprocess.run([*log, "--json"], capture_output=True, text=True, timeout=30, check=True).stdout
    assert [json.loads(line) for line in as_json.splitlines()] == agent.membership()
    table = subprocess.run(log, capture_output=True, text=True, timeout=30, check=True).stdout
    assert table.splitlines()[0].split()[:4] == ["TIME", "ROUND", "EVENT", "NODE"]
    assert "worker_failed" in table and "exit_code=1" in table and "job_finished" in table

    # joining a finished job is not an error
    late = cluster.start("late", probe, nproc=1)
    assert late.wait(timeout=30) == 0
    assert "already finished" in late.text()


@pytest.mark.parametrize("victim_role", ["member", "controller"])
def test_sigkill_of_one_of_three_nodes_finishes_in_a_four_worker_round(cluster, victim_role):
    """The dead node's workers die with it and its peers' workers fail. A member's agent is found gone by the
    controller's liveness probe; the controller's own agent by the probe of a peer whose workers failed, which
    deposes it. Either way the node is lost at once, long before its lease (4 s here) would end."""
    probe = cluster.probe(60, 0.1)
    long_lease = FAST_RDZV.replace("keep_alive_max_attempt=3", "keep_alive_max_attempt=8")
    agents = {n: cluster.start(n, probe, nnodes="2:3", rdzv_conf=long_lease) for n in ("a", "b", "c")}
    cluster.wait_for_world(6, timeout=90)
    controller = cluster.controller()
    victim_id = controller if victim_role == "controller" else next(n for n in agents if n != controller)
    victim = agents.pop(victim_id)
    victim_workers = children(victim.pid)
    assert victim_workers, "the agent runs its workers as children"

    killed_at = time.time()
    os.kill(victim.pid, signal.SIGKILL)
    cluster.wait_for(lambda: not any(is_running(p) for p in victim_workers), 10, "the dead node's workers to die")
    again = cluster.wait_for_world(4, timeout=60, after=killed_at)
    cluster.stop_training()
    for agent in agents.values():
        assert agent.wait(timeout=90) == 0, cluster.dump()

    log = cluster.log()
    lost = [e for e in log if e["event"] == "node_lost"]
    deposed = [e for e in log if e["event"] == "controller_lost"]
    print(
        f"\nSIGKILL of the {victim_role}'s node: node_lost {lost[0]['time'] - killed_at:.2f}s after the kill "
        f"({lost[0]['reason']}), first collective at world 4 {again['time'] - killed_at:.2f}s after it"
    )
    assert [e["node"] for e in lost] == [victim_id]
    if victim_role == "member":
        assert lost[0]["reason"] == "liveness probe refused: the agent is gone" and not deposed
    else:
        assert [(e["node"], e["reason"]) for e in deposed] == [(victim_id, "liveness probe refused: the agent is gone")]
        assert deposed[0]["time"] <= lost[0]["time"], "deposed first: its lease was revoked, not left to expire"
    last_round = cluster.events("round_started")[-1]
    assert last_round["world_size"] == 4 and last_round["reason"] == "node_lost"
    assert sorted(m["node"] for m in last_round["members"]) == sorted(agents)
    assert not cluster.events("restart"), "losing a node is a membership change, not a counted restart"
    assert log[-1]["event"] == "job_finished"


# a lease of 10 s: a node found lost sooner was found by a probe
LONG_LEASE = FAST_RDZV.replace("keep_alive_interval=0.5", "keep_alive_interval=2").replace(
    "keep_alive_max_attempt=3", "keep_alive_max_attempt=5"
)


@pytest.mark.parametrize(
    "victim_role, long_operation",
    [("member", None), ("controller", None), ("member", "checkpoint save")],
    ids=["member", "controller", "member-inside-a-long-operation"],
)
def test_sigstop_of_one_of_three_nodes_finishes_in_a_four_worker_round(cluster, victim_role, long_operation):
    """A stopped host: its peers' workers block in all_reduce and nothing fails. Their agents report the stall, the
    controller probes the member that is not stalled, it does not answer, and it is lost long before its lease
    (10 s here) would end. A stopped controller probes nobody: the stalled members of the lowest group ranks probe
    it, and depose it when it does not answer. Workers blocked inside a long operation (as a checkpoint save's
    collectives are) are silent there by right, but idle: that is a stall too."""
    probe = cluster.probe(60, 0.1, *(["--long-operation", long_operation] if long_operation else []))
    agents = {n: cluster.start(n, probe, nnodes="2:3", rdzv_conf=LONG_LEASE) for n in ("a", "b", "c")}
    cluster.wait_for_world(6, timeout=90)
    cluster.wait_for(  # a stall is judged against the workers' own pace: they need a few steps to show it
        lambda: len({c["rank"] for c in cluster.collectives() if c["world_size"] == 6 and c["step"] >= 4}) == 6,
        30,
        "every rank to take 5 steps",
    )
    controller = cluster.controller()
    victim_id = controller if victim_role == "controller" else next(n for n in reversed(agents) if n != controller)
    victim = agents.pop(victim_id)
    hung = [victim.pid, *children(victim.pid)]

    stopped_at = time.time()
    for pid in hung:  # a hung host: its agent and its workers stop answering, survivors block in all_reduce
        os.kill(pid, signal.SIGSTOP)
    again = cluster.wait_for_world(4, timeout=60, after=stopped_at)
    cluster.stop_training()
    for agent in agents.values():
        assert agent.wait(timeout=90) == 0, cluster.dump()

    lost = cluster.events("node_lost")
    deposed = cluster.events("controller_lost")
    stalls = [e for e in cluster.events("workers_stalled") if e["time"] > stopped_at]
    print(
        f"\nSIGSTOP of the {victim_role}'s node: first workers_stalled {stalls[0]['time'] - stopped_at:.2f}s after "
        f"the stop, node_lost {lost[0]['time'] - stopped_at:.2f}s ({lost[0]['reason']}), first collective at "
        f"world 4 {again['time'] - stopped_at:.2f}s"
    )
    assert [e["node"] for e in lost] == [victim_id]
    if victim_role == "member":
        assert PROBE_MISSED.fullmatch(lost[0]["reason"]) and not deposed, lost
    else:
        assert [e["node"] for e in deposed] == [victim_id], deposed
        # the watcher probed its own agent with the controller's: it answered, so the controller had less
        assert PROBE_MISSED.match(deposed[0]["reason"]) and deposed[0]["reason"].endswith(" stall"), deposed
        # deposed on the watcher's own sight of its stall, which its report may reach etcd after
        assert stopped_at < deposed[0]["time"] <= lost[0]["time"]
    assert {e["node"] for e in stalls} <= set(agents) and stalls[0]["time"] < lost[0]["time"]
    assert lost[0]["time"] - stopped_at < 6, "found by the stall's probe, not when its 10 s lease ended"
    assert cluster.events("round_started")[-1]["world_size"] == 4
    assert not cluster.events("restart"), "a stall costs no restart"
    assert cluster.events("job_finished")


def start_three_for_a_crash(cluster, inprocess: bool, *probe_args: str) -> tuple[dict, dict]:
    """Agents a, b and c (probe workers, a 10 s lease, one restart for the crash to come), and the first
    collective of their world of 6."""
    probe = cluster.probe(60, 0.1, *(["--inprocess"] if inprocess else []), *probe_args)
    restarts = ["--max-restarts", "1"]
    agents = {n: cluster.start(n, probe, nnodes="2:3", rdzv_conf=LONG_LEASE, extra=restarts) for n in ("a", "b", "c")}
    return agents, cluster.wait_for_world(6, timeout=90)


def crash_then_stop_as_the_next_round_starts(
    cluster, agents: dict, full: dict, victim_id: str, in_long_operation: str | None = None
) -> tuple[float, dict]:
    """Crash a worker of a node other than `victim_id`, SIGSTOP the victim's whole tree as soon as its agent set up
    the next round (or, given `in_long_operation`, once its first worker is inside that long operation in it), let
    the others train in a world of 4 and finish (the victim leaves `agents`). Returns when the victim was stopped
    and the first collective at world 4."""
    crashed = next(n for n in agents if n != victim_id)
    victim = agents.pop(victim_id)
    rounds = victim.log_dir / victim_id

    def next_round_started() -> bool:
        attempts = {int(d.name.split("_")[1]): d for d in rounds.glob("attempt_*")}
        later = {number: d for number, d in attempts.items() if number > full["round"]}
        if in_long_operation is None or not later:
            return bool(later)
        heartbeat = later[min(later)] / "0" / "heartbeat"  # the round right after the crash
        raw = heartbeat.read_bytes() if heartbeat.is_file() else b""
        # the agent creates the file, then writes it (create_channel): for a moment it is empty
        found = channel.read(raw) if len(raw) == channel.SIZE else None
        return found is not None and found.long_op is not None and found.long_op.name == in_long_operation

    stopped: list[int] = []
    try:
        os.kill(children(agents[crashed].pid)[0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        # looked for every 2 ms: in process, its workers take the round about 0.1 s after its set-up
        while not next_round_started():
            assert time.monotonic() < deadline, f"{victim_id} set up no round after the crash\n{cluster.dump()}"
            time.sleep(0.002)
        stopped_at = time.time()
        stopped = [victim.pid, *descendant_pids(victim.pid)]
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        again = cluster.wait_for_world(4, timeout=60, after=stopped_at)
        cluster.stop_training()
        for agent in agents.values():
            assert agent.wait(timeout=90) == 0, cluster.dump()
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return stopped_at, again


@pytest.mark.parametrize("inprocess", [False, True], ids=["restarted", "in-process"])
def test_a_node_stopped_as_a_new_round_starts_is_found_by_its_peers_stall(cluster, inprocess):
    """A worker crashes, and as the new round starts (the victim's agent has set up the round's channels) a node is
    SIGSTOPped. The survivors' workers wait for its workers in the round's set-up, before any heartbeat in the
    round, where no step pace judges them: only the lease's end found it (2.4-3.1 s with a 3 s lease, 10 s here).
    A start-up that has waited idle for half a second is a stall: their agents report it, and the controller's
    probe finds the stopped node. In process the survivors re-enter within a tenth of a second, and on a loaded
    machine the stop often lands a step into the round, where a round 0 cut short left no pace to judge them by:
    there too half a second of idle waiting is a stall (it was left to the lease, and failed a CI run)."""
    agents, full = start_three_for_a_crash(cluster, inprocess)
    controller = cluster.controller()
    victim_id = next(n for n in reversed(agents) if n != controller)
    stopped_at, again = crash_then_stop_as_the_next_round_starts(cluster, agents, full, victim_id)

    lost = cluster.events("node_lost")
    assert [e["node"] for e in lost] == [victim_id] and PROBE_MISSED.fullmatch(lost[0]["reason"]), (
        f"{lost}\n{cluster.dump()}"
    )
    stalls = [e for e in cluster.events("workers_stalled") if stopped_at < e["time"] <= lost[0]["time"]]
    failed = [e for e in cluster.events("worker_failed") if stopped_at < e["time"] <= lost[0]["time"]]
    print(
        f"\nSIGSTOP as a round starts: node_lost {lost[0]['time'] - stopped_at:.2f}s after the stop, after "
        f"{len(stalls)} stall report(s) (last steps {[e.get('last_step') for e in stalls]}) and {len(failed)} "
        f"worker failure(s); first collective at world 4 {again['time'] - stopped_at:.2f}s"
    )
    # the survivors' stall, or, where one of their set-ups failed instead (a store connection reset), the roll
    # call that a failure starts: a probe either way, long before the 10 s lease
    assert {e["node"] for e in stalls + failed} <= set(agents) and (stalls or failed), (stalls, failed)
    assert lost[0]["time"] - stopped_at < 6, "found by a probe, not when its 10 s lease ended"


def test_a_node_stopped_in_the_rounds_checkpoint_load_is_found_by_its_peers_stall(cluster):
    """As a chaos run's scale-up: the survivors re-entered and began the round's checkpoint load, a long operation
    whose reads are gathered from every rank, and a node was SIGSTOPped there. Their workers, idle in the gather
    before their first heartbeat of the round, were held to the long operation's rule, which judges by a pace they
    had not shown yet: nothing was reported, and the lease's end found the stopped node (3.8 s in the chaos run,
    10 s here). Idle past the node's last pace, they are a stall, and the controller's probe finds it."""
    load = ["--startup-long-operation", "checkpoint load"]
    agents, full = start_three_for_a_crash(cluster, True, *load)
    # the survivors' nodes show a pace to judge the load by (a round of 3 steps or more)
    cluster.wait_for(lambda: max(e["step"] for e in cluster.collectives()) >= 4, 60, "5 steps at world 6")
    victim_id = next(n for n in reversed(agents) if n != cluster.controller())
    stopped_at, again = crash_then_stop_as_the_next_round_starts(cluster, agents, full, victim_id, "checkpoint load")

    lost = cluster.events("node_lost")
    assert [e["node"] for e in lost] == [victim_id] and PROBE_MISSED.fullmatch(lost[0]["reason"]), lost
    stalls = [e for e in cluster.events("workers_stalled") if stopped_at < e["time"] <= lost[0]["time"]]
    print(
        f"\nSIGSTOP in the round's load: stalls {[(e['node'], e['seconds_silent']) for e in stalls]}, node_lost "
        f"{lost[0]['time'] - stopped_at:.2f}s after the stop; first collective at world 4 "
        f"{again['time'] - stopped_at:.2f}s"
    )
    assert {e["node"] for e in stalls} <= set(agents) and stalls, "the survivors' load was reported stalled"
    assert lost[0]["time"] - stopped_at < 6, "found by a probe, not when its 10 s lease ended"


def test_the_rounds_store_host_stopped_as_a_round_starts_holds_its_peers_less_than_a_second(cluster):
    """A worker crashes, and as the new round starts its store's host (group rank 0's agent serves it) is
    SIGSTOPped. Its listen queue still accepts the survivors' connections, but nothing answers their handshake, and
    TCPStore's client retries until init_process_group's timeout (30 min): no abort ends that, so they waited out
    --inprocess-timeout (10 s). A worker whose set-up failed had also named its group already ("1", where a fresh
    peer builds "0"), so the round's re-entered and new workers never met, and a CI run timed out. Now a worker
    still connecting half a second after the abort leaves to be started anew, and the group count is reset."""
    agents, full = start_three_for_a_crash(cluster, inprocess=True)
    host = next(m["node"] for m in cluster.events("round_started")[-1]["members"] if m["group_rank"] == 0)
    stopped_at, again = crash_then_stop_as_the_next_round_starts(cluster, agents, full, host)

    outputs = "".join(agent.text() for agent in agents.values())
    left = outputs.count("could not unwind")
    print(
        f"\nstore host {host} stopped: {left} worker(s) left to be started anew; world 4 "
        f"{again['time'] - stopped_at:.2f}s"
    )
    assert "did not re-enter within" not in outputs, "no survivor waited out --inprocess-timeout"
    assert again["time"] - stopped_at < 8, "the survivors met long before --inprocess-timeout (10 s) would end a wait"


def test_node_added_mid_run_joins_a_six_worker_round(cluster):
    probe = cluster.probe(400, 0.1)
    first = [cluster.start(n, probe, nnodes="2:3") for n in ("a", "b")]
    cluster.wait_for_world(4, timeout=90)
    joiner = cluster.start("c", probe, nnodes="2:3")
    cluster.wait_for_world(6, timeout=60)

    log = cluster.wait_for(cluster.log, 5, "the membership log")
    cluster.wait_for(
        lambda: cluster.events("round_started")[-1:] and cluster.events("round_started")[-1]["world_size"] == 6,
        10,
        "the log to show the round",
    )
    joined = next(e for e in cluster.events("node_joined") if e["node"] == "c")
    grown = cluster.events("round_started")[-1]
    assert grown["reason"] == "scale_up"
    assert sorted(m["node"] for m in grown["members"]) == ["a", "b", "c"]
    # it forms within last_call_timeout (1 s here) of the join, plus the time to start the joiner's agent
    assert grown["time"] - joined["time"] < 1 + 3
    assert log and not cluster.events("restart")
    for agent in (*first, joiner):
        os.kill(agent.pid, signal.SIGTERM)
    for agent in (*first, joiner):
        agent.wait(timeout=30)


def test_spare_node_beyond_max_is_taken_in_when_a_member_is_lost(cluster):
    probe = cluster.probe(400, 0.1)
    agents = [cluster.start(n, probe, nnodes="1:2", nproc=1) for n in ("a", "b")]
    cluster.wait_for_world(2, timeout=90)
    spare = cluster.start("c", probe, nnodes="1:2", nproc=1)
    cluster.wait_for(lambda: any(e["node"] == "c" for e in cluster.events("node_joined")), 20, "c to join")
    # that no round forms for a node beyond MAX, however long it waits, is test_launcher_decisions'
    # test_scale_up_after_last_call_or_at_once_when_max_is_reached ("full: c is a spare")
    cluster.wait_for(lambda: "waiting as a spare" in spare.text(), 20, "c to wait as a spare")
    assert len(cluster.events("round_started")) == 1

    killed_at = time.time()
    os.kill(agents[1].pid, signal.SIGKILL)
    cluster.wait_for_world(2, timeout=60, after=killed_at + 0.5)
    cluster.wait_for(lambda: cluster.events("round_started")[-1]["round"] >= 1, 10, "the log to show round 1")
    last = cluster.events("round_started")[-1]
    assert sorted(m["node"] for m in last["members"]) == ["a", "c"]
    for agent in (agents[0], spare):
        os.kill(agent.pid, signal.SIGTERM)
        agent.wait(timeout=30)


def test_sigterm_to_an_agent_stops_its_workers_and_leaves_at_once(cluster):
    probe = cluster.probe(400, 0.1)
    agents = [cluster.start(n, probe, nnodes="2:3", nproc=1) for n in ("a", "b", "c")]
    cluster.wait_for_world(3, timeout=90)
    leaving = agents[2]
    workers = children(leaving.pid)

    os.kill(leaving.pid, signal.SIGTERM)
    assert leaving.wait(timeout=20) == 128 + signal.SIGTERM
    assert not any(is_running(p) for p in workers)
    cluster.wait_for_world(2, timeout=60)
    cluster.wait_for(lambda: cluster.events("node_left"), 10, "node_left in the log")
    assert [e["node"] for e in cluster.events("node_left")] == ["c"]
    assert not cluster.events("node_lost"), "a node that said goodbye is not 'lost'"
    assert cluster.events("round_started")[-1]["reason"] == "node_left"
    for agent in agents[:2]:
        os.kill(agent.pid, signal.SIGTERM)
        agent.wait(timeout=30)


def test_max_restarts_exhausted_fails_every_agent_with_the_root_cause(cluster):
    probe = cluster.probe(50, 0.05, "--fail-rank", "0", "--fail-step", "1", "--fail-restarts", "99")
    agents = [cluster.start(n, probe, nnodes="2", nproc=1, extra=["--max-restarts", "1"]) for n in ("a", "b")]
    codes = [agent.wait(timeout=120) for agent in agents]
    assert all(code != 0 for code in codes), cluster.dump()

    failed = cluster.events("job_failed")
    assert len(failed) == 1
    cause = failed[0]
    assert (cause["rank"], cause["exit_code"]) == (0, 1)
    rank0_node = next(m["node"] for m in cluster.events("round_started")[-1]["members"] if m["first_rank"] == 0)
    assert cause["node"] == rank0_node
    assert len(cluster.events("restart")) == 1
    for agent in agents:
        text = agent.text()
        assert "root cause node" in text and "rank 0" in text and "exit code 1" in text, text[-2000:]
        assert "injected failure at step 1 on rank 0" in text  # the traceback from the worker's error file


def test_two_jobs_on_one_etcd_do_not_see_each_other(cluster, tmp_path):
    jobs = {}
    for job in ("alpha", "beta"):
        log = tmp_path / f"{job}.jsonl"
        jobs[job] = cluster.start(
            f"{job}-node", ["--steps", "5", "--step-time", "0.05", "--log", str(log)], rdzv_id=job, nproc=1
        )
    for agent in jobs.values():
        assert agent.wait(timeout=90) == 0, cluster.dump()
    for job, agent in jobs.items():
        assert {e.get("node") for e in agent.membership()} - {None} == {f"{job}-node"}
        assert [e["world_size"] for e in events(agent, "round_started")] == [1]


def test_agents_ride_out_an_etcd_restart(cluster, etcd):
    # a lease of 10 s: an agent fences itself only when etcd has been silent for most of its lease
    agent = cluster.start(
        "solo",
        cluster.probe(100, 0.1),
        nproc=2,
        rdzv_conf="keep_alive_interval=0.5,keep_alive_max_attempt=20,last_call_timeout=1",
    )
    cluster.wait_for_world(2, timeout=90)
    etcd.process.kill()
    etcd.process.wait()
    # etcd stays away until the agent has missed it for several keep-alive intervals and said so; the leases
    # are extended when it comes back
    cluster.wait_for(lambda: "workers keep running" in agent.text(), 20, "the agent to warn that etcd is away")
    etcd.start()
    assert agent.wait(timeout=90) == 0, cluster.dump()
    assert len(events(agent, "round_started")) == 1
    assert not events(agent, "node_lost")


def test_endpoint_list_fails_over_to_a_live_etcd_member(etcd, tmp_path):
    dead = f"127.0.0.1:{free_port()}"
    nodes = Cluster(f"{dead},{etcd.endpoint}", tmp_path)
    try:
        agent = nodes.start("solo", nodes.probe(5, 0.05), nproc=1)
        assert agent.wait(timeout=90) == 0, nodes.dump()
        assert events(agent, "job_finished")
    finally:
        nodes.close()


def test_too_few_nodes_for_join_timeout_fails_the_job(cluster):
    agent = cluster.start(
        "lonely", cluster.probe(5, 0.05), nnodes="2", nproc=1, rdzv_conf="keep_alive_interval=0.5,join_timeout=3"
    )
    assert agent.wait(timeout=60) == 1, cluster.dump()
    failed = events(agent, "job_failed")
    assert len(failed) == 1 and "1 of at least 2 node(s) joined within join_timeout=3s" in failed[0]["message"]
    assert "rendezvous timed out" in agent.text()


def test_redirects_and_tee_split_worker_output_like_torchrun(cluster):
    agent = cluster.start("solo", cluster.probe(2, 0.01), nproc=2, extra=["--redirects", "3", "--tee", "0:2"])
    assert agent.wait(timeout=60) == 0, cluster.dump()
    attempt = agent.log_dir / "solo" / "attempt_0"
    for local_rank in (0, 1):
        assert f"rank {local_rank}/2 done" in (attempt / str(local_rank) / "stderr.log").read_text()
    console = agent.text()
    assert "[default0]:rank 0/2 done" in console  # rank 0's stderr is tee'd with torchrun's prefix
    assert "rank 1/2 done" not in console  # rank 1's only goes to its file


def test_log_follow_prints_events_as_they_arrive_and_stops_at_the_end(cluster):
    follow = subprocess.Popen(
        [
            *elastic_run_command(),
            "log",
            "--rdzv-endpoint",
            cluster.endpoint,
            "--rdzv-id",
            "job",
            "--json",
            "--follow",
            "--interval",
            "0.2",
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        agent = cluster.start("solo", cluster.probe(10, 0.1), nproc=1)
        assert agent.wait(timeout=60) == 0, cluster.dump()
        output, _ = follow.communicate(timeout=30)
    finally:
        if follow.poll() is None:
            os.killpg(follow.pid, signal.SIGKILL)
            follow.wait()
    followed = [json.loads(line) for line in output.splitlines()]
    assert [e["event"] for e in membership_changes(followed)] == ["node_joined", "round_started", "job_finished"]
    assert followed == agent.membership()
