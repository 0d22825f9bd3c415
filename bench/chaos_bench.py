"""Chaos benchmark: a stream of faults against a training job under elastic-run (and, with --systems, under torchft
and NVIDIA's ft_launcher), next to the same job without faults in the same invocation.

  elastic-run  a fresh etcd and --nodes agents x --nproc workers (--nnodes N-1:N, --max-restarts 1000, lease
               1 s x 3, last call 3 s) training --steps steps of examples/train.py's tiny model (global batch 24,
               a checkpoint on disk every 50 steps);
  torchft      bench/peer_bench.py's torchft job (a Lighthouse, one torchrun per replica group) for
               --steps-torchft steps; a replacement node is a new replica group in the lost one's slot;
  nvrx         bench/peer_bench.py's ft_launcher job (c10d rendezvous, --nnodes 2:3, --max-restarts 1000) for
               --steps-nvrx steps; node 0 hosts the c10d store, a single point of failure no fault is aimed at.

The peers train bench/peer_worker.py, the same model unpaced; their step counts are chosen so that each system's
fault-free run lasts about as long (~100 s here). In each chaos run, once training started, one fault every
--fault-every seconds, cycling through --kinds:

  kill   SIGKILL a node's agent and every process under it;
  stop   SIGSTOP the same, SIGKILLed 10 s later (a hung host that is then rebooted);
  crash  SIGKILL one training worker;
  hang   SIGSTOP one training worker (elastic-run's progress watchdog, --watchdog-min, finds it; torchft's gloo
         timeout; ft_launcher's rank heartbeat timeout);
  term   SIGTERM a node's agent (a preemption notice: elastic-run drains and leaves; torchrun and ft_launcher stop
         their workers and exit).

A node that is gone is replaced --rejoin-after seconds later by a new one (a scale-up; with elastic-run's --spares,
a spare takes the gone node's place in the same round and the new one waits as a spare). The victim is drawn
(--seed) among the nodes whose workers train (never a spare, whose workers wait in standby). Then, from the step
log each rank writes, for each system:

  goodput      samples trained per second from the first committed step to the last, over the fault-free run's
               (with --bracket, over the mean of two fault-free runs', one before the chaos run and one after)
               (for elastic-run and ft_launcher, which re-split the global batch over the ranks left, that is new
               steps per second: step_goodput; a torchft step trains only the shares of the replica groups in its
               quorum); a chaos run that --deadline cuts short is measured up to its last step;
  pauses       every gap between two new committed steps longer than 5 x the fault-free median step (at least
               1 s), with the faults and joins that came in it;
  change_pauses  each fault's and join's own pause, however short: the longest gap between two new committed
               steps that ended after it (and before the next change) and began within 6 s of it (a kill, stop
               or SIGTERM of the node that holds elastic-run's controller key is named so: "stop node0, the
               controller's", since its peers, not the controller, find that node gone);
  changing_s   the chaos run's seconds in gaps between two new committed steps longer than 3 x the fault-free
               median step: the time its membership changes took, small ones included;
  median_step_s  the fault-free and the chaos run's median step: the rest of chaos_s (on one machine a joining
               node's start-up, its interpreters importing torch, takes CPU from the nodes that train);
  redone       steps committed again after a later step was (a new round resumed from before them);
  dropped      steps a torchft quorum did not commit (should_commit() said no);
  world        the mean number of ranks that committed a step: torchft trains a smaller batch while groups are
               missing, the others re-split the global batch;
and for elastic-run, against its fault-free run:
  differ       steps whose samples (all ranks together) are not the fault-free run's;
  loss_rel     the largest relative difference of a step's loss from the fault-free run's.

It prints one JSON line per system, a table of the systems, then each system's pauses.

    python bench/chaos_bench.py                                   # elastic-run: 400 steps, a fault every 15 s
    python bench/chaos_bench.py --kinds kill,crash --fault-every 10 --watchdog-min 10
    python bench/chaos_bench.py --device cuda --nproc 1             # NCCL; each node its own host to NCCL
    python bench/chaos_bench.py --systems elastic-run,torchft,nvrx --kinds kill,stop,crash,hang,term   # [peers]
"""

from __future__ import annotations

import argparse
import bisect
import importlib.util
import json
import logging
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))  # recovery_bench puts the repository on sys.path itself

from peer_bench import (  # noqa: E402
    INSTALL,
    PEER_MODULES,
    start_lighthouse,
    start_nvrx_node,
    start_torchft_group,
    worker_args,
    workers_of,
)
from recovery_bench import (  # noqa: E402
    Job,
    process_tree,
    signal_groups_of,
    terminate_like_ctrl_c,
)
from training_recovery_bench import TINY_MODEL, TRAIN, completed_steps  # noqa: E402

from launcher.etcd import client as etcd_client  # noqa: E402
from launcher.etcd.server import EtcdServer, free_port  # noqa: E402
from launcher.rendezvous.protocol import Holder, JobKeys  # noqa: E402
from launcher.workers.process_tree import child_pids  # noqa: E402

logger = logging.getLogger("chaos-bench")

KINDS = ("kill", "stop", "crash", "hang", "term")
NODE_KINDS = ("kill", "stop", "term")  # the node's agent is hit, not only one of its workers
SYSTEMS = ("elastic-run", "torchft", "nvrx")
STOPPED_UNTIL_KILL_S = 10.0
# a change's own pause begins within this long of it: its detection (a lease, a stall, a hang) and its round
CHANGE_WINDOW_S = 6.0
RDZV_CONF = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=3"


@dataclass
class Change:
    """A fault, or a replacement node joining, at unix time `at`."""

    at: float
    what: str


class System(Protocol):
    """How one system's job starts its nodes, and where its ranks log their steps."""

    name: str
    steps: int  # the step the job trains to
    spared: frozenset[int]  # nodes no fault is aimed at
    batch_follows_world: bool  # a step of fewer ranks trains fewer samples (else the global batch is re-split)

    def start(self, job: Job) -> None: ...

    def start_node(self, job: Job, slot: int) -> None: ...

    def workers(self, job: Job, agent_pid: int) -> list[int]:
        """The agent's workers that train now (a spare's, waiting for a round, are no victims: hitting them would
        cost nothing)."""
        ...

    def records(self, job: Job) -> list[dict]: ...

    def registered(self, job: Job) -> dict[str, float]:
        """When each node registered with the job, where the system records it (a node's name -> unix time)."""
        ...

    def controller(self, job: Job) -> str | None:
        """The node that leads the job's membership now, if one does (None: none does, or it cannot be told)."""
        ...

    def close(self) -> None: ...


def _json_lines(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class ElasticRun:
    name = "elastic-run"
    spared: frozenset[int] = frozenset()
    batch_follows_world = False

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.steps = args.steps

    def start(self, job: Job) -> None:
        (job.workdir / "etcd").mkdir(parents=True)
        job.etcd = EtcdServer(data_dir=str(job.workdir / "etcd")).start()

    def start_node(self, job: Job, slot: int) -> None:
        node = len(job.agents)
        assert job.etcd is not None, "started before any node"
        command = [
            sys.executable,
            "-m",
            "launcher.commands.cli",
            "--nnodes",
            f"{self.args.nodes - 1}:{self.args.nodes}",
            "--nproc-per-node",
            str(self.args.nproc),
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            job.etcd.endpoint,
            "--rdzv-id",
            job.rdzv_id,
            "--rdzv-conf",
            RDZV_CONF,
            "--max-restarts",
            "1000",
            "--watchdog-min",
            str(self.args.watchdog_min),
            "--node-id",
            f"node{node}",
            "--log-dir",
            str(job.log_dir(node)),
            *(["--no-inprocess"] if self.args.no_inprocess else []),
            str(TRAIN),
            "--steps",
            str(self.args.steps),
            "--global-batch",
            "24",
            "--ckpt-dir",
            str(job.workdir / "ckpt"),
            "--ckpt-every",
            "50",
            "--sample-log",
            str(job.workdir / "samples.jsonl"),
            *TINY_MODEL,
            *(["--device", "cuda", "--backend", "nccl"] if self.args.device == "cuda" else []),
        ]
        # NCCL refuses two ranks of one communicator on one GPU of one host ("Duplicate GPU detected"): each
        # simulated node is a host of its own to it, so that the nodes of one machine can share its GPUs
        nccl_host = {"NCCL_HOSTID": f"{job.rdzv_id}-node{node}"} if self.args.device == "cuda" else {}
        job.start_agent(node, command, env=nccl_host)

    def workers(self, job: Job, agent_pid: int) -> list[int]:
        # seen through their supervisor; a spare's workers wait in standby, and only those in the newest round train
        records = self.records(job)
        newest = max((r["round"] for r in records), default=None)
        training = {r["pid"] for r in records if r["round"] == newest}
        return [pid for pid in child_pids(agent_pid) if pid in training]

    def records(self, job: Job) -> list[dict]:
        return _json_lines(job.workdir / "samples.jsonl")

    def registered(self, job: Job) -> dict[str, float]:
        # every agent's membership log holds the job's events while it runs; a joiner registers once its
        # workers are ready, seconds after its start
        joined: dict[str, float] = {}
        for node in range(len(job.agents)):
            for event in _json_lines(job.log_dir(node) / "membership.jsonl"):
                if event.get("event") == "node_joined":
                    joined[event["node"]] = min(event["time"], joined.get(event["node"], event["time"]))
        return joined

    def controller(self, job: Job) -> str | None:
        # the holder of the controller key: a fault on its node is found by the watchers' probe, not the
        # controller's own
        assert job.etcd is not None, "asked only while the job runs"
        client = etcd_client.connect(job.etcd.endpoint, timeout=1.0)
        try:
            raw, _ = client.get(JobKeys(job.rdzv_id).controller)
        except Exception as exc:  # a label, not a measurement: the fault goes ahead unlabelled
            logger.debug("could not read the controller key: %s", exc)
            return None
        finally:
            etcd_client.close(client)
        return Holder.decode(raw.decode()).node if raw else None

    def close(self) -> None:
        pass


class PeerJob:
    """What bench/peer_bench.py's jobs share: bench/peer_worker.py's step log, its workers under their launcher."""

    name: str
    spared: frozenset[int] = frozenset()

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def workers(self, job: Job, agent_pid: int) -> list[int]:
        return workers_of(agent_pid)

    def records(self, job: Job) -> list[dict]:
        return _json_lines(self.log(job))

    def log(self, job: Job) -> Path:
        return job.workdir / "steps.jsonl"

    def registered(self, job: Job) -> dict[str, float]:
        return {}  # not recorded: a join counts from the node's start

    def controller(self, job: Job) -> str | None:
        return None  # torchft's Lighthouse and nvrx's c10d store are processes no fault is aimed at

    def close(self) -> None:
        pass


class Torchft(PeerJob):
    name = "torchft"
    batch_follows_world = True  # each replica group keeps its share: the missing groups' samples are not trained

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args.steps_torchft)
        self.lighthouse: subprocess.Popen | None = None
        self.port = 0

    def start(self, job: Job) -> None:
        self.lighthouse, self.port = start_lighthouse(job)

    def start_node(self, job: Job, slot: int) -> None:
        start_torchft_group(job, slot, self.port, worker_args("torchft", self.log(job), job.workdir, self.steps))

    def close(self) -> None:
        if self.lighthouse is not None:
            self.lighthouse.kill()
            self.lighthouse.wait()


class Nvrx(PeerJob):
    name = "nvrx"
    spared = frozenset({0})  # it hosts the c10d store: its loss ends the job
    batch_follows_world = False

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args.steps_nvrx)
        self.port = 0

    def start(self, job: Job) -> None:
        self.port = free_port()

    def start_node(self, job: Job, slot: int) -> None:
        worker = worker_args("nvrx", self.log(job), job.workdir, self.steps)
        start_nvrx_node(job, self.port, worker, max_restarts=1000)


@dataclass
class Run:
    job: Job
    system: System
    args: argparse.Namespace
    changes: list[Change] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # node -> the slot it fills (torchft's replica group)
    cut_at: float | None = None  # when --deadline stopped a job that had not ended
    _finished: bool = False
    _checked_at: float = 0.0

    def start_node(self, slot: int | None = None) -> int:
        node = len(self.job.agents)
        slot = node if slot is None else slot
        self.system.start_node(self.job, slot)
        self.slots.append(slot)
        return node

    def records(self) -> list[dict]:
        """The ranks' step records, but those of processes started after the last step was first committed: a
        peer's process left behind (a torchft group with a stopped worker) may linger after the job, and a
        replacement started then finds no quorum and trains a model of its own from step 1."""
        records = self.system.records(self.job)
        done_at = self._last_step_committed_at(records)
        return records if done_at is None else [r for r in records if r.get("started", 0.0) <= done_at]

    def finished(self) -> bool:
        """Whether the last step was committed (read at most once a second: the peers' logs grow long)."""
        if not self._finished and time.monotonic() - self._checked_at >= 1.0:
            self._checked_at = time.monotonic()
            self._finished = self._last_step_committed_at(self.system.records(self.job)) is not None
        return self._finished

    def _last_step_committed_at(self, records: list[dict]) -> float | None:
        done = [r["time"] for r in records if r["step"] >= self.system.steps and r.get("committed", True)]
        return min(done, default=None)


def run_job(system: System, workdir: Path, args: argparse.Namespace, chaos: bool) -> Run:
    workdir.mkdir(parents=True)
    job = Job(launcher=system.name, workdir=workdir)
    run = Run(job, system, args)
    try:
        system.start(job)
        spares = args.spares if system.name == ElasticRun.name else 0
        for _ in range(args.nodes + spares):  # those beyond --nnodes MAX wait as spares
            run.start_node()
            time.sleep(0.5)  # join in order: nvrx's node 0 hosts the c10d store
        if chaos:
            _stream_of_faults(run, args)
        else:
            _wait_for_the_end(run, time.monotonic() + args.deadline)
    finally:
        job.stop()
        system.close()
    return run


def _wait_for_the_end(run: Run, deadline: float) -> None:
    while time.monotonic() < deadline:
        if run.job.running_agents() == 0 or run.finished():
            return
        time.sleep(0.5)
    run.cut_at = time.time()
    logger.warning("  the job did not end within --deadline %.0f s", run.args.deadline)


@dataclass
class Stream:
    """What the stream of faults has done to the nodes so far."""

    faulted: set[int] = field(default_factory=set)  # nodes hit whole (gone, stopped or leaving): hit only once
    to_kill: dict[int, float] = field(default_factory=dict)  # stopped node -> when it gets SIGKILL
    leaving: set[int] = field(default_factory=set)  # SIGTERMed agents, replaced once they exited
    joins: list[tuple[float, int]] = field(default_factory=list)  # when replacements start, and the slot each fills


def _stream_of_faults(run: Run, args: argparse.Namespace) -> None:
    """One fault every --fault-every s once training started; gone nodes replaced --rejoin-after s later."""
    rng = random.Random(args.seed)
    deadline = time.monotonic() + args.deadline
    while not progress(run.records()) and time.monotonic() < deadline:
        time.sleep(0.2)
    next_fault = time.time() + args.fault_every
    stream = Stream()
    count = 0
    while run.job.running_agents() and not run.finished() and time.monotonic() < deadline:
        now = time.time()
        for node, at in list(stream.to_kill.items()):
            if now >= at:
                signal_groups_of(process_tree(run.job.agents[node].pid), signal.SIGKILL)
                del stream.to_kill[node]
                stream.joins.append((now + args.rejoin_after, run.slots[node]))
        for node in list(stream.leaving):
            if run.job.agents[node].poll() is not None:
                stream.leaving.discard(node)
                stream.joins.append((now + args.rejoin_after, run.slots[node]))
        for join in [join for join in stream.joins if now >= join[0]]:
            stream.joins.remove(join)
            node = run.start_node(join[1])
            run.changes.append(Change(now, f"node{node} joins"))
        if now >= next_fault:
            live = [  # nodes that train: a spare is no victim
                n
                for n, agent in enumerate(run.job.agents)
                if agent.poll() is None
                and n not in stream.faulted
                and n not in run.system.spared
                and run.system.workers(run.job, agent.pid)
            ]
            kind = args.kinds[count % len(args.kinds)]
            if live and _fault(run, kind, rng.choice(live), stream, args.rejoin_after):
                count += 1
            next_fault = now + (args.fault_every if live else 1.0)
        time.sleep(0.1)
    if run.job.running_agents() and not run.finished():
        run.cut_at = time.time()
        logger.warning("  the job did not end within --deadline %.0f s", args.deadline)


def _fault(run: Run, kind: str, node: int, stream: Stream, rejoin_after: float) -> bool:
    """Apply fault `kind` to `node`; False when it found nothing to fault (a node between rounds has no worker)."""
    agent = run.job.agents[node]
    what = fault_label(kind, f"node{node}", run.system.controller(run.job) if kind in NODE_KINDS else None)
    now = time.time()
    if kind in ("crash", "hang"):
        workers = run.system.workers(run.job, agent.pid)
        if not workers:
            return False
        signal_groups_of([workers[0]], signal.SIGKILL if kind == "crash" else signal.SIGSTOP)
    elif kind == "term":
        agent.send_signal(signal.SIGTERM)
        stream.faulted.add(node)
        stream.leaving.add(node)
    else:
        signal_groups_of(process_tree(agent.pid), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        stream.faulted.add(node)
        if kind == "kill":
            stream.joins.append((now + rejoin_after, run.slots[node]))
        else:
            stream.to_kill[node] = now + STOPPED_UNTIL_KILL_S
    run.changes.append(Change(now, what))
    logger.info("  %s", what)
    return True


def fault_label(kind: str, node: str, controller: str | None) -> str:
    """A fault as the report names it: a node-wide fault on the controller's node says so, since that node's loss
    is found by its peers, not by the controller."""
    return f"{kind} {node}, the controller's" if node == controller else f"{kind} {node}"


# -- what the step logs say ----------------------------------------------------------------------------------------


def progress(records: list[dict]) -> list[tuple[float, int, int]]:
    """(time, step, world size) each time a step higher than every one before it was committed. A rank logs a step
    only once its gradients were averaged with every other rank's, so the first rank's log commits it."""
    found: list[tuple[float, int, int]] = []
    for record in sorted((r for r in records if r.get("committed", True)), key=lambda r: r["time"]):
        if not found or record["step"] > found[-1][1]:
            found.append((record["time"], record["step"], record["world_size"]))
    return found


def redone_steps(records: list[dict]) -> int:
    """Steps committed again after they or later ones were: work a new configuration did twice. Rank 0 is in every
    configuration and logs its steps in order within one, so its records show every step a new one went back to."""
    highest, again = 0, set()
    for record in sorted((r for r in records if r.get("committed", True) and r["rank"] == 0), key=lambda r: r["time"]):
        if record["step"] <= highest:
            again.add(record["step"])
        highest = max(highest, record["step"])
    return len(again)


def step_samples(records: list[dict]) -> dict[int, tuple[list[int], float]]:
    """Per step, from the last round that completed it: every rank's samples together (sorted) and the loss."""
    done = {(s.round, s.step) for s in completed_steps(records)}
    last_round: dict[int, int] = {}
    for round_, step in done:
        last_round[step] = max(last_round.get(step, -1), round_)
    found: dict[int, tuple[list[int], float]] = {}
    for record in records:
        if last_round.get(record["step"]) != record["round"]:
            continue
        samples, _ = found.get(record["step"], ([], record["loss"]))
        found[record["step"]] = (samples + list(record["samples"]), record["loss"])
    return {step: (sorted(samples), loss) for step, (samples, loss) in found.items()}


def batches_per_second(run: Run, steps: list[tuple[float, int, int]], batch_follows_world: bool) -> float:
    """Global batches trained per second from the first committed step to the last, or to the deadline that cut the
    run short (a step of a smaller world counts as the part of a batch it trained, where the batch follows the
    world)."""
    full = max(world for _, _, world in steps)
    batches = sum(world / full if batch_follows_world else 1.0 for _, _, world in steps[1:])
    return batches / ((run.cut_at or steps[-1][0]) - steps[0][0])


def joins_when_registered(changes: list[Change], registered: dict[str, float]) -> list[Change]:
    """`changes` with each node's join moved from its start to when it registered, where that is known: a joining
    node's change comes then (a scale-up), not when the bench started it."""
    moved = []
    for change in changes:
        node, _, what = change.what.partition(" ")
        moved.append(Change(registered[node], change.what) if what == "joins" and node in registered else change)
    return moved


def change_pauses(steps: list[tuple[float, int, int]], changes: list[Change], window_s: float) -> list[dict]:
    """Each fault's and join's own pause, however short: the longest gap between two new committed steps of those
    it caused. A gap is the latest change's before it ended, if it began within `window_s` of that change (the
    change's detection and its round): a fault during the step in progress pauses from that step on, and a join a
    few seconds before a fault does not take the fault's pause. `pauses` lists only the long gaps."""
    ordered = sorted(changes, key=lambda c: c.at)
    times = [change.at for change in ordered]
    caused: dict[int, list[tuple[float, int]]] = {}
    for before, after in zip(steps, steps[1:]):
        latest = bisect.bisect_left(times, after[0]) - 1  # the latest change before the gap ended
        if latest >= 0 and before[0] < times[latest] + window_s:
            caused.setdefault(latest, []).append((after[0] - before[0], before[1]))
    found = []
    for i, change in enumerate(ordered):
        if i in caused:
            gap, after_step = max(caused[i])
            found.append({"what": change.what, "s": round(gap, 2), "after_step": after_step})
    return found


def fault_free_rate(runs: list[tuple[Run, list[tuple[float, int, int]]]], batch_follows_world: bool) -> float:
    """The baseline's batches per second: the mean of the fault-free runs' (one before the chaos run, and with
    --bracket one after it, which cancels a machine's drift between them)."""
    return statistics.mean(batches_per_second(run, steps, batch_follows_world) for run, steps in runs)


def compare(free: Run, chaos: Run, free_after: Run | None = None) -> dict:
    free_records, chaos_records = free.records(), chaos.records()
    free_steps, chaos_steps = progress(free_records), progress(chaos_records)
    frees = [(free, free_steps)] + ([(free_after, progress(free_after.records()))] if free_after else [])
    free_seconds = [steps[-1][0] - steps[0][0] for _, steps in frees]
    chaos_s = (chaos.cut_at or chaos_steps[-1][0]) - chaos_steps[0][0]
    follows = chaos.system.batch_follows_world
    median = statistics.median(b[0] - a[0] for _, steps in frees for a, b in zip(steps, steps[1:]))
    long_gap = max(1.0, 5 * median)
    chaos_gaps = [b[0] - a[0] for a, b in zip(chaos_steps, chaos_steps[1:])]
    pauses: list[dict[str, Any]] = []
    cut = [(chaos.cut_at, 0, 0)] if chaos.cut_at else []  # the pause the deadline ended
    changes = joins_when_registered(chaos.changes, chaos.system.registered(chaos.job))
    for (before, step, _), (after, _, _) in zip(chaos_steps, [*chaos_steps[1:], *cut]):
        if after - before > long_gap:
            causes = [c.what for c in changes if before - 1.0 <= c.at <= after]
            pauses.append({"s": round(after - before, 2), "after_step": step, "causes": causes})
    faults = [c.what.split()[0] for c in chaos.changes if not c.what.endswith("joins")]
    result: dict[str, Any] = {
        "system": chaos.system.name,
        # samples trained per second against the fault-free run's: with torchft a smaller quorum's steps train
        # less and, on 2 oversubscribed cores, run faster, so its steps per second would flatter it
        "goodput": round(batches_per_second(chaos, chaos_steps, follows) / fault_free_rate(frees, follows), 3),
        "step_goodput": round(batches_per_second(chaos, chaos_steps, False) / fault_free_rate(frees, False), 3),
        "fault_free_s": round(free_seconds[0], 1),
        **({"fault_free_after_s": round(free_seconds[1], 1)} if len(free_seconds) > 1 else {}),
        "chaos_s": round(chaos_s, 1),
        "faults": {kind: faults.count(kind) for kind in KINDS if kind in faults},
        "joins": sum(c.what.endswith("joins") for c in chaos.changes),
        "steps": free_steps[-1][1],
        "last_step": chaos_steps[-1][1],
        "redone": redone_steps(chaos_records),
        "dropped": len({r["step"] for r in chaos_records if not r.get("committed", True)}),
        "world": round(statistics.mean(world for _, _, world in chaos_steps), 2),
        "changing_s": round(sum(gap for gap in chaos_gaps if gap > 3 * median), 1),
        "median_step_s": [round(median, 4), round(statistics.median(chaos_gaps), 4)],
        "longest_pause_s": max((float(p["s"]) for p in pauses), default=0.0),
        "pauses": pauses,
        "change_pauses": change_pauses(chaos_steps, changes, CHANGE_WINDOW_S),
    }
    if chaos.system.name == "elastic-run":  # train.py logs its samples and losses: the runs must agree on them
        expected, got = step_samples(free_records), step_samples(chaos_records)
        result["steps_missing"] = sorted(set(expected) - set(got))
        result["differ"] = sorted(step for step in expected if got.get(step, ([], 0.0))[0] != expected[step][0])
        result["loss_rel"] = max(
            (abs(got[s][1] - loss) / abs(loss) for s, (_, loss) in expected.items() if s in got and loss),
            default=None,
        )
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    parser.add_argument("--systems", default="elastic-run", help=f"comma-separated, from {', '.join(SYSTEMS)}")
    parser.add_argument("--fault-every", type=float, default=15.0, help="seconds between faults (default 15)")
    parser.add_argument("--rejoin-after", type=float, default=5.0, help="seconds until a gone node is replaced")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"faults, cycled (default {','.join(KINDS)})")
    parser.add_argument("--steps", type=int, default=400, help="elastic-run: steps to train (default 400)")
    parser.add_argument("--steps-torchft", type=int, default=1600, help="torchft: steps to train (default 1600)")
    parser.add_argument("--steps-nvrx", type=int, default=4400, help="nvrx: steps to train (default 4400)")
    parser.add_argument("--seed", type=int, default=0, help="draws the victims (default 0)")
    parser.add_argument("--nodes", type=int, default=3, help="elastic-run: agents (default 3; the peers run 3)")
    parser.add_argument("--nproc", type=int, default=2, help="elastic-run: workers per agent (default 2)")
    parser.add_argument(
        "--spares", type=int, default=0, help="elastic-run: agents beyond --nodes, waiting as spares (default 0)"
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="elastic-run: cpu (gloo) or cuda (NCCL; the nodes share this machine's GPUs, at most --nproc each)",
    )
    parser.add_argument(
        "--no-inprocess", action="store_true", help="elastic-run: restart survivors as new processes (its flag)"
    )
    parser.add_argument("--watchdog-min", type=float, default=3.0, help="elastic-run's --watchdog-min (default 3)")
    parser.add_argument("--deadline", type=float, default=900.0, help="seconds allowed per run (default 900)")
    parser.add_argument("--keep-logs", action="store_true", help="keep every run's directory")
    parser.add_argument(
        "--bracket",
        action="store_true",
        help="run the fault-free job again after the chaos run, and measure against both (a machine's speed "
        "drifts: two fault-free runs in a row here differed by 5 %%)",
    )
    args = parser.parse_args(argv)
    args.kinds = [kind.strip() for kind in args.kinds.split(",") if kind.strip()]
    unknown = sorted(set(args.kinds) - set(KINDS))
    if unknown or not args.kinds:
        parser.error(f"--kinds: unknown {unknown}; choose from {','.join(KINDS)}")
    args.systems = [system.strip() for system in args.systems.split(",") if system.strip()]
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown or not args.systems:
        parser.error(f"--systems: unknown {unknown}; choose from {','.join(SYSTEMS)}")
    if args.nodes < 2:
        parser.error("--nodes: at least 2 (the job goes on with N-1)")
    if args.device == "cuda":
        import torch

        if args.nproc > torch.cuda.device_count():
            parser.error(f"--device cuda: --nproc {args.nproc} but {torch.cuda.device_count()} GPU(s) visible here")
    return args


def make_system(name: str, args: argparse.Namespace) -> System:
    systems: dict[str, Callable[[argparse.Namespace], System]] = {
        "elastic-run": ElasticRun,
        "torchft": Torchft,
        "nvrx": Nvrx,
    }
    return systems[name](args)


def print_report(results: list[dict]) -> None:
    header = ["system", "goodput", "step goodput", "fault-free s", "chaos s", "faults", "joins", "redone", "dropped"]
    rows = [[*header, "world"]]
    for r in results:
        faults = " ".join(f"{kind}:{count}" for kind, count in r["faults"].items())
        free_s = " / ".join(str(r[key]) for key in ("fault_free_s", "fault_free_after_s") if key in r)
        cells = [r["goodput"], r["step_goodput"], free_s, r["chaos_s"], faults, r["joins"], r["redone"]]
        rows.append([r["system"], *(str(cell) for cell in [*cells, r["dropped"], r["world"]])])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print()
    for row in rows:
        print(" | ".join(cell.ljust(width) for cell, width in zip(row, widths)))
    for r in results:
        print(f"\n{r['system']}: {'pause s':>8} | after step | causes")
        for pause in r["pauses"]:
            print(f"{'':{len(r['system']) + 1}} {pause['s']:8.2f} | {pause['after_step']:10d} | ", end="")
            print(", ".join(pause["causes"]) or "-")
        print(f"{r['system']}: each change's pause: ", end="")
        print(", ".join(f"{change['what']} {change['s']:.2f} s" for change in r["change_pauses"]) or "-")
        if r["system"] == "elastic-run":
            print(
                f"elastic-run against its fault-free run: steps missing {len(r['steps_missing'])}, steps whose "
                f"samples differ {len(r['differ'])}, largest relative loss difference {r['loss_rel']}"
            )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = [s for s in args.systems if s in PEER_MODULES and importlib.util.find_spec(PEER_MODULES[s]) is None]
    if missing:
        print(f"chaos_bench: {', '.join(missing)} not installed: {INSTALL}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    signal.signal(signal.SIGTERM, terminate_like_ctrl_c)
    root = Path(tempfile.mkdtemp(prefix="chaos-bench-"))
    results = []
    try:
        for name in args.systems:
            logger.info("%s: fault-free run", name)
            free = run_job(make_system(name, args), root / name / "fault-free", args, chaos=False)
            logger.info("%s: chaos run, a fault every %.0f s (%s)", name, args.fault_every, ",".join(args.kinds))
            chaos = run_job(make_system(name, args), root / name / "chaos", args, chaos=True)
            after = None
            if args.bracket:
                logger.info("%s: fault-free run after the chaos run", name)
                after = run_job(make_system(name, args), root / name / "fault-free-after", args, chaos=False)
            results.append(dict(compare(free, chaos, after), spares=args.spares if name == ElasticRun.name else 0))
            print(json.dumps(results[-1]), flush=True)
    finally:
        if args.keep_logs:
            logger.info("kept %s", root)
        else:
            shutil.rmtree(root, ignore_errors=True)
    print_report(results)
    for r in results:
        if r["last_step"] < r["steps"]:
            print(f"{r['system']}: the chaos run reached step {r['last_step']} of {r['steps']} within --deadline")
    # elastic-run must have trained every step with the fault-free run's samples; a peer cut short is a figure
    return 1 if any(r.get("steps_missing") or r.get("differ") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
