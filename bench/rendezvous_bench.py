"""Rendezvous scaling benchmark: N simulated agents running the real Agent and Controller against one local etcd.

For each N in --agents (one fresh etcd and one fresh set of processes per N):

  1. start P host processes (multiprocessing, spawn; bench/rendezvous_host.py), each running up to
     --agents-per-process agents as threads that share one etcd client per --agents-per-client; every agent is a real
     `launcher.node.agent.Agent` (and whichever one claims the controller key runs the real
     `launcher.rendezvous.controller.Controller`) with its worker processes replaced by a no-op WorkerGroup whose
     poll() reports RUNNING until the host is told to stop;
  2. N-1 agents register; the last one is held back. Once the N-1 are registered (and 1 s has passed), the
     last agent starts: its registration brings the job to its --nnodes MAX (N) and triggers round 0.
       form_s          last registration -> every agent knows its rank in round 0 (the agent's `enter_round`
                       returned with a member of the round: what `agent.run_` shows);
       form_workers_s  last registration -> every agent has called its worker-group factory (the round's
                       master address is known too: the factory is called with it);
       form_acked_s    last registration -> every agent's `acknowledge` of round 0 committed in etcd;
  3. idle for --idle-seconds (after a 2 s settle): etcd requests and raft proposals per second per agent;
  4. one agent that is neither the controller nor group rank 0 (group rank N/2) "dies": its LeaseKeeper stops
     and its agent thread exits WITHOUT the leave path (no leave notice, no deregistration, no lease revoke;
     its thread's `finally` still cancels its watch, which a dead process's closed stream does as well):
       reform_s        (every survivor knows its rank in round 1) - (death) - lease TTL; the lease ends up to one
                       keep-alive interval less than a TTL after the death (its last refresh came before), so
                       reform_s can be slightly negative; reform_after_expiry_s starts at the key's deletion;
       the split: death -> node key deleted by lease expiry (seen by a watch in this process) -> round 1
       record written -> every survivor entered it -> every survivor acknowledged it.
  5. the host processes are killed and etcd stopped (the job is thrown away with its etcd).

With --etcd-members K > 1 the agents use a local K-member cluster at etcd's default timing (bench/etcd_cluster.py).
After step 3 its leader is SIGKILLed; a lease and 2 s later the round must be the same, every node registered and
no agent fenced (a fenced or lapsed agent registers again: an anomaly) (`leader_killed_idle`, with the election's
seconds); the member then restarts on its data. In step 4 the leader is killed again the moment the victim's lease
ends (`leader_killed_in_reform`): reform_s includes that election. Request counts sum the members running at both
ends of a window (a killed member's requests go uncounted).

Requests, raft proposals and bytes come from etcd's /metrics (see bench/etcd_metrics.py for what counts as a
request). `requests_per_round` is the delta from the death to every survivor having acknowledged round 1, less
the lease refreshes in that window (which go on regardless of rounds; reported as keepalives_in_round_window);
`bytes_per_round` is etcd_network_client_grpc_sent_bytes_total over the same window (keep-alive replies
included, ~20 bytes each). `form_requests`/`form_bytes`: the same over round 0's window (from the held-back
agent's start, so its own join requests are in it, to every agent's acknowledgement).

Rendezvous settings (every agent): --nnodes N-1:N, keep_alive_interval=--keep-alive-interval (1 s),
keep_alive_max_attempt=3 (lease TTL 3 s), last_call_timeout=3600 (so round 0 forms exactly when the N-th agent
registers: MAX reached; --nnodes N:N would form it as fast but could never re-form after the loss, and a short
last call would form round 0 without the held-back agent), join_timeout=3600, close_timeout=3600 (no eviction
during the bench), monitor_interval=5 s (no-op workers need no polling), nproc_per_node=1. MIN is N-1, not 1:
the death leaves exactly MIN, so the re-form starts at once, and every round holds every live agent. An agent
whose lease lapsed registers again as a newcomer; with MIN 1 a round could form without it, and the newcomer
would then wait out the hour's last call to be let in (below MAX), so the job could never converge.

    python bench/rendezvous_bench.py --agents 16,64,256,1024,4096
    python bench/rendezvous_bench.py --agents 1024 --sample      # + py-spy profiles of two hosts per window
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import math
import multiprocessing
import os
import queue
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

import etcd_metrics  # noqa: E402

logger = logging.getLogger("rendezvous-bench")

LEASE_ATTEMPTS = 3


# ================================================================================================================
# The host process: K agents as threads, one etcd client (bench/rendezvous_host.py)
# ================================================================================================================


def host_main(index: int, spec: dict, conn, events) -> None:
    """Entry point of one host process (spawned): `rendezvous_host.main`. It lives here because multiprocessing
    pickles the target by reference, as a name of this module."""
    # not at the top: importing this module (the coordinator, --help) stays free of grpc and the launcher, which
    # it imports only inside the functions that use them
    import rendezvous_host

    rendezvous_host.main(index, spec, conn, events)


# ================================================================================================================
# The coordinator
# ================================================================================================================


class Timeout(Exception):
    pass


class Hosts:
    """The host processes of one N, and the reports they send."""

    def __init__(
        self,
        spec: dict,
        node_slices: list[list[str]],
        deadline_s: float,
        etcd_crashes: Callable[[], list[str]] = list,
    ) -> None:
        self.etcd_crashes = etcd_crashes  # a phase ends at once when etcd died: nothing can complete without it
        self.context = multiprocessing.get_context("spawn")
        self.events = self.context.Queue()
        self.processes, self.conns = [], []
        self.pids: list[int] = []  # of self.processes, in the same order
        self.reports: dict[tuple[str, int | None], dict[int, tuple[int, float]]] = collections.defaultdict(dict)
        self.anomalies: list[str] = []
        self.host_of: dict[str, int] = {}
        for index, nodes in enumerate(node_slices):
            parent, child = self.context.Pipe()
            host_spec = dict(
                spec, nodes=nodes, log_dir=os.path.join(spec["workdir"], f"host{index}"), host_deadline_s=deadline_s
            )
            os.makedirs(host_spec["log_dir"], exist_ok=True)
            process = self.context.Process(
                target=host_main, args=(index, host_spec, child, self.events), name=f"host{index}", daemon=True
            )
            process.start()
            assert process.pid is not None  # a started process has one
            self.processes.append(process)
            self.pids.append(process.pid)
            self.conns.append(parent)
            for node in nodes:
                self.host_of[node] = index

    def drain(self, timeout: float = 0.0) -> None:
        try:
            while True:
                kind, index, round_, count, value = self.events.get(timeout=timeout)
                timeout = 0.0
                if kind == "anomaly":
                    if len(self.anomalies) < 50:
                        logger.warning("  host%d: %s", index, value.splitlines()[0])
                    self.anomalies.append(value)
                    continue
                self.reports[(kind, round_)][index] = (count, value)
        except queue.Empty:
            pass

    def total(self, kind: str, round_: int | None) -> tuple[int, float]:
        reports = self.reports.get((kind, round_), {})
        return sum(c for c, _ in reports.values()), max((t for _, t in reports.values()), default=0.0)

    def wait_for(
        self,
        kind: str,
        round_: int | None,
        expected: int,
        deadline_s: float,
        what: str,
        newest_round: Callable[[], int | None] | None = None,
    ) -> float:
        """Wait until `expected` agents reported (kind, round); returns the latest of their times.

        Once an agent registered again (its lease lapsed), the job may leave `round_` behind for a newer round
        that holds the agent's new incarnation, and `round_` then never completes: with `newest_round` (etcd's
        current round), the wait ends as soon as the job is past `round_`, so that `settle` times the
        convergence from there, not from the phase's deadline."""
        deadline = time.monotonic() + deadline_s
        next_progress = time.monotonic() + 5
        next_look = time.monotonic() + 1
        while True:
            self.drain(timeout=0.05)
            count, latest = self.total(kind, round_)
            if count >= expected:
                return latest
            now = time.monotonic()
            dead = [p.name for p in self.processes if not p.is_alive()]
            if dead:
                raise Timeout(f"{what}: host process(es) {dead} exited")
            crashes = self.etcd_crashes()
            if crashes:
                raise Timeout(f"{what}: {count} of {expected} when {crashes[0]}")
            if now > deadline:
                raise Timeout(f"{what}: {count} of {expected} after {deadline_s:.0f} s")
            if self.anomalies and newest_round is not None and round_ is not None and now >= next_look:
                next_look = now + 1
                newest = newest_round()
                if newest is not None and newest > round_:
                    raise Timeout(f"{what}: {count} of {expected}; the job moved on to round {newest}")
            if now >= next_progress:
                logger.info("  ... %s: %d of %d", what, count, expected)
                next_progress = now + 5

    def ask(self, index: int, *command, timeout: float = 30.0):
        self.conns[index].send(command)
        if not self.conns[index].poll(timeout):
            raise Timeout(f"host{index} did not answer {command[0]} within {timeout:.0f} s")
        return self.conns[index].recv()[1]

    def ask_all(self, *command, timeout: float = 30.0) -> list:
        for conn in self.conns:
            conn.send(command)
        answers = []
        for index, conn in enumerate(self.conns):
            if not conn.poll(timeout):
                raise Timeout(f"host{index} did not answer {command[0]} within {timeout:.0f} s")
            answers.append(conn.recv()[1])
        return answers

    def dump_stacks(self) -> None:
        """Every live host writes every thread's stack to host<i>/stacks.txt (given 2 s to)."""
        for process, pid in zip(self.processes, self.pids):
            if process.is_alive():
                os.kill(pid, signal.SIGUSR1)
        time.sleep(2)

    def stop(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("stop",))
            except (OSError, BrokenPipeError):
                pass
        deadline = time.monotonic() + 5
        for process in self.processes:
            process.join(timeout=max(0.1, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        self.events.close()


def plan_hosts(n: int, per_process: int) -> list[list[str]]:
    nodes = [f"n{i:05d}" for i in range(n)]
    count = max(1, math.ceil(n / per_process))
    size = math.ceil(n / count)
    return [nodes[i : i + size] for i in range(0, n, size)]


class KeyWatch:
    """Times, seen from the coordinator, of a node key's deletion and of each round record's arrival."""

    def __init__(self, client, node_key: str, round_key: str) -> None:
        self.client = client
        self.deleted_at: float | None = None
        self.rounds: dict[int, float] = {}
        from launcher.etcd import client as etcd_client
        from launcher.rendezvous.records import RoundHeader

        def on_node(response) -> None:
            if isinstance(response, Exception):
                return
            for event in response.events:
                if isinstance(event, etcd_client.DeleteEvent) and self.deleted_at is None:
                    self.deleted_at = time.time()

        def on_round(response) -> None:
            if isinstance(response, Exception):
                return
            for event in response.events:
                if isinstance(event, etcd_client.PutEvent):
                    self.rounds.setdefault(RoundHeader.loads(event.value).round, time.time())

        self.ids = [client.add_watch_callback(node_key, on_node), client.add_watch_callback(round_key, on_round)]

    def close(self) -> None:
        for watch_id in self.ids:
            try:
                self.client.cancel_watch(watch_id)
            except Exception:  # noqa: BLE001
                pass


def kill_leader_while_idle(cluster, hosts: Hosts, client, keys, ttl: int) -> dict:
    """Kill the etcd leader while the job idles; a lease and more later nothing may have changed: the same round,
    every node registered, no agent fenced (it would register again: an anomaly). The member then comes back, so
    that the re-form phase can lose another leader and keep a quorum."""
    from launcher.etcd import client as etcd_client
    from launcher.rendezvous.records import RoundHeader

    def current_round() -> int:
        raw, _ = etcd_client.call_with_retry(client.get, keys.round)
        return RoundHeader.loads(raw).round

    hosts.drain()
    disturbed_before = len(hosts.anomalies)
    round_before = current_round()
    leader = cluster.leader()
    killed = cluster.kill(leader)
    while (elected := cluster.leader()) in (None, leader):
        if time.time() - killed > 30:
            raise Timeout("the etcd cluster elected no new leader within 30 s")
        time.sleep(0.05)
    elected_s = time.time() - killed
    time.sleep(ttl + 2.0)  # past the deadline of a fence, and of an expiry
    hosts.drain()
    nodes = etcd_client.call_with_retry(client.get_prefix_response, keys.nodes, count_only=True).count
    disturbed = hosts.anomalies[disturbed_before:]
    outcome = {
        "member": leader,
        "elected": elected,
        "elected_s": round(elected_s, 2),
        "round_changed": current_round() != round_before,
        "nodes_registered": nodes,
        "agents_disturbed": len(disturbed),
    }
    if disturbed:
        outcome["first_disturbance"] = disturbed[0][:300]
    cluster.restart(leader)
    return outcome


def controller_of(client, keys) -> str:
    """The node holding the controller key."""
    holder_raw, _ = client.get(keys.controller)
    return holder_raw.decode().split("#")[0]


def pick_victim(client, keys) -> tuple[str, str]:
    """The controller, and the agent to die: neither it nor group rank 0 (group rank N/2 if it can)."""
    from launcher.rendezvous.records import MemberBucket, RoundHeader, RoundRecord

    controller = controller_of(client, keys)
    round_raw, _ = client.get(keys.round)
    header = RoundHeader.loads(round_raw)
    buckets = [MemberBucket.loads(client.get(keys.member_bucket(header.round, i))[0]) for i in range(header.buckets)]
    order = RoundRecord.assemble(header, buckets).nodes  # group-rank order
    victim = next(node for node in order[len(order) // 2 :] + order[1:] if node != controller)
    return controller, victim


def kill_leader_at_expiry(cluster, watch: KeyWatch, death: float, limit_s: float) -> dict:
    """Kill the etcd leader the moment the victim's lease ends (the re-form starts without it): which member, and
    how long after the expiry."""
    while watch.deleted_at is None:
        if time.time() - death > limit_s:
            raise Timeout(f"the victim's lease did not end within {limit_s:.0f} s")
        time.sleep(0.005)
    leader = cluster.leader()
    assert leader is not None, "a cluster with a quorum has a leader"
    killed = cluster.kill(leader)
    return {"member": leader, "after_expiry_s": round(killed - watch.deleted_at, 3)}


def job_state(client, keys) -> dict:
    """The job in etcd, in brief: registered nodes, the controller key's holder, the round, every key."""
    from launcher.rendezvous.records import RoundHeader

    holder_raw, _ = client.get(keys.controller)
    round_raw, _ = client.get(keys.round)
    return {
        "nodes": client.get_prefix_response(keys.nodes, count_only=True).count,
        "controller": holder_raw.decode() if holder_raw else None,
        "round": RoundHeader.loads(round_raw).round if round_raw else None,
        "keys": client.get_prefix_response(keys.prefix, count_only=True).count,
    }


def cpu_snapshot(hosts: Hosts, etcd_pids: list[int]) -> dict[str, float]:
    """CPU seconds of the host processes, and of each etcd member (`etcd:<pid>`)."""
    snapshot = {f"etcd:{pid}": etcd_metrics.process_cpu_seconds(pid) for pid in etcd_pids}
    snapshot["hosts"] = sum(etcd_metrics.process_cpu_seconds(pid) for pid in hosts.pids)
    return snapshot


def cpu_delta(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds spent in between: the hosts', and etcd's over the members running at both ends."""
    etcd = sum(after[k] - before[k] for k in before if k.startswith("etcd:") and after.get(k, 0.0) > 0.0)
    return {"etcd": round(etcd, 2), "hosts": round(after["hosts"] - before["hosts"], 2)}


class Profiler:
    """py-spy (if installed) sampling the given host processes, without pausing them, for one window.

    An in-process sampler (sys._current_frames from a thread) deadlocked the hosts: CPython 3.11's gh-106883,
    which elastic.thread_frames avoids for one look but a sampler would pay for at every sample (the collector
    off); so the profile is taken from outside. Idle threads are left out by py-spy; a sample counts once for every
    function on its stack (inclusive) and once for its innermost frame (leaf).
    """

    def __init__(self, pids: dict[str, int], directory: str, window: str, rate: int = 50) -> None:
        self.outputs: dict[str, str] = {}
        self.processes: list = []
        binary = shutil.which("py-spy")
        if binary is None:
            logger.warning("  no profile: py-spy is not installed (pip install py-spy)")
            return
        import subprocess

        for name, pid in pids.items():
            output = os.path.join(directory, f"profile-{window}-{name}.txt")
            self.outputs[name] = output
            self.processes.append(
                subprocess.Popen(
                    [
                        binary,
                        "record",
                        "--pid",
                        str(pid),
                        "--rate",
                        str(rate),
                        "--nonblocking",
                        "--format",
                        "raw",
                        "--output",
                        output,
                        "--duration",
                        "120",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        time.sleep(1.0)  # py-spy attaches

    def stop(self) -> dict:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except Exception:  # noqa: BLE001
                process.kill()
        return {name: summarize_profile(path) for name, path in self.outputs.items()}


def summarize_profile(path: str, top: int = 12) -> dict:
    inclusive: collections.Counter[str] = collections.Counter()
    leaf: collections.Counter[str] = collections.Counter()
    total = 0
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return {"error": f"no profile at {path}"}
    for line in lines:
        stack, _, count_text = line.rpartition(" ")
        if not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = [f for f in stack.split(";") if "(" in f and not f.startswith(("process ", "thread "))]
        names = []
        for frame in frames:
            func, _, where = frame.partition(" (")
            file = where.split(":")[0].rstrip(")")
            names.append(f"{'/'.join(file.split('/')[-2:])}:{func}")
        for name in set(names):
            inclusive[name] += count
        if names:
            leaf[names[-1]] += count
    return {"samples": total, "inclusive": inclusive.most_common(top), "leaf": leaf.most_common(top)}


# On a cluster etcd has cores of its own. Here it shares 2 cores with thousands of simulated agents' threads, and
# the kernel shares CPU per runnable thread: with 16 host processes busy, etcd's few threads got a small part of
# it, stopped answering (4,096 agents: leases of 15 s lapsed, new connections timed out) and every agent asked
# again. Above the hosts' priority etcd takes what it needs, as on its own machine; its CPU is measured apart.
ETCD_NICENESS = -10


def raise_priority(pid: int, niceness: int) -> None:
    """Every thread of `pid` at `niceness` (Linux keeps one per thread; threads made later inherit their maker's),
    and its session's CPU group too: with the kernel's autogroup on (/proc/sys/kernel/sched_autogroup_enabled), a
    thread's nice level weighs only against its own session's threads, and etcd runs in a session of its own. With
    only its threads at -10, in the stalls of a 4,096-agent run etcd's threads waited 7 to 55 times longer to run
    than they ran."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(niceness))
    except OSError as exc:  # no autogroup in this kernel, or not root
        logger.debug("etcd's session group keeps its priority: %s", exc)
    try:
        tasks = [int(task) for task in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tasks = [pid]
    for task in tasks:
        try:
            os.setpriority(os.PRIO_PROCESS, task, niceness)
        except OSError as exc:  # not root: etcd competes with the hosts as it would without this
            logger.warning("could not raise etcd's priority (%s); its figures may include waiting for CPU", exc)
            return


# how a Go program's crash begins: "panic: <message>", "fatal error: <message>", or "SIGSEGV: segmentation violation"
_GO_CRASH = re.compile(r"^(panic|fatal error|SIG[A-Z]+): ")


def last_words(log_path: str) -> str:
    """Why an etcd that exited on its own did: the line its Go crash began with, else its log's last line."""
    try:
        lines = Path(log_path).read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"(no log: {exc})"
    return next((line for line in lines if _GO_CRASH.match(line)), lines[-1] if lines else "(empty log)")


class BenchEtcd:
    """The etcd of one N: one EtcdServer, or an EtcdCluster with --etcd-members > 1 (its leader gets killed)."""

    def __init__(self, members: int, data_dir: str) -> None:
        from etcd_cluster import EtcdCluster

        from launcher.etcd.server import EtcdServer

        self.cluster: EtcdCluster | None = None
        self.server: EtcdServer | None = None
        if members > 1:
            self.cluster = EtcdCluster(members, data_dir).start()
            self.endpoint = self.cluster.endpoint
        else:
            self.server = EtcdServer(data_dir=data_dir).start()
            self.endpoint = self.server.endpoint
        for pid in self.pids():
            raise_priority(pid, ETCD_NICENESS)

    def pids(self) -> list[int]:
        if self.cluster is not None:
            return self.cluster.pids
        assert self.server is not None and self.server.process is not None, "started"
        return [self.server.process.pid]

    def crashes(self) -> list[str]:
        """Each member that exited on its own (not killed by the bench), with the panic or last line of its log."""
        if self.cluster is not None:
            members = [
                (name, process, self.cluster.log_path(name))
                for name, process in zip(self.cluster.names, self.cluster.processes)
            ]
        else:
            assert self.server is not None and self.server.process is not None, "started"
            members = [("etcd", self.server.process, self.server.log_path)]
        return [
            f"etcd member {name} exited with code {process.returncode}: {last_words(log)}"
            for name, process, log in members
            if process.poll() is not None and process.returncode != -signal.SIGKILL
        ]

    def scrape(self) -> dict:
        return etcd_metrics.scrape_members(
            self.cluster.metrics_endpoints() if self.cluster is not None else [self.endpoint]
        )

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        if self.server is not None:
            self.server.stop()


class RendezvousRun:
    """One N: a fresh etcd and host processes taken through the phases of the module docstring; every figure
    lands in `result`, errors included (a phase that times out ends the run, and the rest is cleaned up)."""

    def __init__(self, n: int, args: argparse.Namespace) -> None:
        from launcher.rendezvous.protocol import JobKeys

        self.n = n
        self.args = args
        self.ttl = max(1, math.ceil(args.keep_alive_interval * LEASE_ATTEMPTS))
        self.workdir = tempfile.mkdtemp(prefix=f"rdzv-bench-{n}-")
        self.rdzv_id = f"bench{n}"
        self.keys = JobKeys(self.rdzv_id)
        self.result: dict = {"agents": n}
        self.etcd: BenchEtcd | None = None
        self.client: Any = None
        self._hosts: Hosts | None = None
        self.watch: KeyWatch | None = None
        self.phase: tuple[str, float, int] | None = None  # (what, when it began, live agents): see settle
        self.slices: list[list[str]] = []
        self.holdback = ""  # the agent whose registration forms round 0
        self.started = time.monotonic()

    def run(self) -> dict:
        try:
            self.start()
            self.register_all_but_one()
            self.form_round_0()
            self.idle()
            if self.cluster is not None:
                self.result["leader_killed_idle"] = kill_leader_while_idle(
                    self.cluster, self.hosts, self.client, self.keys, self.ttl
                )
                logger.info("  etcd leader killed while idle: %s", self.result["leader_killed_idle"])
            self.reform_after_a_death()
        except (Timeout, etcd_metrics.MetricsUnavailable) as exc:  # the run ends; whether the job converged is told
            self.diagnose(exc)
        finally:
            self.clean_up()
        return self.result

    @property
    def hosts(self) -> Hosts:
        assert self._hosts is not None, "started by start()"
        return self._hosts

    @property
    def cluster(self) -> Any:
        """The EtcdCluster, or None for one etcd server."""
        assert self.etcd is not None, "started by start()"
        return self.etcd.cluster

    def scrape(self) -> dict:
        assert self.etcd is not None, "started by start()"
        return self.etcd.scrape()

    def sample(self) -> tuple[dict, dict[str, float]]:
        """etcd's counters, then the CPU seconds of the hosts and the etcd members."""
        assert self.etcd is not None, "started by start()"
        return self.etcd.scrape(), cpu_snapshot(self.hosts, self.etcd.pids())

    def host_profiled(self, controller: str) -> int | None:
        """With --yappi: the last host that does not run the controller (the first if only it is left)."""
        if not self.args.yappi:
            return None
        others = [i for i in range(len(self.slices)) if i != self.hosts.host_of[controller]]
        return others[-1] if others else 0

    def profiler(self, window: str, controller: str) -> Profiler:
        """py-spy on the controller's host process and the last host for one window (--sample)."""
        indexes = sorted({self.hosts.host_of[controller], len(self.slices) - 1})
        return Profiler({f"host{i}": self.hosts.pids[i] for i in indexes}, self.workdir, window)

    def start(self) -> None:
        """etcd (one server, or a cluster), the coordinator's client, and the host processes."""
        from launcher.etcd import client as etcd_client

        args, n = self.args, self.n
        self.etcd = etcd = BenchEtcd(args.etcd_members, os.path.join(args.etcd_dir or self.workdir, f"etcd-{n}"))
        self.result["etcd_members"] = args.etcd_members
        self.client = etcd_client.connect_reachable(etcd.endpoint, job_nodes=n)  # says so if etcd has a known defect
        self.result["etcd_version"] = self.client.status().version
        self.slices = plan_hosts(n, args.agents_per_process)
        self.holdback = self.slices[-1][-1]
        spec = {
            "endpoint": etcd.endpoint,
            "rdzv_id": self.rdzv_id,
            "n": n,
            "workdir": self.workdir,
            "holdback": self.holdback,
            "keep_alive_interval": args.keep_alive_interval,
            "lease_attempts": LEASE_ATTEMPTS,
            "start_rate": args.start_rate,
            "keepalive": args.keepalive,
            "agents_per_client": args.agents_per_client,
            "watch_stream": args.watch_stream,
            "log_level": args.log_level,
        }
        self.result.update(
            keepalive=args.keepalive, processes=len(self.slices), agents_per_process=max(len(s) for s in self.slices)
        )
        logger.info(
            "N=%d: %d host process(es) x <= %d agents, etcd %s",
            n,
            len(self.slices),
            self.result["agents_per_process"],
            etcd.endpoint,
        )
        self._hosts = Hosts(spec, self.slices, deadline_s=args.host_deadline, etcd_crashes=etcd.crashes)

    def register_all_but_one(self) -> None:
        """The N-1 agents the hosts started on their own register (the last one is held back)."""
        n = self.n
        started = time.monotonic()
        self.hosts.wait_for("registered", None, n - 1, self.args.phase_deadline + n * 0.05, "agents registered")
        self.result["register_s"] = round(time.monotonic() - started, 2)
        logger.info("  %d agents registered in %.1f s (of which host start-up)", n - 1, self.result["register_s"])
        time.sleep(1.0)
        self.hosts.drain()

    def form_round_0(self) -> None:
        """The held-back agent starts; its registration brings the job to MAX and forms round 0."""
        hosts, n, deadline = self.hosts, self.n, self.args.phase_deadline
        m0, c0 = self.sample()
        profiler = None
        if self.args.sample:
            profiler = self.profiler("form", controller_of(self.client, self.keys))
            m0, c0 = self.sample()  # from after py-spy attached
        self.phase = ("round 0", time.time(), n)
        hosts.ask(hosts.host_of[self.holdback], "start", self.holdback)
        last_registration = hosts.wait_for("registered", None, n, 60, "last agent registered")
        known = hosts.wait_for("entered", 0, n, deadline, "agents know their rank in round 0", self.newest_round)
        m1, c1 = self.sample()
        to_known = etcd_metrics.delta_members(m0, m1)
        self.result.update(
            form_s=round(known - last_registration, 3),
            form_bytes_to_known=int(to_known.sent_bytes),
            form_cpu_to_known_s=cpu_delta(c0, c1),
        )
        logger.info(
            "  round 0: rank known by all %.3f s after the last registration (%d bytes sent by etcd, CPU %s)",
            self.result["form_s"],
            to_known.sent_bytes,
            self.result["form_cpu_to_known_s"],
        )
        workers = hosts.wait_for("workers", 0, n, deadline, "agents started round 0 workers", self.newest_round)
        acked = hosts.wait_for("acked", 0, n, deadline, "agents acknowledged round 0", self.newest_round)
        m2, c2 = self.sample()
        form = etcd_metrics.delta_members(m0, m2)
        self.result.update(
            form_s=round(known - last_registration, 3),
            form_workers_s=round(workers - last_registration, 3),
            form_acked_s=round(acked - last_registration, 3),
            form_requests=int(form.requests_without_keepalives),
            form_requests_to_known=int(to_known.requests_without_keepalives),
            form_bytes=int(form.sent_bytes),
            form_proposals=int(form.proposals),
            form_cpu_s=cpu_delta(c0, c2),
            form_by_method={m: int(v) for m, v in form.by_method.items()},
        )
        if profiler is not None:
            self.result["form_profile"] = profiler.stop()
        logger.info(
            "  round 0: rank known by all %.3f s after the last registration, acknowledged by all %.3f s",
            self.result["form_s"],
            self.result["form_acked_s"],
        )

    def idle(self) -> None:
        """After a 2 s settle, etcd's requests and proposals over --idle-seconds of a formed round."""
        hosts, n = self.hosts, self.n
        time.sleep(2.0)
        stats = hosts.ask_all("stats")
        self.result["threads_per_process"] = max(s["os_threads"] for s in stats)
        self.result["rss_mib_per_process"] = round(max(s["rss_mib"] for s in stats))
        m3, c3 = self.sample()
        time.sleep(self.args.idle_seconds)
        m4, c4 = self.sample()
        idle = etcd_metrics.delta_members(m3, m4)
        shared_refreshes = sum(s["shared_refreshes"] for s in hosts.ask_all("stats")) - sum(
            s["shared_refreshes"] for s in stats
        )
        if self.args.keepalive == "shared" and shared_refreshes < 0.9 * idle.keepalives:
            # the agents refresh some other way than the function SharedKeepAlive stands in for: each refresh then
            # costs a stream and a thread, and at 1024 agents on 2 cores the keepers starve (see SharedKeepAlive)
            hosts.anomalies.append(
                f"only {shared_refreshes} of {int(idle.keepalives)} idle lease refreshes went over the shared "
                "keep-alive stream: the agents' LeaseKeeper no longer refreshes through the function the Agent is given"
            )
            logger.warning("  %s", hosts.anomalies[-1])
        self.result.update(
            idle_requests_per_agent_s=round(idle.requests / n / idle.seconds, 3),
            idle_calls_per_agent_s=round(idle.calls / n / idle.seconds, 3),
            idle_non_keepalive_requests_s=round(idle.requests_without_keepalives / idle.seconds, 3),
            idle_proposals_s=round(idle.proposals / idle.seconds, 3),
            idle_by_method={m: round(v / idle.seconds, 2) for m, v in idle.by_method.items()},
            idle_cpu_s_per_s={k: round(v / idle.seconds, 3) for k, v in cpu_delta(c3, c4).items()},
        )
        logger.info(
            "  idle: %.3f requests/s per agent, %.3f raft proposals/s",
            self.result["idle_requests_per_agent_s"],
            self.result["idle_proposals_s"],
        )

    def reform_after_a_death(self) -> None:
        """One agent dies without leaving; the survivors form round 1 once its lease has ended."""
        hosts, n, ttl, deadline = self.hosts, self.n, self.ttl, self.args.phase_deadline
        # the round the death makes: 1, unless leases lapsed while idle (or a leader's loss) and the job moved on
        target = job_state(self.client, self.keys)["round"] + 1
        if target != 1:
            logger.warning("  the job is in round %d before the death (leases lapsed): timing %d", target - 1, target)
        self.result["reform_round"] = target
        controller, victim = pick_victim(self.client, self.keys)
        self.result.update(controller=controller, victim=victim)
        self.watch = watch = KeyWatch(self.client, self.keys.node(victim), self.keys.round)
        hosts.drain()
        profiler = self.profiler("reform", controller) if self.args.sample else None
        profiled = self.host_profiled(controller)
        if profiled is not None:
            hosts.ask(profiled, "profile", "start")
        m5, c5 = self.sample()
        death = hosts.ask(hosts.host_of[victim], "kill", victim)
        self.phase = ("the re-form", death, n - 1)
        if self.cluster is not None:
            self.result["leader_killed_in_reform"] = kill_leader_at_expiry(self.cluster, watch, death, ttl + deadline)
        known1 = hosts.wait_for(
            "entered", target, n - 1, ttl + deadline, f"survivors know round {target}", self.newest_round
        )
        m6 = self.scrape()
        acked1 = hosts.wait_for(
            "acked", target, n - 1, deadline, f"survivors acknowledged round {target}", self.newest_round
        )
        m7, c7 = self.sample()
        reform = etcd_metrics.delta_members(m5, m7)
        expired, written = watch.deleted_at, watch.rounds.get(target)
        self.result.update(
            reform_s=round(known1 - death - ttl, 3),
            reform_total_s=round(known1 - death, 3),
            reform_acked_s=round(acked1 - death - ttl, 3),
            reform_after_expiry_s=round(known1 - expired, 3) if expired else None,
            reform_split_s={
                "death->expiry": round(expired - death, 3) if expired else None,
                "expiry->round_written": round(written - expired, 3) if expired and written else None,
                "round_written->all_know": round(known1 - written, 3) if written else None,
                "all_know->all_acked": round(acked1 - known1, 3),
            },
            requests_per_round=int(reform.requests_without_keepalives),
            requests_per_round_to_known=int(etcd_metrics.delta_members(m5, m6).requests_without_keepalives),
            keepalives_in_round_window=int(reform.keepalives),
            bytes_per_round=int(reform.sent_bytes),
            proposals_per_round=int(reform.proposals),
            round_by_method={m: int(v) for m, v in reform.by_method.items()},
            reform_cpu_s=cpu_delta(c5, c7),
        )
        if profiler is not None:
            self.result["reform_profile"] = profiler.stop()
        if profiled is not None:
            logger.info(
                "  yappi profile of host%d over the re-form: %s", profiled, hosts.ask(profiled, "profile", "stop")
            )
        logger.info(
            "  round %d: survivors know it %.3f s after the death (%.3f s beyond the %d s TTL)",
            target,
            self.result["reform_total_s"],
            self.result["reform_s"],
            ttl,
        )

    def diagnose(self, exc: Exception) -> None:
        """A phase timed out (or etcd could not be measured): what etcd holds, and every host thread's stack
        (host<i>/stacks.txt)."""
        logger.error("  N=%d: %s", self.n, exc)
        self.result["error"] = str(exc)
        if self.etcd is not None:
            self.result["etcd_crashes"] = crashes = self.etcd.crashes()
            for crash in crashes:
                logger.error("  %s", crash)
        if self.client is not None:
            try:
                self.result["etcd_at_error"] = job_state(self.client, self.keys)
                logger.error("  etcd: %s", self.result["etcd_at_error"])
            except Exception as diag:  # noqa: BLE001
                logger.error("  could not read etcd: %s", diag)
        if self._hosts is not None:
            self.log_views()
            self._hosts.dump_stacks()
            logger.error("  stacks of every host thread: %s/host<i>/stacks.txt (kept with --keep-logs)", self.workdir)
        if self.client is not None and self.phase is not None and not self.result.get("etcd_crashes"):
            self.settle(*self.phase)

    def log_views(self) -> None:
        """Each host's agents' view against etcd's revision now: a host whose watches lag etcd never got the
        events; one whose watches caught up but whose agents did not move got them and did not act."""
        try:
            ctl = self.client.get_prefix_response(self.keys.ctl, keys_only=True)
            newest_ctl = max((kv.mod_revision for kv in ctl.kvs), default=0)
            views = self.hosts.ask_all("views", timeout=10.0)
        except Exception as exc:  # noqa: BLE001 - a diagnosis; the stacks come next either way
            logger.error("  could not ask the hosts what their agents know: %s", exc)
            return
        logger.error(
            "  etcd's revision %d, its newest state/ctl/ change at %d; what each host's live agents know:",
            ctl.header.revision,
            newest_ctl,
        )
        self.result["views_at_error"] = {"revision": ctl.header.revision, "newest_ctl": newest_ctl, "hosts": views}
        for index, view in enumerate(views):
            logger.error(
                "    host%d: %d live; ctl watch connected %d, at revision %d..%d; bucket watch connected %d, "
                "at %d..%d; %s",
                index,
                view["live"],
                view["ctl_connected"],
                *view["ctl_revision"],
                view["bucket_connected"],
                *view["bucket_revision"],
                view["phases"],
            )

    def newest_round(self) -> int | None:
        """The round etcd's header names now (None: no round yet, or etcd did not answer)."""
        from launcher.rendezvous.records import RoundHeader

        try:
            raw, _ = self.client.get(self.keys.round)
        except Exception as exc:  # noqa: BLE001 - an overloaded etcd; the wait looks again
            logger.debug("reading the round: %s", exc)
            return None
        return RoundHeader.loads(raw).round if raw else None

    def settle(self, phase: str, began: float, live: int) -> None:
        """After a phase missed its deadline: does the job still converge (its newest round holds every live agent,
        every one of them acknowledged it, and all are registered)? `converged_s` counts from the phase's start
        (None: not within --settle-deadline); `converged_round` is the round it settled in."""
        from launcher.rendezvous.protocol import ReportKind
        from launcher.rendezvous.records import RoundHeader

        deadline = time.monotonic() + self.args.settle_deadline
        settled = None
        last_seen = "no round"
        while time.monotonic() < deadline and settled is None:
            try:
                raw, _ = self.client.get(self.keys.round)
                header = RoundHeader.loads(raw) if raw else None
                if header is not None:
                    acks = f"{self.keys.round_prefix(header.round)}{ReportKind.ACK.value}/"
                    acked = self.client.get_prefix_response(acks, count_only=True).count
                    # a dead member's acknowledgement stays: only nodes still registered make it the job's round
                    registered = self.client.get_prefix_response(self.keys.nodes, count_only=True).count
                    last_seen = (
                        f"round {header.round} of {header.size} members, {acked} acknowledged, {registered} registered"
                    )
                    if header.size == live and acked >= live and registered == live:
                        settled = header.round
            except Exception as exc:  # noqa: BLE001 - an overloaded etcd; ask again
                logger.debug("settle: %s", exc)
            if settled is None:
                time.sleep(1.0)
        self.result["converged_round"] = settled
        self.result["converged_s"] = round(time.time() - began, 1) if settled is not None else None
        if settled is None:
            self.result["settle_last_seen"] = last_seen
            logger.error(
                "  %s: the job did not converge within %.0f s more (%d live agents; last seen: %s)",
                phase,
                self.args.settle_deadline,
                live,
                last_seen,
            )
        else:
            logger.error(
                "  %s: the job converged in round %d, all %d live agents acknowledged, %.1f s after it began",
                phase,
                settled,
                live,
                self.result["converged_s"],
            )

    def clean_up(self) -> None:
        """Validity and anomalies, then everything this N started is stopped and (without --keep-logs) removed."""
        from elastic.node_memory import job_memory_dirs

        hosts = self._hosts
        if hosts is not None:
            hosts.drain()
            self.result["anomalies"] = len(hosts.anomalies)
            self.result["valid"] = not hosts.anomalies and "error" not in self.result
            if hosts.anomalies:
                self.result["first_anomaly"] = hosts.anomalies[0][:500]
        if self.watch is not None:
            self.watch.close()
        if self.client is not None:
            self.client.close()
        if hosts is not None:
            hosts.stop()
        for folder in job_memory_dirs(self.rdzv_id):
            shutil.rmtree(folder, ignore_errors=True)  # the agents' memory folders: their processes were killed
        if self.etcd is not None:
            self.etcd.stop()
        if self.args.keep_logs:
            logger.info("  kept %s (host<i>/host.log: the agents' log records)", self.workdir)
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)
        self.result["wall_s"] = round(time.monotonic() - self.started, 1)


def run_one(n: int, args: argparse.Namespace) -> dict:
    """One N from a fresh etcd to its thrown-away job: the result's figures (see RendezvousRun)."""
    return RendezvousRun(n, args).run()


# ================================================================================================================
# Report
# ================================================================================================================

COLUMNS = [
    ("agents", "agents", "{}"),
    ("procs", "processes", "{}"),
    ("form_s", "form_s", "{:.3f}"),
    ("workers_s", "form_workers_s", "{:.3f}"),
    ("acked_s", "form_acked_s", "{:.3f}"),
    ("reform_s", "reform_s", "{:.3f}"),
    ("idle req/s/agent", "idle_requests_per_agent_s", "{:.3f}"),
    ("idle prop/s", "idle_proposals_s", "{:.2f}"),
    ("req/round", "requests_per_round", "{}"),
    ("req/round/agent", "req_per_round_per_agent", "{:.2f}"),
    ("bytes/round", "bytes_per_round", "{}"),
    ("form req", "form_requests", "{}"),
    ("form bytes", "form_bytes", "{}"),
    ("threads/proc", "threads_per_process", "{}"),
]


def print_table(results: list[dict], args: argparse.Namespace) -> None:
    rows = []
    for r in results:
        if "requests_per_round" in r:
            r["req_per_round_per_agent"] = r["requests_per_round"] / r["agents"]
        rows.append([fmt.format(r[key]) if r.get(key) is not None else "-" for _, key, fmt in COLUMNS])
    header = [title for title, _, _ in COLUMNS]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    print()
    for row in [header, *rows]:
        print(" | ".join(cell.rjust(width) for cell, width in zip(row, widths)))
    ttl = max(1, math.ceil(args.keep_alive_interval * LEASE_ATTEMPTS))
    print(
        f"\nlease TTL {ttl} s (keep_alive_interval={args.keep_alive_interval:g} x {LEASE_ATTEMPTS}); "
        f"reform_s excludes it; --nnodes N-1:N, last_call/join/close_timeout=3600, monitor_interval=5"
    )
    for r in results:
        if r.get("reform_split_s"):
            print(f"N={r['agents']}: round-1 split {r['reform_split_s']}")
        if r.get("error"):
            print(f"N={r['agents']}: ERROR {r['error']}")
    targets = {1024: ("form_s", 3.0), 4096: ("form_s", 10.0)}
    print()
    for n, (key, limit) in targets.items():
        at_n = next((r for r in results if r["agents"] == n), None)
        if at_n is not None and at_n.get(key) is not None:
            print(
                f"target: {n} agents {key} <= {limit:g} s: {at_n[key]:.3f} s -> "
                f"{'met' if at_n[key] <= limit else 'MISSED'}"
            )
    at_1024 = next((r for r in results if r["agents"] == 1024), None)
    if at_1024 is not None and at_1024.get("reform_s") is not None:
        print(
            f"target: 1024 agents know the new round <= TTL + 1 s: TTL + {at_1024['reform_s']:.3f} s -> "
            f"{'met' if at_1024['reform_s'] <= 1.0 else 'MISSED'}"
        )
    idle = [r for r in results if r.get("idle_requests_per_agent_s") is not None]
    if idle:
        worst = max(idle, key=lambda r: r["idle_requests_per_agent_s"])
        print(
            f"target: idle agent <= 1.2 etcd requests/s: worst {worst['idle_requests_per_agent_s']:.3f} "
            f"(N={worst['agents']}) -> {'met' if worst['idle_requests_per_agent_s'] <= 1.2 else 'MISSED'}; "
            f"raft proposals/s while idle: {', '.join(format(r['idle_proposals_s'], 'g') for r in idle)}"
        )
    per_agent = [(r["agents"], r["req_per_round_per_agent"]) for r in results if "req_per_round_per_agent" in r]
    if len(per_agent) > 1:
        print(
            "requests per round per agent (flat = linear in N): " + ", ".join(f"N={n}: {v:.2f}" for n, v in per_agent)
        )


def plot(results: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\nno plot: matplotlib is not installed (pip install matplotlib); the table above has every figure")
        return
    done = [r for r in results if r.get("form_s") is not None]
    if not done:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label in (
        ("form_s", "round 0: all know their rank"),
        ("form_acked_s", "round 0: all acknowledged"),
        ("reform_s", "after a loss: all know round 1, minus lease TTL"),
    ):
        points = [(r["agents"], r[key]) for r in done if r.get(key) is not None]
        if points:
            ax.plot(*zip(*points), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("agents (N)")
    ax.set_ylabel("seconds")
    ax.set_title("elastic-run rendezvous: real Agent/Controller, no-op workers, one local etcd")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nplot: {path}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    parser.add_argument("--agents", default="16,64,256,1024", help="comma-separated N values (default 16,64,256,1024)")
    parser.add_argument("--agents-per-process", type=int, default=256, help="agents per host process (default 256)")
    parser.add_argument(
        "--agents-per-client",
        type=int,
        default=256,
        help="agents of a host process that share one etcd client (default 256): its connection, and with "
        "--watch-stream client its one watch stream too",
    )
    parser.add_argument(
        "--watch-stream",
        choices=("agent", "client"),
        default="client",
        help="client: the watches of a client's agents on its one stream (default), where etcd's 128-response "
        "queue per stream sends half of them down its slow path with every round; agent: each agent's watches on "
        "a stream of its own, as a real agent's client has, which costs two threads per stream (at 4,096 agents "
        "on 2 cores, watch creations timed out during registration: docs/scaling.md)",
    )
    parser.add_argument("--keep-alive-interval", type=float, default=1.0, help="seconds; lease TTL is 3x (default 1)")
    parser.add_argument(
        "--keepalive",
        choices=("shared", "real"),
        default="shared",
        help="shared: the agents of a host refresh their leases on one connection, a stream per lease (default); real: "
        "a stream + thread per refresh, as one elastic-run agent does (see SharedKeepAlive)",
    )
    parser.add_argument("--idle-seconds", type=float, default=10.0, help="idle measurement window (default 10)")
    parser.add_argument(
        "--start-rate",
        type=float,
        default=200.0,
        help="agents started per second per host process before round 0 (default 200; 0: all at once)",
    )
    parser.add_argument("--phase-deadline", type=float, default=120.0, help="seconds allowed per phase (default 120)")
    parser.add_argument(
        "--settle-deadline",
        type=float,
        default=120.0,
        help="after a phase misses its deadline, seconds to wait for the job to converge anyway (default 120)",
    )
    parser.add_argument(
        "--host-deadline", type=float, default=900.0, help="a host process exits after this (default 900)"
    )
    parser.add_argument(
        "--budget", type=float, default=840.0, help="skip the remaining N past this many seconds (default 840)"
    )
    parser.add_argument(
        "--etcd-members",
        type=int,
        default=1,
        help="etcd cluster size (default 1); with more, the leader is killed while the job idles, and again the "
        "moment the re-form begins",
    )
    parser.add_argument("--etcd-dir", default=None, help="where etcd keeps its data (default: a temp dir on /tmp)")
    parser.add_argument(
        "--keep-logs", action="store_true", help="keep each N's directory (host logs, membership.jsonl)"
    )
    parser.add_argument(
        "--log-level", default="WARNING", help="agents' log level in host<i>/host.log (default WARNING)"
    )
    parser.add_argument(
        "--sample",
        action="store_true",
        help="py-spy profile of the controller's host process and the last host, per window (py-spy needed)",
    )
    parser.add_argument(
        "--yappi",
        action="store_true",
        help="yappi CPU profile of every thread of one host that does not run the controller, over the re-form "
        "(host<i>/yappi.txt; kept with --keep-logs; yappi needed)",
    )
    parser.add_argument(
        "--plot",
        default=os.path.join(tempfile.gettempdir(), "rendezvous_bench.png"),
        help="PNG path (default /tmp/rendezvous_bench.png)",
    )
    args = parser.parse_args(argv)
    args.agents = [int(n) for n in args.agents.split(",") if n.strip()]
    if any(n < 2 for n in args.agents):
        parser.error("--agents: every N must be at least 2 (one agent dies in the loss phase)")
    return args


def _terminate_like_ctrl_c(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    signal.signal(signal.SIGTERM, _terminate_like_ctrl_c)
    soft, hard = __import__("resource").getrlimit(__import__("resource").RLIMIT_NOFILE)
    logger.info("ulimit -n %d (hard %d); %d CPU(s)", soft, hard, os.cpu_count() or 0)
    started = time.monotonic()
    results = []
    try:
        for n in args.agents:
            if time.monotonic() - started > args.budget:
                logger.warning("skipping N=%d: past the %.0f s budget", n, args.budget)
                results.append({"agents": n, "error": "skipped: time budget spent"})
                continue
            result = run_one(n, args)
            results.append(result)
            print(json.dumps(result), flush=True)
    except KeyboardInterrupt:
        logger.warning("interrupted; results so far follow")
    print_table(results, args)
    plot(results, args.plot)
    print(f"\ntotal {time.monotonic() - started:.0f} s")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
