"""The etcd rendezvous end to end: re-registration, foreign values, slow leaves, etcd outages, purge, bounded state.

Real etcd servers, real `elastic-run` agents and real gloo workers, as in test_launcher_scenarios.py; the test
itself plays the other actors (an operator revoking a lease, a foreign tool writing under the job's prefix).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time

import pytest
from launcher_harness import FAST_RDZV, REPO, elastic_run_command, events, membership_changes

from launcher.etcd import client as etcd_client
from launcher.rendezvous.protocol import JobKeys, JobStore
from launcher.rendezvous.records import NodeRecord, RoundHeader
from launcher.workers.process_tree import child_pids as children
from launcher.workers.process_tree import is_running

pytestmark = pytest.mark.slow

KEYS = JobKeys("job")
SLOW_SIGTERM = REPO / "tests" / "workers" / "slow_sigterm.py"


@contextlib.contextmanager
def etcd_session(endpoint: str):
    client = etcd_client.connect(endpoint)
    try:
        yield client
    finally:
        client.close()


def keys_under(client, prefix: str) -> dict[str, bytes]:
    return {meta.key.decode(): value for value, meta in client.get_prefix(prefix)}


def controller_node(client, keys: JobKeys = KEYS) -> str | None:
    """The node id in `state/ctl/controller` (`<node>#<lease hex>`), None while nobody holds it."""
    raw, _ = client.get(keys.controller)
    return raw.decode().split("#", 1)[0] if raw is not None else None


def node_record(client, node: str, keys: JobKeys = KEYS) -> NodeRecord | None:
    raw, _ = client.get(keys.node(node))
    return NodeRecord.loads(raw) if raw is not None else None


def read_jsonl(path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- 1. a revoked lease: the same node id comes back as a newcomer ---------------------------------------------
@pytest.mark.timeout(180)
@pytest.mark.parametrize("victim_is_controller", [False, True], ids=["member", "controller"])
def test_revoked_lease_reregisters_under_the_same_node_id_in_a_new_round(cluster, victim_is_controller):
    probe = cluster.probe(50, 0.1)
    agents = {
        n: cluster.start(n, probe, nnodes="2", nproc=1, extra=["--max-restarts", "0"]) for n in ("node0", "node1")
    }
    cluster.wait_for_world(2, timeout=60)

    with etcd_session(cluster.endpoint) as client:
        controller = cluster.wait_for(lambda: controller_node(client), 10, "a controller")
        victim = controller if victim_is_controller else next(n for n in agents if n != controller)
        old = node_record(client, victim)
        old_workers = children(agents[victim].pid)
        assert old is not None and old_workers

        client.revoke_lease(old.lease)

        def registered_again():
            record = node_record(client, victim)
            return record if record is not None and record.lease != old.lease else None

        new = cluster.wait_for(registered_again, 15, f"{victim} to register again under a new lease")
        assert (new.node, new.pid) == (victim, agents[victim].pid), "the same agent, not a new one"
        cluster.wait_for(lambda: not any(is_running(p) for p in old_workers), 15, "the revoked node's workers to stop")
        cluster.wait_for(
            lambda: [c for c in cluster.collectives() if c["round"] >= 1 and c["world_size"] == 2],
            60,
            "a collective of the new round",
        )
        cluster.stop_training()
        for agent in agents.values():
            assert agent.wait(timeout=90) == 0, cluster.dump()
        header = RoundHeader.loads(client.get(KEYS.round)[0])
        store = JobStore(client, "job")
        # the last round holds the new incarnation of the victim, not the revoked one
        assert store.read_member(header, victim, new.lease) is not None
        assert store.read_member(header, victim, old.lease) is None

    log = agents["node0"].membership()
    assert agents["node1"].membership() == log, "every agent mirrors the same log"
    lost = [e for e in log if e["event"] == "node_lost"]
    assert [(e["node"], e["round"]) for e in lost] == [(victim, 0)], log
    rounds = [e for e in log if e["event"] == "round_started"]
    assert [(r["round"], r["reason"]) for r in rounds] == [(0, "initial"), (1, "node_lost")], log
    assert rounds[1]["revision"] > lost[0]["revision"]
    assert sorted(m["node"] for m in rounds[1]["members"]) == ["node0", "node1"]
    assert rounds[1]["restart_count"] == 0 and not events(agents["node0"], "restart"), "a loss is not a restart"
    assert [e["node"] for e in log if e["event"] == "node_joined"].count(victim) == 2, "it joined again"
    assert log[-1]["event"] == "job_finished"
    assert "lost its membership" in agents[victim].text()


# -- 2. a foreign or damaged value under the job's prefix ------------------------------------------------------
@pytest.mark.timeout(180)
def test_malformed_values_under_the_prefix_are_named_once_and_ignored(cluster):
    probe = cluster.probe(40, 0.1)
    agents = {n: cluster.start(n, probe, nnodes="2", nproc=1) for n in ("a", "b")}
    cluster.wait_for_world(2, timeout=60)
    bogus_node, bogus_master = KEYS.node("bogus"), KEYS.master(99)
    assert (bogus_node, bogus_master) == ("/elastic/job/state/nodes/bogus", "/elastic/job/state/ctl/master/0000000099")

    with etcd_session(cluster.endpoint) as client:
        controller = controller_node(client)
        planted_at = time.time()
        client.put(bogus_node, "not json")
        client.put(bogus_master, '{"broken": 1}')
        for agent in agents.values():
            assert agent.wait(timeout=90) == 0, cluster.dump()
    assert cluster.collectives()[-1]["time"] > planted_at, "the job trained on after the values were planted"

    def warnings(agent, key: str) -> int:
        return agent.text().count(f"ignoring malformed value under the job's prefix at {key} (")

    for name, agent in agents.items():
        # the controller watches all of state/, the other agents only state/ctl/
        assert warnings(agent, bogus_node) == (1 if name == controller else 0), agent.text()
        assert warnings(agent, bogus_master) >= 1, agent.text()
        assert "unreachable" not in agent.text()
        assert events(agent, "job_finished")
    for agent in agents.values():
        # once per process, though the controller's process parses state/ctl/ twice (its agent and its controller)
        assert warnings(agent, bogus_master) == 1, agent.text()


# -- 3. SIGTERM: the workers get their whole grace, the node leaves, nobody is "lost" --------------------------
@pytest.mark.timeout(180)
def test_sigterm_waits_for_slow_workers_and_leaves_without_a_loss(cluster, tmp_path):
    worker_log = tmp_path / "slow.jsonl"
    # the survivors block while the leaver runs its handler: every step but the first few comes at 2 ranks
    args = ["--steps", "30", "--step-time", "0.1", "--sigterm-sleep", "4", "--log", str(worker_log)]
    agents = {
        n: cluster.start(
            n,
            args,
            nnodes="2:3",
            nproc=1,
            script=SLOW_SIGTERM,
            env={"ELASTIC_TEST_NODE": n},
            extra=["--worker-stop-timeout", "10"],
        )
        for n in ("a", "b", "c")
    }

    def collective_in(world_size: int, after: float = 0.0):
        return next(
            (
                e
                for e in read_jsonl(worker_log)
                if e["event"] == "collective" and e["world_size"] == world_size and e["time"] > after
            ),
            None,
        )

    cluster.wait_for(lambda: collective_in(3), 90, "a collective in a world of 3")
    with etcd_session(cluster.endpoint) as client:
        controller = controller_node(client)
        name = next(n for n in ("c", "b", "a") if n != controller)
        leaving = agents[name]
        workers = children(leaving.pid)

        sent_at = time.time()
        os.kill(leaving.pid, signal.SIGTERM)
        assert leaving.wait(timeout=30) == 128 + signal.SIGTERM, cluster.dump()
        assert not any(is_running(p) for p in workers)
        cluster.wait_for(lambda: collective_in(2, after=sent_at), 60, "a collective in a world of 2")
        for other in agents.values():
            if other is not leaving:
                assert other.wait(timeout=90) == 0, cluster.dump()
        assert not keys_under(client, KEYS.left_prefix), "every leave notice is gone once the job is over"

    # the worker got SIGTERM (not SIGKILL) and the whole 4 s of its handler. An earlier worker of the node may have
    # had its own (a round that formed before the third node registered ends with a graceful stop of its workers)
    mine = [e for e in read_jsonl(worker_log) if e["pid"] in workers and e["event"] != "collective"]
    assert [e["event"] for e in mine] == ["sigterm", "sigterm_done"], mine
    assert mine[1]["time"] - mine[0]["time"] >= 3.9
    assert mine[0]["time"] >= sent_at

    log = agents[controller].membership()
    left = [e for e in log if e["event"] == "node_left"]
    assert [e["node"] for e in left] == [name], log
    assert not [e for e in log if e["event"] == "node_lost"], "a node that said goodbye is not 'lost'"
    after_leave = [e for e in log if e["event"] == "round_started" and e["revision"] > left[0]["revision"]]
    assert after_leave and after_leave[0]["reason"] == "node_left", log
    assert after_leave[0]["time"] > left[0]["time"] and after_leave[0]["revision"] > left[0]["revision"]
    assert left[0]["time"] >= mine[1]["time"], "node_left is logged once the workers have exited"
    assert sorted(m["node"] for m in after_leave[-1]["members"]) == sorted(n for n in agents if n != name)
    assert not [e for e in log if e["event"] == "restart"], "the survivors' failed collectives are not charged"
    assert log[-1]["event"] == "job_finished"
    assert "could not leave the membership cleanly" not in leaving.text()
    assert "could not announce leaving" not in leaving.text()


# -- 4. etcd away for longer than a keep-alive interval: the workers never notice ----------------------------
# A lease of 10 s (0.5 s x 20): an agent that etcd has not answered for most of its lease fences itself (kills
# its workers and rejoins), so the outages below are several keep-alive intervals long but well inside the lease,
# even on a loaded machine.
LONG_LEASE_RDZV = "keep_alive_interval=0.5,keep_alive_max_attempt=20,last_call_timeout=1,join_timeout=60"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("outage", ["restart", "pause"])
def test_workers_train_through_an_etcd_outage_without_a_restart(cluster, etcd, outage):
    agent = cluster.start("solo", cluster.probe(80, 0.1), nproc=2, rdzv_conf=LONG_LEASE_RDZV)
    cluster.wait_for_world(2, timeout=60)
    workers = sorted(children(agent.pid))
    assert len(workers) == 2

    down_at = time.time()
    if outage == "restart":  # etcd process gone; the same data dir and ports when it comes back
        etcd.process.kill()
        etcd.process.wait()
        time.sleep(1.5)
        etcd.start()
    else:  # a hung etcd: connections open, nothing answered
        os.kill(etcd.process.pid, signal.SIGSTOP)
        try:
            time.sleep(2.0)
        finally:
            os.kill(etcd.process.pid, signal.SIGCONT)
    up_at = time.time()
    outage_s = up_at - down_at
    assert outage_s > 3 * 0.5, "several keep-alive intervals without etcd"
    assert sorted(children(agent.pid)) == workers, f"new worker processes after {outage_s:.1f}s\n{cluster.dump()}"
    assert agent.wait(timeout=90) == 0, cluster.dump()

    collectives = cluster.collectives()
    assert {c["round"] for c in collectives} == {0}, "no new round"
    assert {c["restarts"] for c in collectives} == {0}
    for rank in (0, 1):
        mine = [c for c in collectives if c["rank"] == rank]
        assert len({c["pid"] for c in mine}) == 1, f"rank {rank} ran in one process: {sorted({c['pid'] for c in mine})}"
        assert [c["step"] for c in mine] == list(range(80)), "every step once: nothing was redone"
    assert {c["pid"] for c in collectives} == set(workers)
    assert any(down_at < c["time"] < up_at for c in collectives), "the workers trained while etcd was away"

    log = agent.membership()
    assert [(e["event"], e.get("round")) for e in membership_changes(log)] == [
        ("node_joined", None),
        ("round_started", 0),
        ("job_finished", 0),
    ], log
    progress = [e["step"] for e in log if e["event"] == "training_progress"]
    assert progress and progress == sorted(progress) and progress[-1] < 80, log
    assert "killing the workers" not in agent.text() and "lost its membership" not in agent.text()


# -- 5. elastic-run purge ------------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_purge_refuses_a_running_job_then_deletes_exactly_the_finished_jobs_keys(cluster, tmp_path):
    def purge(job: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*elastic_run_command(), "purge", "--rdzv-endpoint", cluster.endpoint, "--rdzv-id", job],
            capture_output=True,
            text=True,
            timeout=60,
        )

    # another job whose id shares the string prefix "job": /elastic/job2/ must survive a purge of /elastic/job/
    neighbour = cluster.start(
        "n", ["--steps", "3", "--step-time", "0.01", "--log", str(tmp_path / "job2.jsonl")], rdzv_id="job2", nproc=1
    )
    assert neighbour.wait(timeout=60) == 0, cluster.dump()
    agent = cluster.start("solo", cluster.probe(40, 0.1), nproc=1)
    cluster.wait_for_world(1, timeout=60)

    with etcd_session(cluster.endpoint) as client:
        neighbour_keys = keys_under(client, JobKeys("job2").prefix)
        assert neighbour_keys
        before = keys_under(client, KEYS.prefix)
        refused = purge("job")
        after = keys_under(client, KEYS.prefix)
        assert refused.returncode != 0 and refused.stdout == ""
        assert len(refused.stderr.splitlines()) == 1 and "is running" in refused.stderr, refused.stderr
        assert set(before) <= set(after), "a refused purge deletes nothing"
        assert KEYS.node("solo") in after and KEYS.round in after

        assert agent.wait(timeout=90) == 0, cluster.dump()
        finished = keys_under(client, KEYS.prefix)
        done = purge("job")
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == [f"purged job 'job' (finished): {len(finished)} key(s) deleted"]
        assert keys_under(client, KEYS.prefix) == {}
        assert keys_under(client, JobKeys("job2").prefix) == neighbour_keys, "another job's keys are untouched"

        for missing in ("job", "nosuchjob"):  # purged, and never there
            gone = purge(missing)
            assert gone.returncode == 1 and gone.stdout == ""
            assert gone.stderr.splitlines() == [
                f"elastic-run purge: error: no job {missing!r} at {cluster.endpoint} (check --rdzv-id)"
            ]
        assert keys_under(client, JobKeys("job2").prefix) == neighbour_keys


# -- 6. bounded state in etcd --------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_etcd_keeps_max_events_while_membership_jsonl_keeps_them_all(cluster):
    # two crashes, two restarts: at least 9 events, trimmed when round 2 forms and when the job ends
    probe = cluster.probe(8, 0.05, "--fail-rank", "1", "--fail-step", "2", "--fail-restarts", "2")
    agent = cluster.start("solo", probe, nproc=2, rdzv_conf=FAST_RDZV + ",max_events=5", extra=["--max-restarts", "2"])
    assert agent.wait(timeout=90) == 0, cluster.dump()

    with etcd_session(cluster.endpoint) as client:
        stored = JobStore(client, KEYS.rdzv_id).read_events()
        assert 0 < len(keys_under(client, KEYS.events)) <= 5
    log = agent.membership()
    names = [e["event"] for e in log]
    assert len(log) > 5, log
    assert names[0] == "node_joined" and names[-1] == "job_finished"
    assert [(e["round"], e["reason"]) for e in log if e["event"] == "round_started"] == [
        (0, "initial"),
        (1, "worker_failed"),
        (2, "worker_failed"),
    ]
    assert [e["restart_count"] for e in log if e["event"] == "restart"] == [1, 2]
    assert sorted({e["round"] for e in log if e["event"] == "worker_failed"}) == [0, 1]
    # each event once (one transaction's events share a revision), in log order
    assert [e["revision"] for e in log] == sorted(e["revision"] for e in log)
    assert len({(e["revision"], e["event"], e["time"]) for e in log}) == len(log)
    assert [e.model_dump(exclude_none=True) for e in stored] == log[-len(stored) :], "etcd keeps the newest ones"
    assert "kept the newest 5 events" in agent.text()


@pytest.mark.timeout(180)
def test_trimming_never_drops_an_event_before_the_controllers_log_has_it(cluster):
    # max_events=1: the round after the crash is written with its `restart` event in one transaction, and trimmed
    # right after, so the `restart` event survives only if the log mirrored it before the trim
    probe = cluster.probe(6, 0.05, "--fail-rank", "1", "--fail-step", "2", "--fail-restarts", "1")
    agent = cluster.start("solo", probe, nproc=2, rdzv_conf=FAST_RDZV + ",max_events=1", extra=["--max-restarts", "1"])
    assert agent.wait(timeout=90) == 0, cluster.dump()
    names = [e["event"] for e in membership_changes(agent.membership())]
    assert [n for n in names if n != "worker_failed"] == [
        "node_joined",
        "round_started",
        "restart",
        "round_started",
        "job_finished",
    ], names


@pytest.mark.timeout(180)
def test_a_spare_that_leaves_leaves_no_notice_behind(cluster):
    probe = cluster.probe(100, 0.1)
    member = cluster.start("a", probe, nnodes="1", nproc=1)
    cluster.wait_for_world(1, timeout=60)
    spare = cluster.start("b", probe, nnodes="1", nproc=1)
    cluster.wait_for(lambda: "waiting as a spare" in spare.text(), 30, "b to wait as a spare")

    with etcd_session(cluster.endpoint) as client:
        os.kill(spare.pid, signal.SIGTERM)
        assert spare.wait(timeout=20) == 128 + signal.SIGTERM, cluster.dump()
        # the controller forgets the notice while the job still runs, not only when it ends
        cluster.wait_for(lambda: not keys_under(client, KEYS.left_prefix), 10, "the leave notice to be forgotten")
        assert member.process.poll() is None, "the job is still running"
        assert node_record(client, "b") is None
        cluster.stop_training()
        assert member.wait(timeout=60) == 0, cluster.dump()
        assert not keys_under(client, KEYS.left_prefix)

    log = member.membership()
    assert [e["node"] for e in log if e["event"] == "node_left"] == ["b"]
    assert [e["round"] for e in log if e["event"] == "round_started"] == [0], "a spare leaving forms no round"
    assert not [e for e in log if e["event"] == "node_lost"]
    assert log[-1]["event"] == "job_finished"
    assert "could not leave the membership cleanly" not in spare.text()
