"""Rendezvous scaling benchmark: N simulated agents running the real Agent and Controller against one local etcd.

For each N in --agents (one fresh etcd and one fresh set of processes per N):

  1. start P host processes (multiprocessing, spawn), each running up to --agents-per-process agents as threads
     that share ONE etcd client per process; every agent is a real `launcher.node.agent.Agent` (and whichever one
     claims the controller key runs the real `launcher.rendezvous.controller.Controller`) with its worker processes
     replaced by a no-op WorkerGroup whose poll() reports RUNNING until the host is told to stop;
  2. N-1 agents register; the last one is held back. Once the N-1 are registered (and 1 s has passed), the
     last agent starts: its registration brings the job to its --nnodes MAX (N) and triggers round 0.
       form_s          last registration -> every agent knows its rank in round 0 (the agent's `_enter_round`
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

Rendezvous settings (every agent): --nnodes 1:N, keep_alive_interval=--keep-alive-interval (1 s),
keep_alive_max_attempt=3 (lease TTL 3 s), last_call_timeout=3600 (so round 0 forms exactly when the N-th agent
registers: MAX reached; --nnodes N:N would form it as fast but could never re-form after the loss, and MIN < N with
last_call_timeout=0 would form round 0 without the held-back agent), join_timeout=3600, close_timeout=3600 (no
eviction during the bench), monitor_interval=5 s (no-op workers need no polling), nproc_per_node=1.

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
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

import etcd_metrics  # noqa: E402

logger = logging.getLogger("rendezvous-bench")

LEASE_ATTEMPTS = 3


# ================================================================================================================
# The host process: K agents as threads, one etcd client
# ================================================================================================================


class AgentKilled(Exception):
    """Raised inside a killed agent's loop: its thread ends without the leave path."""


class HostState:
    """What the agents of one host did and when; reports a (kind, round) once every live agent has done it."""

    def __init__(self, index: int, events) -> None:
        self.index = index
        self.events = events
        self.lock = threading.Lock()
        self.live = 0
        self.times: dict[tuple[str, int | None], list[float]] = collections.defaultdict(list)

    def note(self, kind: str, round_: int | None, when: float) -> None:
        with self.lock:
            times = self.times[(kind, round_)]
            times.append(when)
            if len(times) == self.live:
                self.events.put((kind, self.index, round_, len(times), max(times)))

    def anomaly(self, text: str) -> None:
        self.events.put(("anomaly", self.index, None, 0, text))


class SharedKeepAlive:
    """Every lease refresh of a host's agents sent on ONE long-lived keep-alive stream of the process's client.

    The agent's LeaseKeeper refreshes through `launcher.etcd.client.LeaseRoutes.refresh`, which opens a new
    LeaseKeepAlive stream per refresh, and gRPC starts a Python thread to feed each stream: ~1.3 ms of host CPU per
    refresh, which is nothing for one agent per machine but 1.3 cores for 1024 agents packed on this 2-core machine,
    enough to starve the keepers and let leases expire. With --keepalive shared, this object stands in for those
    routes process-wide (as the no-op WorkerGroup stands in for the real one): the LeaseKeepers still refresh every
    keep_alive_interval under the same deadline and etcd still receives one LeaseKeepAlive message per refresh (the
    same request count); only the client-side transport is cheaper. `carried` counts the refreshes it sent, so the
    coordinator can tell when the agents' refreshes no longer come this way.
    """

    def __init__(self, client) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._pending: dict[int, list] = collections.defaultdict(list)
        self._queue: queue.Queue = queue.Queue()
        self.carried = 0
        threading.Thread(target=self._run, name="shared-keepalive", daemon=True).start()

    def endpoints(self, lease) -> list[str]:
        return [self._client.endpoint_label]  # the stream's

    def prefer(self, lease, endpoint: str) -> None:
        raise AssertionError(f"the shared stream runs on one endpoint; asked to move to {endpoint}")

    def refresh(self, lease, deadline: float, endpoint: str) -> list:
        """What `launcher.etcd.client.LeaseRoutes.refresh` does: etcd's answers, or a transient error (the bench's
        etcd has one endpoint, the one the stream runs on)."""
        from pyetcd import etcdrpc

        from launcher.etcd.errors import EtcdUnavailable

        done = threading.Event()
        slot: list = []  # etcd's answer, appended by the stream's thread
        waiter = (done, slot)
        with self._lock:
            self._pending[lease.id].append(waiter)
            self.carried += 1
        self._queue.put(etcdrpc.LeaseKeepAliveRequest(ID=lease.id))
        if not done.wait(deadline):
            with self._lock:
                if waiter in self._pending[lease.id]:
                    self._pending[lease.id].remove(waiter)
            raise EtcdUnavailable(f"keep-alive not answered within {deadline:g} s")
        return slot

    def _run(self) -> None:
        import grpc

        while True:
            requests = self._queue
            endpoint = self._client.endpoint_label
            try:
                for response in self._client.leasestub.LeaseKeepAlive(iter(requests.get, None)):
                    with self._lock:
                        waiters = self._pending.get(response.ID)
                        waiter = waiters.pop(0) if waiters else None
                    if waiter is not None:
                        waiter[1].append(response)
                        waiter[0].set()
            except grpc.RpcError as exc:  # the stream broke: open another (elsewhere if its member failed)
                try:
                    self._client.on_endpoint_error(endpoint, exc)
                except Exception:  # noqa: BLE001 - it raises ours; waiters time out and retry
                    pass
            except Exception:  # noqa: BLE001 - waiters time out and retry
                pass
            self._queue = queue.Queue()
            requests.put(None)
            time.sleep(0.1)


def host_main(index: int, spec: dict, conn, events) -> None:
    """Entry point of one host process (spawned): runs its agents and answers the coordinator's commands."""
    # Imports here: the coordinator never imports grpc before spawning.
    threading.stack_size(2 << 20)
    logging.basicConfig(
        level=spec["log_level"],
        filename=os.path.join(spec["log_dir"], "host.log"),
        format="%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s",
    )
    deadline = time.monotonic() + spec["host_deadline_s"]

    def dump_stacks(signum=None, frame=None) -> None:
        # the coordinator sends SIGUSR1 when a phase times out: every thread's stack lands in host<i>/stacks.txt
        names = {t.ident: t.name for t in threading.enumerate()}
        with open(os.path.join(spec["log_dir"], "stacks.txt"), "w") as out:
            for ident, frame_ in sys._current_frames().items():
                out.write(f"\n--- {names.get(ident, ident)}\n{''.join(traceback.format_stack(frame_))}")

    signal.signal(signal.SIGUSR1, dump_stacks)
    from launcher.config import LaunchConfig, RendezvousSettings
    from launcher.etcd import client as etcd_client
    from launcher.etcd.lease_keeper import LeaseRoutes
    from launcher.node.agent import Agent
    from launcher.rendezvous.records import NodeRecord
    from launcher.workers.group import WorkerOutcome

    host = HostState(index, events)

    class NoopWorkerGroup:
        """The WorkerGroup interface without processes: RUNNING until the bench ends."""

        def __init__(self, config, round_, member, master, startups=None, warm=None) -> None:
            self.round, self.member, self.master = round_, member, master
            host.note("workers", round_.round, time.time())

        def start(self) -> None:
            pass

        def poll(self):
            return WorkerOutcome.RUNNING, []

        def stall(self) -> None:
            return None  # no workers, never stalled

        def stop(self, signum: int = signal.SIGTERM) -> None:
            pass

        def reporting_hang(self) -> bool:
            return False

        def latest_step(self) -> None:
            return None  # no workers, no steps

    class BenchAgent(Agent):
        """The real agent, plus timestamps at registration, round entry and acknowledgement, and a way to die."""

        def __init__(self, config, client, lease_routes) -> None:
            super().__init__(config, client, worker_group=NoopWorkerGroup, lease_routes=lease_routes)
            self.killed = False
            self.registrations = 0
            register, acknowledge = self.store.register, self.store.acknowledge

            def timed_register(record: NodeRecord) -> None:
                register(record)
                self.registrations += 1
                if self.registrations > 1:
                    host.anomaly(f"{self.node_id} registered again (its lease ended): lease keep-alive fell behind")
                    return
                host.note("registered", None, time.time())

            def timed_acknowledge(round_: int, round_revision: int, node: str, pid: int) -> bool:
                committed = acknowledge(round_, round_revision, node, pid)
                if committed:
                    host.note("acked", round_, time.time())
                return committed

            # wraps the methods of this agent's own store object, so every caller in the agent goes through them
            self.store.register = timed_register  # type: ignore[method-assign]  # same signature, wrapped
            self.store.acknowledge = timed_acknowledge  # type: ignore[method-assign]  # same signature, wrapped

        def enter_round(self, header, revision) -> None:
            super().enter_round(header, revision)
            assert self.run_ is not None  # set by the round just entered
            if self.run_.member is not None:
                host.note("entered", header.round, time.time())

        def step(self, view) -> None:
            if self.killed:
                raise AgentKilled(self.node_id)
            super().step(view)

        def sync_log(self) -> None:
            if not self.killed:  # a dead agent does not mirror the membership log
                super().sync_log()

        def die(self) -> float:
            """Stop refreshing the lease and end the loop without leaving; returns the time of death."""
            when = time.time()
            self.me.keeper.stop()
            self.killed = True
            self.mirror.poke()
            return when

    client = etcd_client.connect(spec["endpoint"])
    shared = None
    lease_routes: LeaseRoutes = etcd_client.LEASE_ROUTES
    if spec["keepalive"] == "shared":
        # every agent of this host process is simulated, so the shared stream stands in for its refreshes
        shared = SharedKeepAlive(client)
        lease_routes = shared
    # --nnodes 1:N with a last call of an hour: round 0 forms the moment the N-th agent registers (MAX reached),
    # and a loss re-forms at once with N-1 (MIN is met); --nnodes N:N could never re-form after a loss.
    rdzv = RendezvousSettings(
        keep_alive_interval=spec["keep_alive_interval"],
        keep_alive_max_attempt=LEASE_ATTEMPTS,
        last_call_timeout=3600,
        join_timeout=3600,
        close_timeout=3600,
    )
    agents: dict[str, BenchAgent] = {}
    threads: dict[str, threading.Thread] = {}
    for node in spec["nodes"]:
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=spec["n"],
            nproc_per_node=1,
            rdzv_endpoint=spec["endpoint"],
            rdzv_id=spec["rdzv_id"],
            rdzv=rdzv,
            monitor_interval=5.0,
            log_dir=Path(spec["log_dir"]),
            local_addr="127.0.0.1",
            node_id=node,
            entrypoint="noop-worker",
            warm_workers=False,  # no-op workers: a warm interpreter per simulated agent would import torch N times
        )
        agents[node] = BenchAgent(config, client, lease_routes)

    def run_agent(agent: BenchAgent) -> None:
        try:
            agent.run()
        except AgentKilled:
            pass
        except BaseException as exc:  # noqa: BLE001 - reported to the coordinator, never silent
            host.anomaly(f"{agent.node_id} crashed: {type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}")

    def start(node: str) -> None:
        with host.lock:
            host.live += 1
        thread = threading.Thread(target=run_agent, args=(agents[node],), name=f"agent-{node}", daemon=True)
        threads[node] = thread
        thread.start()

    rate = spec["start_rate"]
    started_at = time.monotonic()
    for count, node in enumerate(n for n in spec["nodes"] if n != spec["holdback"]):
        start(node)
        if rate > 0:
            delay = started_at + (count + 1) / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)

    while time.monotonic() < deadline:
        if not conn.poll(1.0):
            if os.getppid() == 1:
                break  # the coordinator is gone
            continue
        command, *rest = conn.recv()
        if command == "start":
            start(rest[0])
            conn.send(("started", time.time()))
        elif command == "kill":
            agent = agents[rest[0]]
            with host.lock:
                host.live -= 1
            conn.send(("killed", agent.die()))
        elif command == "stats":
            conn.send(
                (
                    "stats",
                    {
                        "threads": threading.active_count(),
                        "os_threads": etcd_metrics.process_threads(os.getpid()),
                        "cpu_s": etcd_metrics.process_cpu_seconds(os.getpid()),
                        "rss_mib": _rss_mib(),
                        "shared_refreshes": shared.carried if shared is not None else 0,
                    },
                )
            )
        elif command == "stop":
            conn.send(("stopping", None))
            break
    os._exit(0)  # the agents' threads are daemons; the job is thrown away with its etcd


def _rss_mib() -> float:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


# ================================================================================================================
# The coordinator
# ================================================================================================================


class Timeout(Exception):
    pass


class Hosts:
    """The host processes of one N, and the reports they send."""

    def __init__(self, spec: dict, node_slices: list[list[str]], deadline_s: float) -> None:
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

    def wait_for(self, kind: str, round_: int | None, expected: int, deadline_s: float, what: str) -> float:
        """Wait until `expected` agents reported (kind, round); returns the latest of their times."""
        deadline = time.monotonic() + deadline_s
        next_progress = time.monotonic() + 5
        while True:
            self.drain(timeout=0.05)
            count, latest = self.total(kind, round_)
            if count >= expected:
                return latest
            now = time.monotonic()
            dead = [p.name for p in self.processes if not p.is_alive()]
            if dead:
                raise Timeout(f"{what}: host process(es) {dead} exited")
            if now > deadline:
                raise Timeout(f"{what}: {count} of {expected} after {deadline_s:.0f} s")
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

    An in-process sampler (sys._current_frames from a thread) deadlocked the hosts against gRPC's own threads,
    so the profile is taken from outside. Idle threads are left out by py-spy; a sample counts once for every
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


def run_one(n: int, args: argparse.Namespace) -> dict:
    from etcd_cluster import EtcdCluster

    from elastic.node_memory import node_memory_dir
    from launcher.etcd import client as etcd_client
    from launcher.etcd.server import EtcdServer
    from launcher.rendezvous.protocol import JobKeys
    from launcher.rendezvous.records import MemberBucket, RoundHeader, RoundRecord

    ttl = max(1, math.ceil(args.keep_alive_interval * LEASE_ATTEMPTS))
    workdir = tempfile.mkdtemp(prefix=f"rdzv-bench-{n}-")
    rdzv_id = f"bench{n}"
    keys = JobKeys(rdzv_id)
    result: dict = {"agents": n}
    etcd: Any = None
    hosts = client = watch = None
    phase_started = time.monotonic()
    try:
        etcd_dir = os.path.join(args.etcd_dir or workdir, f"etcd-{n}")
        cluster = EtcdCluster(args.etcd_members, etcd_dir).start() if args.etcd_members > 1 else None
        server = EtcdServer(data_dir=etcd_dir).start() if cluster is None else None
        etcd = cluster or server
        result["etcd_members"] = args.etcd_members

        def etcd_pids() -> list[int]:
            if cluster is not None:
                return cluster.pids
            assert server is not None and server.process is not None, "started"
            return [server.process.pid]

        def scrape() -> dict:
            return etcd_metrics.scrape_members(cluster.metrics_endpoints() if cluster else [etcd.endpoint])

        client = etcd_client.connect(etcd.endpoint)
        slices = plan_hosts(n, args.agents_per_process)
        holdback = slices[-1][-1]
        spec = {
            "endpoint": etcd.endpoint,
            "rdzv_id": rdzv_id,
            "n": n,
            "workdir": workdir,
            "holdback": holdback,
            "keep_alive_interval": args.keep_alive_interval,
            "start_rate": args.start_rate,
            "keepalive": args.keepalive,
            "log_level": args.log_level,
        }
        result.update(keepalive=args.keepalive, processes=len(slices), agents_per_process=max(len(s) for s in slices))
        logger.info(
            "N=%d: %d host process(es) x <= %d agents, etcd %s",
            n,
            len(slices),
            result["agents_per_process"],
            etcd.endpoint,
        )
        hosts = Hosts(spec, slices, deadline_s=args.host_deadline)

        # -- registration of N-1 agents ----------------------------------------------------------------------
        started = time.monotonic()
        hosts.wait_for("registered", None, n - 1, args.phase_deadline + n * 0.05, "agents registered")
        result["register_s"] = round(time.monotonic() - started, 2)
        logger.info("  %d agents registered in %.1f s (of which host start-up)", n - 1, result["register_s"])
        time.sleep(1.0)
        hosts.drain()

        # -- round 0 -----------------------------------------------------------------------------------------
        m0, c0 = scrape(), cpu_snapshot(hosts, etcd_pids())
        profiler = None
        if args.sample:
            holder_raw, _ = client.get(keys.controller)
            controller_host = hosts.host_of[holder_raw.decode().split("#")[0]]
            profiled = {f"host{i}": hosts.pids[i] for i in sorted({controller_host, len(slices) - 1})}
            profiler = Profiler(profiled, workdir, "form")
            m0, c0 = scrape(), cpu_snapshot(hosts, etcd_pids())
        hosts.ask(hosts.host_of[holdback], "start", holdback)
        last_registration = hosts.wait_for("registered", None, n, 60, "last agent registered")
        known = hosts.wait_for("entered", 0, n, args.phase_deadline, "agents know their rank in round 0")
        m1, c1 = scrape(), cpu_snapshot(hosts, etcd_pids())
        to_known = etcd_metrics.delta_members(m0, m1)
        result.update(
            form_s=round(known - last_registration, 3),
            form_bytes_to_known=int(to_known.sent_bytes),
            form_cpu_to_known_s=cpu_delta(c0, c1),
        )
        logger.info(
            "  round 0: rank known by all %.3f s after the last registration (%d bytes sent by etcd, CPU %s)",
            result["form_s"],
            to_known.sent_bytes,
            result["form_cpu_to_known_s"],
        )
        workers = hosts.wait_for("workers", 0, n, args.phase_deadline, "agents started round 0 workers")
        acked = hosts.wait_for("acked", 0, n, args.phase_deadline, "agents acknowledged round 0")
        m2, c2 = scrape(), cpu_snapshot(hosts, etcd_pids())
        form = etcd_metrics.delta_members(m0, m2)
        result.update(
            form_s=round(known - last_registration, 3),
            form_workers_s=round(workers - last_registration, 3),
            form_acked_s=round(acked - last_registration, 3),
            form_requests=int(form.requests_without_keepalives),
            form_requests_to_known=int(etcd_metrics.delta_members(m0, m1).requests_without_keepalives),
            form_bytes=int(form.sent_bytes),
            form_proposals=int(form.proposals),
            form_cpu_s=cpu_delta(c0, c2),
            form_by_method={m: int(v) for m, v in form.by_method.items()},
        )
        if profiler is not None:
            result["form_profile"] = profiler.stop()
        logger.info(
            "  round 0: rank known by all %.3f s after the last registration, acknowledged by all %.3f s",
            result["form_s"],
            result["form_acked_s"],
        )

        # -- idle --------------------------------------------------------------------------------------------
        time.sleep(2.0)
        stats = hosts.ask_all("stats")
        result["threads_per_process"] = max(s["os_threads"] for s in stats)
        result["rss_mib_per_process"] = round(max(s["rss_mib"] for s in stats))
        m3, c3 = scrape(), cpu_snapshot(hosts, etcd_pids())
        time.sleep(args.idle_seconds)
        m4, c4 = scrape(), cpu_snapshot(hosts, etcd_pids())
        idle = etcd_metrics.delta_members(m3, m4)
        shared_refreshes = sum(s["shared_refreshes"] for s in hosts.ask_all("stats")) - sum(
            s["shared_refreshes"] for s in stats
        )
        if args.keepalive == "shared" and shared_refreshes < 0.9 * idle.keepalives:
            # the agents refresh some other way than the function SharedKeepAlive stands in for: each refresh then
            # costs a stream and a thread, and at 1024 agents on 2 cores the keepers starve (see SharedKeepAlive)
            hosts.anomalies.append(
                f"only {shared_refreshes} of {int(idle.keepalives)} idle lease refreshes went over the shared "
                "keep-alive stream: the agents' LeaseKeeper no longer refreshes through the function the Agent is given"
            )
            logger.warning("  %s", hosts.anomalies[-1])
        result.update(
            idle_requests_per_agent_s=round(idle.requests / n / idle.seconds, 3),
            idle_calls_per_agent_s=round(idle.calls / n / idle.seconds, 3),
            idle_non_keepalive_requests_s=round(idle.requests_without_keepalives / idle.seconds, 3),
            idle_proposals_s=round(idle.proposals / idle.seconds, 3),
            idle_by_method={m: round(v / idle.seconds, 2) for m, v in idle.by_method.items()},
            idle_cpu_s_per_s={k: round(v / idle.seconds, 3) for k, v in cpu_delta(c3, c4).items()},
        )
        logger.info(
            "  idle: %.3f requests/s per agent, %.3f raft proposals/s",
            result["idle_requests_per_agent_s"],
            result["idle_proposals_s"],
        )

        if cluster is not None:
            result["leader_killed_idle"] = kill_leader_while_idle(cluster, hosts, client, keys, ttl)
            logger.info("  etcd leader killed while idle: %s", result["leader_killed_idle"])

        # -- one agent dies; round 1 -------------------------------------------------------------------------
        holder_raw, _ = client.get(keys.controller)
        controller = holder_raw.decode().split("#")[0]
        round_raw, _ = client.get(keys.round)
        header = RoundHeader.loads(round_raw)
        buckets = [MemberBucket.loads(raw) for raw, _ in client.get_prefix(keys.members_prefix(header.round))]
        order = RoundRecord.assemble(header, buckets).nodes  # group-rank order
        victim = next(node for node in order[len(order) // 2 :] + order[1:] if node != controller)
        result.update(controller=controller, victim=victim)
        watch = KeyWatch(client, keys.node(victim), keys.round)
        hosts.drain()
        profiler = None
        if args.sample:
            profiled = {f"host{i}": hosts.pids[i] for i in sorted({hosts.host_of[controller], len(slices) - 1})}
            profiler = Profiler(profiled, workdir, "reform")
        m5, c5 = scrape(), cpu_snapshot(hosts, etcd_pids())
        death = hosts.ask(hosts.host_of[victim], "kill", victim)
        if cluster is not None:
            # the leader dies the moment the victim's lease ends: the re-form starts without it
            while watch.deleted_at is None:
                if time.time() - death > ttl + args.phase_deadline:
                    raise Timeout(f"the victim's lease did not end within {ttl + args.phase_deadline:.0f} s")
                time.sleep(0.005)
            leader = cluster.leader()
            assert leader is not None, "a cluster with a quorum has a leader"
            killed = cluster.kill(leader)
            result["leader_killed_in_reform"] = {
                "member": leader,
                "after_expiry_s": round(killed - watch.deleted_at, 3),
            }
        known1 = hosts.wait_for("entered", 1, n - 1, ttl + args.phase_deadline, "survivors know round 1")
        m6 = scrape()
        acked1 = hosts.wait_for("acked", 1, n - 1, args.phase_deadline, "survivors acknowledged round 1")
        m7, c7 = scrape(), cpu_snapshot(hosts, etcd_pids())
        reform = etcd_metrics.delta_members(m5, m7)
        expired, written = watch.deleted_at, watch.rounds.get(1)
        result.update(
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
            result["reform_profile"] = profiler.stop()
        logger.info(
            "  round 1: survivors know it %.3f s after the death (%.3f s beyond the %d s TTL)",
            result["reform_total_s"],
            result["reform_s"],
            ttl,
        )
    except Timeout as exc:
        logger.error("  N=%d: %s", n, exc)
        result["error"] = str(exc)
        if client is not None:
            try:
                holder_raw, _ = client.get(keys.controller)
                round_raw, _ = client.get(keys.round)
                result["etcd_at_error"] = {
                    "nodes": client.get_prefix_response(keys.nodes, count_only=True).count,
                    "controller": holder_raw.decode() if holder_raw else None,
                    "round": RoundHeader.loads(round_raw).round if round_raw else None,
                    "keys": client.get_prefix_response(keys.prefix, count_only=True).count,
                }
                logger.error("  etcd: %s", result["etcd_at_error"])
            except Exception as diag:  # noqa: BLE001
                logger.error("  could not read etcd: %s", diag)
        if hosts is not None:
            for process, pid in zip(hosts.processes, hosts.pids):
                if process.is_alive():
                    os.kill(pid, signal.SIGUSR1)
            time.sleep(2)
            logger.error("  stacks of every host thread: %s/host<i>/stacks.txt (kept with --keep-logs)", workdir)
    finally:
        if hosts is not None:
            hosts.drain()
            result["anomalies"] = len(hosts.anomalies)
            result["valid"] = not hosts.anomalies and "error" not in result
            if hosts.anomalies:
                result["first_anomaly"] = hosts.anomalies[0][:500]
        if watch is not None:
            watch.close()
        if client is not None:
            client.close()
        if hosts is not None:
            hosts.stop()
        for folder in node_memory_dir(rdzv_id, "").parent.glob(f"elastic-{rdzv_id}-*"):
            shutil.rmtree(folder, ignore_errors=True)  # the agents' memory folders: their processes were killed
        if etcd is not None:
            etcd.stop()
        if args.keep_logs:
            logger.info("  kept %s (host<i>/host.log: the agents' log records)", workdir)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
        result["wall_s"] = round(time.monotonic() - phase_started, 1)
    return result


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
        f"reform_s excludes it; --nnodes 1:N, last_call/join/close_timeout=3600, monitor_interval=5"
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
    parser.add_argument("--keep-alive-interval", type=float, default=1.0, help="seconds; lease TTL is 3x (default 1)")
    parser.add_argument(
        "--keepalive",
        choices=("shared", "real"),
        default="shared",
        help="shared: the agents of a host refresh their leases on one stream (default); real: "
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
