"""Network partitions (issue 8): real agents in network namespaces, links cut and healed while a job runs.

Every node has two links (see `netns_harness.PartitionNetwork`): eth0 to its peers (gloo, the TCPStore; the
agents advertise it with --local-addr) and eth1 to the etcd LAN, so a test can cut a node from everything, from
etcd only, or from one peer only, and cut etcd members from everyone. Cuts are silent, as real ones are: a
switch port set down (or a drop rule in the switch) loses frames both ways, no RST, no ICMP; only case 4's
"reject" variant refuses connections instead, as a firewall would.

Each node runs one worker of `examples/collective_probe.py`, logging every completed collective to a file of its
own, so a test sees when which node trained at which world size. The seconds from each fault to the first
collective completed afterwards, and what the faulty node's agent logged, are printed (run with -s to see them)
as lines starting with PARTITION. PARTITION_LOGLEVEL=DEBUG gives the agents' etcd retries too.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from netns_harness import PartitionNetwork, unavailable_reason

from launcher.workers.process_tree import is_running

REPO = Path(__file__).resolve().parents[2]
PROBE = REPO / "examples" / "collective_probe.py"
# lease TTL 2 s (0.5 s x 3, rounded up): an agent that etcd has not answered for 1.75 s fences itself
FAST_RDZV = "keep_alive_interval=0.5,keep_alive_max_attempt=3,last_call_timeout=1,join_timeout=60"
# lease TTL 3 s refreshed every 0.5 s, fencing after 2.75 s without etcd: a survivor's agent starved of CPU on a loaded
# 2-core CI machine let its 2 s lease lapse as the cut node came back, and the job re-formed twice more
CUT_RDZV = "keep_alive_interval=0.5,keep_alive_max_attempt=6,last_call_timeout=1,join_timeout=60"
# elastic-run's default lease: TTL 3 s (1 s x 3), fencing after 2.75 s without etcd
# lease TTL 4 s (fencing after 3.75 s): a leader election at etcd's default timing (1-2 s after the leader is lost)
# fits however old the last refresh (up to an interval) was then; the default 3 s lease fits elections under ~1.5 s
ELECTION_RDZV = "keep_alive_interval=1,keep_alive_max_attempt=4,last_call_timeout=1,join_timeout=60"
# lease TTL 6 s: fencing only after 5.75 s without etcd
SLOW_RDZV = "keep_alive_interval=1,keep_alive_max_attempt=6,last_call_timeout=1,join_timeout=60"
FENCE_TEXT = "before the job moves on without them"
STEP_TIME = 0.05
# where `python -m launcher.commands.cli` is imported from: set PARTITION_LAUNCHER_ROOT to a directory holding a
# modified copy of launcher/ to try a change against these cases without touching the tree
LAUNCHER_ROOT = Path(os.environ.get("PARTITION_LAUNCHER_ROOT", REPO))

pytestmark = pytest.mark.slow


@pytest.fixture
def make_network(tmp_path):
    """Builds PartitionNetworks; each is torn down (processes killed, namespaces deleted) even when a test fails."""
    reason = unavailable_reason()
    if reason:
        pytest.fail(f"{reason} (these tests need network namespaces; CI runs as root)")
    made: list[PartitionNetwork] = []

    def make(nodes: int, etcd_members: int = 1, **etcd_timing: int) -> PartitionNetwork:
        root = tmp_path / f"net{len(made)}"
        root.mkdir()
        net = PartitionNetwork(nodes, root, etcd_members=etcd_members)
        made.append(net)
        net.create()
        net.start_etcd(**etcd_timing)
        return net

    try:
        yield make
    finally:
        for net in made:
            net.close()


def agent_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    env.pop("GLOO_SOCKET_IFNAME", None)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.setdefault("LOGLEVEL", os.environ.get("PARTITION_LOGLEVEL", "INFO"))
    return env


class Job:
    """One elastic-run agent of one job per node namespace, each node with one worker and a probe log of its own."""

    def __init__(
        self,
        net: PartitionNetwork,
        root: Path,
        *,
        nnodes: str,
        rdzv_conf: str,
        steps: int,
        extra: list[str] = (),
        rdzv_id: str = "job",
    ) -> None:
        self.net = net
        self.root = root
        self.nnodes = nnodes
        self.rdzv_conf = rdzv_conf
        self.steps = steps
        self.extra = list(extra)
        self.rdzv_id = rdzv_id
        self.agents: list[subprocess.Popen] = []

    def start(self) -> Job:
        for i, ns in enumerate(self.net.node_ns):
            command = [
                sys.executable,
                "-m",
                "launcher.commands.cli",
                "--nnodes",
                self.nnodes,
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "etcd",
                "--rdzv-endpoint",
                self.net.endpoint,
                "--rdzv-id",
                self.rdzv_id,
                "--rdzv-conf",
                self.rdzv_conf,
                "--node-id",
                f"node{i}",
                "--local-addr",
                self.net.node_addrs[i],
                "--log-dir",
                str(self.root / f"node{i}"),
                "--worker-stop-timeout",
                "2",
                *self.extra,
                str(PROBE),
                "--steps",
                str(self.steps),
                "--step-time",
                str(STEP_TIME),
                "--log",
                str(self.probe_log(i)),
                "--stop-file",
                str(self.stop_file),
            ]
            self.agents.append(self.net.popen(ns, command, self.output_path(i), env=agent_env(), cwd=LAUNCHER_ROOT))
        return self

    @property
    def stop_file(self) -> Path:
        return self.root / "stop-training"

    def stop_training(self) -> None:
        """The workers end together after their next collective: the test has seen what it waited for."""
        self.stop_file.touch()

    def nodes_training_since(self, since: float, world_size: int = 3) -> set[int]:
        """The nodes with a collective at `world_size` after unix time `since`."""
        return {c["node"] for c in self.collectives() if c["time"] > since and c["world_size"] == world_size}

    def probe_log(self, node: int) -> Path:
        return self.root / f"probe-node{node}.jsonl"

    def output_path(self, node: int) -> Path:
        return self.root / f"node{node}.out"

    def output(self, node: int) -> str:
        path = self.output_path(node)
        return path.read_text(errors="replace") if path.is_file() else ""

    def collectives(self, node: int | None = None) -> list[dict]:
        nodes = range(len(self.net.node_ns)) if node is None else [node]
        found = []
        for i in nodes:
            path = self.probe_log(i)
            if path.is_file():
                for line in path.read_text().splitlines():
                    try:
                        found.append(dict(json.loads(line), node=i))
                    except ValueError:  # a line being written
                        pass
        return sorted(found, key=lambda c: c["time"])

    def first_collective(self, world_size: int, after: float, nodes: set[int] | None = None) -> dict | None:
        return next(
            (
                c
                for c in self.collectives()
                if c["world_size"] == world_size and c["time"] > after and (nodes is None or c["node"] in nodes)
            ),
            None,
        )

    def wait_for(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            if all(agent.poll() is not None for agent in self.agents):
                break
            time.sleep(0.1)
        value = predicate()
        if value:
            return value
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{self.dump()}")

    def wait_for_world(
        self, world_size: int, timeout: float, after: float = 0.0, nodes: set[int] | None = None
    ) -> dict:
        return self.wait_for(
            lambda: self.first_collective(world_size, after, nodes), timeout, f"a collective at world size {world_size}"
        )

    def wait_exit(self, timeout: float) -> list[int | None]:
        deadline = time.monotonic() + timeout
        for agent in self.agents:
            try:
                agent.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                break
        return [agent.poll() for agent in self.agents]

    def membership(self) -> list[dict]:
        """The job's membership log: every agent writes it whole when it exits (each event once, by revision)."""
        events: dict[tuple, dict] = {}
        for i in range(len(self.net.node_ns)):
            path = self.root / f"node{i}" / "membership.jsonl"
            if path.is_file():
                for line in path.read_text().splitlines():
                    if line.strip():
                        event = json.loads(line)
                        events[(event.get("revision"), event["event"], event.get("node"), event["time"])] = event
        return sorted(events.values(), key=lambda e: (e.get("revision") or 0, e["time"]))

    def controller_node(self) -> int | None:
        """The node whose agent took the controller key last, per the agents' own output."""
        latest = None
        for i in range(len(self.net.node_ns)):
            pattern = r"^\[elastic-run node\d+\] (\S+) \w+ node(\d+) now controls"
            for match in re.finditer(pattern, self.output(i), re.M):
                if latest is None or match.group(1) >= latest[0]:
                    latest = (match.group(1), int(match.group(2)))
        return latest[1] if latest else None

    def node_of_rank(self, rank: int, round_: int) -> int:
        return next(c["node"] for c in self.collectives() if c["rank"] == rank and c["round"] == round_)

    def worker_pids(self, node: int, round_: int) -> set[int]:
        return {c["pid"] for c in self.collectives(node) if c["round"] == round_}

    def warnings(self, node: int) -> list[str]:
        return [line for line in self.output(node).splitlines() if " WARNING " in line or " ERROR " in line]

    def dump(self) -> str:
        parts = []
        for i, agent in enumerate(self.agents):
            parts.append(f"--- node{i} (pid {agent.pid}, rc {agent.poll()}) ---\n{self.output(i)[-4000:]}")
        for log in sorted(self.net.root.glob("etcd*.log")):
            parts.append(f"--- {log.name} ---\n{log.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)


def rounds(events: list[dict]) -> list[tuple[int, int, str, int]]:
    """(round, world size, reason, restart count) of every round_started."""
    return [
        (e["round"], e["world_size"], e.get("reason"), e.get("restart_count", 0))
        for e in events
        if e["event"] == "round_started"
    ]


def report(case: str, text: str) -> None:
    print(f"PARTITION {case}: {text}", flush=True)


def _cut_and_heal(make_network, tmp_path, case: str, cut, heal, choose) -> None:
    """Cases 1 and 2: 3 nodes x 1 worker, --nnodes 2:3, one node cut; the survivors train at 2, the victim
    fences, and once healed rejoins and a scale-up round takes it back."""
    net = make_network(3)
    job = Job(net, tmp_path, nnodes="2:3", rdzv_conf=CUT_RDZV, steps=200).start()
    job.wait_for_world(3, timeout=60)
    job.wait_for(
        lambda: len({c["node"] for c in job.collectives() if c["world_size"] == 3}) == 3,
        20,
        "every node training in round 0",
    )
    time.sleep(0.5)
    victim = choose(job)
    old_pids = job.worker_pids(victim, round_=0)
    survivors = {i for i in range(3) if i != victim}
    assert old_pids, job.dump()

    cut_at = time.time()
    cut(net, victim)
    again = job.wait_for_world(2, timeout=45, after=cut_at, nodes=survivors)
    recovered_s = again["time"] - cut_at
    # fenced while still cut off: the message, and its old workers gone once it is said. The others may have gone
    # on before that: their workers' stall has the cut node probed, and its lease ended at once
    job.wait_for(lambda: FENCE_TEXT in job.output(victim), 5, f"node{victim} fencing itself")
    alive = sorted(pid for pid in old_pids if is_running(pid))
    assert not alive, f"node{victim}'s round-0 workers {alive} still run after it said they were killed\n{job.dump()}"
    assert not job.first_collective(2, cut_at, {victim}), "the cut node trained in the survivors' world"

    heal_at = time.time()
    heal(net, victim)
    back = job.wait_for_world(3, timeout=60, after=heal_at)
    rejoined_s = back["time"] - heal_at
    job.stop_training()
    rcs = job.wait_exit(timeout=90)
    events = job.membership()
    victim_lines = [
        line
        for line in job.output(victim).splitlines()
        if any(word in line for word in ("WARNING", "ERROR", "joined job", "now controls"))
    ]
    report(
        case,
        f"node{victim} cut: first collective at world 2 after {recovered_s:.1f}s; healed: first collective "
        f"at world 3 after {rejoined_s:.1f}s; rounds {rounds(events)}",
    )
    report(case, f"node{victim}'s own log:\n  " + "\n  ".join(victim_lines))
    assert rcs == [0, 0, 0], job.dump()
    joined = [e for e in events if e["event"] == "node_joined" and e["node"] == f"node{victim}"]
    assert len(joined) == 2, events
    assert any(e["event"] == "node_lost" and e["node"] == f"node{victim}" and e["round"] == 0 for e in events), events
    # the loss never counts as a restart, and the node came back through a scale-up round
    assert [(w, reason, restarts) for _, w, reason, restarts in rounds(events)] == [
        (3, "initial", 0),
        (2, "node_lost", 0),
        (3, "scale_up", 0),
    ], f"{events}\n{job.dump()}"
    assert recovered_s < 3 + 20, f"survivors took {recovered_s:.1f}s (lease TTL 3 s + start-up)"


@pytest.mark.timeout(300)
def test_node_cut_from_everything_fences_and_rejoins(make_network, tmp_path):
    """Case 1: the controller's node loses every link: the survivors train at 2 within TTL + start-up, the cut node
    kills its workers on its own, and once its link returns it rejoins and a scale-up round takes it back."""
    _cut_and_heal(
        make_network,
        tmp_path,
        "cut-from-everything",
        PartitionNetwork.cut_node,
        PartitionNetwork.heal_node,
        choose=lambda job: job.controller_node(),
    )


@pytest.mark.timeout(300)
def test_node_cut_from_etcd_only_fences_and_rejoins(make_network, tmp_path):
    """Case 2: a node (neither the controller nor rank 0's) loses etcd but still reaches its peers: its workers would
    happily go on training with them, so the fence is what keeps the old world from outliving the new round."""

    def choose(job: Job) -> int:
        controller, rank0 = job.controller_node(), job.node_of_rank(0, round_=0)
        return (
            next(i for i in range(3) if i not in (controller, rank0))
            if controller != rank0
            else next(i for i in range(3) if i != controller)
        )

    _cut_and_heal(
        make_network,
        tmp_path,
        "cut-from-etcd",
        PartitionNetwork.cut_from_etcd,
        PartitionNetwork.heal_to_etcd,
        choose=choose,
    )


def _steer_leader(job: Job, net: PartitionNetwork) -> tuple[int, dict[int, set[int]]]:
    """Make the etcd member that the controller's agent talks to the leader (the worst member to lose: the
    controller's watch and every write of that agent go through it); returns it and each node's connections."""
    controller = job.controller_node()
    connections = {i: net.etcd_connections(i) for i in range(len(net.node_ns))}
    assert len(connections[controller]) == 1, connections
    target = next(iter(connections[controller]))
    if net.etcd_leader() != target:
        net.move_leader(target)
    deadline = time.monotonic() + 10
    while net.etcd_leader() != target:
        assert time.monotonic() < deadline, f"etcd leadership did not move to m{target}: {net.etcd_status()}"
        time.sleep(0.2)
    return target, connections


def _leader_of(net: PartitionNetwork, members: list[int]) -> int:
    deadline = time.monotonic() + 10
    while (leader := net.etcd_leader(members)) is None:
        assert time.monotonic() < deadline, f"no etcd leader among m{members}: {net.etcd_status(members)}"
        time.sleep(0.1)
    return leader


def _assert_undisturbed(job: Job, case: str, pids: dict[int, set[int]], fault_at: float, rcs: list[int | None]) -> None:
    """No worker restart and no membership change: one round, the same worker on every node, every agent exit 0."""
    events = job.membership()
    after = next((c for c in job.collectives() if c["time"] > fault_at), None)
    report(
        case,
        f"first collective after the fault: {after['time'] - fault_at:.2f}s later"
        if after
        else "no collective after the fault",
    )
    for i in range(len(job.agents)):
        lines = job.warnings(i)
        report(case, f"node{i}: {len(lines)} warning(s)" + "".join(f"\n  {line[:300]}" for line in lines[:12]))
    report(case, f"agent exit codes {rcs}; rounds {rounds(events)}")
    assert rcs == [0] * len(job.agents), job.dump()
    assert rounds(events) == [(0, len(job.agents), "initial", 0)], events
    assert not [e for e in events if e["event"] in ("node_lost", "worker_failed", "worker_hung")], events
    for i in range(len(job.agents)):
        assert FENCE_TEXT not in job.output(i), f"node{i} fenced\n{job.dump()}"
        assert job.worker_pids(i, round_=0) == pids[i], f"node{i}'s worker changed\n{job.dump()}"
        assert {c["pid"] for c in job.collectives(i)} == pids[i], f"node{i}'s worker changed\n{job.dump()}"


def _wait_for_new_leader(net: PartitionNetwork, members: list[int], old: int, old_term: int) -> tuple[int, float]:
    """The member of `members` that leads in a later raft term than `old` did, and the seconds it took to see it."""
    started = time.monotonic()
    while time.monotonic() - started < 15:
        status = net.etcd_status(members)
        leader = net.etcd_leader(members)
        if leader is not None and leader != old and status[leader]["term"] > old_term:
            return leader, time.monotonic() - started
        time.sleep(0.1)
    raise AssertionError(f"no new etcd leader among m{members} within 15s: {net.etcd_status()}")


@pytest.mark.timeout(300)
def test_etcd_leader_changes_mid_run_change_nothing(make_network, tmp_path):
    """Case 3a: a 5-member etcd cluster at etcd's default timing (heartbeat 100 ms, election 1 s: a new leader 1-2 s
    after the old one is lost) changes its leader three times while one job trains under a lease of 1 s x 4 (a
    node fences itself after 3.75 s without a confirmation; its last one can be an interval old when the leader
    goes, so the default 3 s lease fits only elections under about 1.5 s: CI once saw a node fenced in a run
    whose elections took 1.7 and 1.4 s). Each time the leader is the member the controller's agent talks to; it is
    cut off silently for good, then killed, then hands over with `etcdctl move-leader` (five members outlive losing
    two).
    Each time a new leader must be elected in a later term, and the job must train on past the time a fence would
    have come; then nothing else may have happened: no fence, no new round, the same workers. A silent cut is the
    hard case: followers hold the refreshes they forward to the dead leader until the caller's deadline, so the
    agents' refreshes must not wait for each other."""
    net = make_network(3, etcd_members=5, heartbeat_ms=100, election_ms=1000)
    # every node in round 0: with 2:3, CI once formed it without an agent that started a second late
    job = Job(net, tmp_path, nnodes="3", rdzv_conf=ELECTION_RDZV, steps=2000).start()
    job.wait_for(
        lambda: len({c["node"] for c in job.collectives() if c["world_size"] == 3}) == 3,
        60,
        "every node training in round 0",
    )
    pids = {i: job.worker_pids(i, round_=0) for i in range(3)}
    alive = list(range(5))
    first_fault_at = time.time()
    for how in ("cut", "kill", "move"):
        # first the member the controller's agent talks to; after a failover the agents hold connections to
        # several members, so the later faults hit whichever member leads then
        leader, connections = _steer_leader(job, net) if how == "cut" else (_leader_of(net, alive), {})
        term = net.etcd_status(alive)[leader]["term"]
        others = [j for j in alive if j != leader]
        fault_at = time.time()
        if how == "cut":
            net.cut_member(leader)
        elif how == "kill":
            net.kill_member(leader)
        else:
            net.move_leader(others[0], alive)
        elected, elected_s = _wait_for_new_leader(net, others, leader, term)
        if how != "move":
            alive = others
        report(
            "etcd-leader-changes",
            f"{how} m{leader} (leader; agents' connections {connections}, controller node{job.controller_node()}); "
            f"m{elected} leads within {elected_s:.1f}s",
        )
        # past a fence's deadline (3.75 s without a confirmation), every node still trains in round 0
        job.wait_for(lambda at=fault_at + 4.0: job.nodes_training_since(at) == {0, 1, 2}, 30, f"training after {how}")
    job.stop_training()
    rcs = job.wait_exit(timeout=60)
    _assert_undisturbed(job, "etcd-leader-changes", pids, first_fault_at, rcs)


@pytest.mark.timeout(300)
def test_etcd_quorum_lost_briefly_changes_nothing(make_network, tmp_path):
    """Case 3b: two of three etcd members (one of them the controller's) cut for 2 s, well under the 6 s lease:
    the third member loses its leader (no quorum: no write and no lease expiry can happen); once the two are back,
    the workers still run and the membership is unchanged."""
    net = make_network(3, etcd_members=3)
    # every node in round 0: with 2:3, CI once formed it without an agent that started a second late
    job = Job(net, tmp_path, nnodes="3", rdzv_conf=SLOW_RDZV, steps=2000).start()
    job.wait_for(
        lambda: len({c["node"] for c in job.collectives() if c["world_size"] == 3}) == 3,
        60,
        "every node training in round 0",
    )
    leader, connections = _steer_leader(job, net)
    second = next(j for j in range(3) if j != leader)
    third = next(j for j in range(3) if j not in (leader, second))
    pids = {i: job.worker_pids(i, round_=0) for i in range(3)}
    cut_at = time.time()
    net.cut_member(leader)
    net.cut_member(second)
    while net.etcd_status([third]).get(third, {}).get("leader") != 0:
        assert time.time() - cut_at < 2.0, f"m{third} still follows a leader without a quorum: {net.etcd_status()}"
        time.sleep(0.05)
    leaderless_s = time.time() - cut_at
    time.sleep(max(0.0, 2.0 - leaderless_s))
    heal_at = time.time()
    net.heal_member(leader)
    net.heal_member(second)
    while net.etcd_leader() is None:
        assert time.time() - heal_at < 10, f"etcd elected no leader within 10s of the heal: {net.etcd_status()}"
        time.sleep(0.1)
    report(
        "etcd-quorum-lost",
        f"cut m{leader} (leader) and m{second} for {heal_at - cut_at:.1f}s (agents' connections "
        f"{connections}); m{third} without a leader {leaderless_s:.1f}s after the cut, a leader again "
        f"{time.time() - heal_at:.1f}s after the heal",
    )
    # past the whole 6 s lease from the cut: a fence or an expiry would have come by then
    job.wait_for(lambda: job.nodes_training_since(cut_at + 6.0) == {0, 1, 2}, 30, "training a lease after the cut")
    job.stop_training()
    rcs = job.wait_exit(timeout=60)
    _assert_undisturbed(job, "etcd-quorum-lost", pids, cut_at, rcs)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["reject", "drop"])
def test_node_cut_from_one_peer_is_quarantined(make_network, tmp_path, how):
    """Case 4: two nodes lose each other (each still reaches etcd and the third node), so every collective hangs.
    The progress watchdog (--watchdog-timeout 3) finds the workers hung; the broken paths of the two ends
    (or, in the next round, a connect with no route, or a start-up hung on one) name the broken path, so both ends
    take a strike and the node that reaches both takes none; with quarantine_after=2 one end sits out, after which
    the two nodes that reach each other train on at world size 2.

    drop: the path between them drops everything (a real broken link). reject: their traffic to each other is
    refused (a firewall rule; a new connection fails at once)."""
    net = make_network(3)
    job = Job(
        net,
        tmp_path,
        nnodes="2:3",
        rdzv_conf=FAST_RDZV + ",quarantine_after=2",
        steps=200,
        extra=["--watchdog-timeout", "3", "--max-restarts", "6"],
    ).start()
    job.wait_for(
        lambda: len({c["node"] for c in job.collectives() if c["world_size"] == 3}) == 3,
        60,
        "every node training in round 0",
    )
    time.sleep(0.5)
    controller = job.controller_node()
    a, b = (i for i in range(3) if i != controller)
    cut_at = time.time()
    mode = net.cut_pair(a, b, how)
    # the job trains again without one of a, b (the right outcome), or runs out of restarts; round 1's start-up,
    # stuck on the broken path, is caught at the normal allowance (3 s), not the start-up allowance (5 x 3 s)
    try:
        job.wait_for(
            lambda: job.first_collective(2, cut_at) or all(agent.poll() is not None for agent in job.agents),
            90,
            "a collective at world size 2, or the job's end",
        )
    except AssertionError:
        pass
    recovered = job.first_collective(2, cut_at)
    job.stop_training()
    rcs = job.wait_exit(timeout=60 if recovered else 5)
    events = job.membership()
    quarantined = [e["node"] for e in events if e["event"] == "node_quarantined"]
    failures = [
        (e["round"], e["event"], e["node"], e.get("rank"), (e.get("message") or "")[:400])
        for e in events
        if e["event"] in ("worker_failed", "worker_hung")
    ]
    case = f"cut-from-one-peer-{how}"
    report(
        case,
        f"cut node{a} <-> node{b} ({mode}; node{controller}, the controller, reaches both); quarantined "
        f"{quarantined}; exit codes {rcs}; rounds {rounds(events)}",
    )
    report(case, "failures (round, event, node, rank, message):\n  " + "\n  ".join(map(str, failures)))
    for end in (a, b):
        own = [
            line
            for line in job.output(end).splitlines()
            if any(word in line for word in ("WARNING", "ERROR", "quarantin", "spare", "joined job"))
        ]
        report(case, f"node{end}'s own log:\n  " + "\n  ".join(line[:300] for line in own[:16]))
    if recovered:
        trained = sorted({c["node"] for c in job.collectives() if c["world_size"] == 2 and c["time"] > cut_at})
        report(case, f"first collective at world 2 after {recovered['time'] - cut_at:.1f}s (nodes {trained})")
    else:
        last = max((c["round"] for c in job.collectives()), default=0)
        report(case, f"no collective at world 2 within 90 s; the last round with a collective: {last}")
    assert quarantined and quarantined[0] in (f"node{a}", f"node{b}"), job.dump()
    assert recovered, job.dump()
    assert {c["node"] for c in job.collectives() if c["world_size"] == 2 and c["time"] > cut_at} != {a, b}
    assert rcs == [0, 0, 0], job.dump()
