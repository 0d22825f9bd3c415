"""Peer benchmark: seconds from a fault to the next committed step, and the steps lost, under torchft, NVIDIA's
ft_launcher (nvidia-resiliency-ext) and elastic-run, on the same model, global batch and machine.

The job is the same for all three: 3 "nodes" x 2 ranks training examples/train.py's tiny GPT (bench/
training_recovery_bench.py's flags), a global batch of 32 over the 6 ranks; every rank appends one JSON line per
step (step, rank, world size, round, time, committed) to one log, and the figures come from that log:

  elastic-run  bench/training_recovery_bench.py's scenario (examples/train.py under 3 elastic-run agents, its
               defaults: warm workers, a snapshot in memory every step; lease 1 s x 3; --nnodes 2:3);
  torchft      a Lighthouse on loopback and 3 replica groups, each a torchrun (--standalone, 2 ranks,
               --max-restarts 10: torchft's own examples run a replica group so, and restarting a dead group is the
               user's job) of bench/peer_worker.py: Manager(ProcessGroupGloo) + torchft's DDP and Optimizer
               wrappers across the groups, a gloo all_reduce inside a group; a returning group heals from a live one;
  nvrx         3 ft_launcher agents (torchrun's flags, c10d rendezvous with recovery_bench's tuned torchrun conf,
               --nnodes 2:3, --max-restarts 3) of bench/peer_worker.py: plain DDP on gloo, a heartbeat to the rank
               monitor every step, rank 0 saving a checkpoint every step (a tiny model: milliseconds), since
               ft_launcher restarts every worker from scratch.

For each fault, the three systems run one after the other (interleaved, so their ratio means something on a
machine whose load changes): wait until the 6 ranks trained --fault-step steps, then fault the last node:

  kill   SIGKILL the node (its agent or torchrun and all their processes: a dead host);
  stop   SIGSTOP the same (a hung host);
  crash  SIGKILL one worker of it (the launcher, or torchrun for a torchft replica group, restarts it).

Measured: the seconds from the fault to the first step committed by every rank of a later configuration (a later
elastic-run round, a later torchft quorum, ft_launcher workers started after the fault), and the steps lost: steps
committed before the fault and trained again (elastic-run, ft_launcher), or steps dropped by should_commit() after
the fault (torchft; its survivors never go back). A scenario's processes (stopped ones continued first), its
Lighthouse or etcd and its directory go when it ends, on Ctrl-C too.

    pip install torch==2.13.0 torchft==0.2.0 nvidia-resiliency-ext==0.4.1     # or: pip install -e '.[peers]'
    python bench/peer_bench.py                                    # kill, stop, crash for all three
    python bench/peer_bench.py --systems elastic-run,torchft --faults kill --keep-logs
    python bench/peer_bench.py --systems elastic-run              # without the peer packages

The stream of faults (one every 15 s, nodes replaced) runs through the peers in bench/chaos_bench.py:

    python bench/chaos_bench.py --systems elastic-run,torchft,nvrx
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))  # recovery_bench puts the repository on sys.path itself

import training_recovery_bench  # noqa: E402
from recovery_bench import (  # noqa: E402
    FAULTED_NODE,
    NODES,
    NPROC_PER_NODE,
    TORCHRUN_TUNED_CONF,
    Job,
    ProbeLog,
    process_tree,
    terminate_like_ctrl_c,
    torchrun_command,
)
from training_recovery_bench import TINY_MODEL, Step, completed_steps, steps_redone  # noqa: E402

from launcher.etcd.server import free_port  # noqa: E402

logger = logging.getLogger("peer-bench")

WORKER = BENCH / "peer_worker.py"
SYSTEMS = ("elastic-run", "torchft", "nvrx")
PEER_MODULES = {"torchft": "torchft", "nvrx": "nvidia_resiliency_ext"}
INSTALL = "pip install torch==2.13.0 torchft==0.2.0 nvidia-resiliency-ext==0.4.1"
FAULTS = {"kill": "node SIGKILL", "stop": "node SIGSTOP", "crash": "worker SIGKILL"}
FULL_WORLD = NODES * NPROC_PER_NODE

# torchft, tuned for fast detection (its defaults: heartbeat timeout 5 s, join timeout 60 s, Manager and gloo
# timeouts 60 s; its README's Lighthouse: --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000). The
# Manager heartbeats every 100 ms (its default); a replica is dead after 10 missed heartbeats; a hung peer fails
# the all_reduce after the gloo timeout.
LIGHTHOUSE_FLAGS = ["--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "1000"]
LIGHTHOUSE_FLAGS += ["--heartbeat_timeout_ms", "1000"]
TORCHFT_WORKER_FLAGS = ["--gloo-timeout", "2", "--manager-timeout", "2", "--quorum-timeout", "15"]
TORCHFT_WORKER_FLAGS += ["--connect-timeout", "10"]
TORCHFT_TORCHRUN_FLAGS = ["--standalone", "--nproc-per-node", str(NPROC_PER_NODE), "--max-restarts", "10"]
# NVRx ft_launcher 0.4.1 (defaults: initial heartbeat timeout 60 min, then 45 min, checks every 5 s): a rank that
# sent no heartbeat for 2 s (10 s before its first) is killed with SIGKILL and its agent restarts the workers; no
# NIC monitor (no GPU, no InfiniBand here). The rendezvous is torchrun's c10d with recovery_bench's tuned conf.
NVRX_FLAGS = ["--ft-initial-rank-heartbeat-timeout", "10", "--ft-rank-heartbeat-timeout", "2"]
NVRX_FLAGS += ["--ft-workload-check-interval", "0.5", "--ft-enable-nic-monitor", "false"]
NVRX_CKPT_EVERY = 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, from {', '.join(SYSTEMS)}")
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, from {', '.join(FAULTS)}")
    parser.add_argument("--fault-step", type=int, default=25, help="steps the 6 ranks train before the fault")
    parser.add_argument("--deadline", type=float, default=60.0, help="seconds after the fault to wait (default 60)")
    parser.add_argument("--startup-timeout", type=float, default=120.0, help="seconds to reach --fault-step")
    parser.add_argument("--keep-logs", action="store_true", help="keep each scenario's directory and print its path")
    args = parser.parse_args(argv)
    args.systems = _subset(parser, "--systems", args.systems, SYSTEMS)
    args.faults = _subset(parser, "--faults", args.faults, tuple(FAULTS))
    return args


def _subset(parser: argparse.ArgumentParser, flag: str, spec: str, allowed: tuple[str, ...]) -> list[str]:
    chosen = [item.strip() for item in spec.split(",") if item.strip()]
    unknown = [item for item in chosen if item not in allowed]
    if unknown or not chosen:
        parser.error(f"{flag}: expected a comma-separated subset of {', '.join(allowed)}, got {spec!r}")
    return chosen


@dataclass
class Result:
    system: str
    fault: str
    seconds: float | None  # from the fault to the first step committed by a later configuration
    lost: int | None = None
    world_size: int | None = None
    rate: float | None = None  # steps per second of the full world before the fault
    note: str = ""


# -- elastic-run: bench/training_recovery_bench.py's scenario -------------------------------------------------


def run_elastic(fault: str, args: argparse.Namespace) -> Result:
    scenario_args = argparse.Namespace(
        fault_step=args.fault_step,
        startup_timeout=args.startup_timeout,
        deadline=args.deadline,
        keep_logs=args.keep_logs,
    )
    found = training_recovery_bench.run_scenario(fault, "elastic-run", scenario_args)
    return Result("elastic-run", fault, found.seconds, found.redone, found.world_size, None, found.note)


# -- the peers ------------------------------------------------------------------------------------------------


def worker_args(system: str, log: Path, workdir: Path, steps: int | None = None) -> list[str]:
    flags = TORCHFT_WORKER_FLAGS if system == "torchft" else ["--ckpt", str(workdir / "ckpt.pt")]
    if system == "nvrx":
        flags = [*flags, "--ckpt-every", str(NVRX_CKPT_EVERY)]
    if steps is not None:
        flags = [*flags, "--steps", str(steps)]
    return [str(WORKER), "--system", system, "--log", str(log), "--nodes", str(NODES), *flags, *TINY_MODEL]


def start_lighthouse(job: Job) -> tuple[subprocess.Popen, int]:
    """torchft's Lighthouse (not a node: no fault reaches it) and its port."""
    port = free_port()
    with open(job.workdir / "lighthouse.out", "wb") as output:
        lighthouse = subprocess.Popen(
            ["torchft_lighthouse", "--bind", f"127.0.0.1:{port}", *LIGHTHOUSE_FLAGS],
            stdout=output,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    return lighthouse, port


def start_torchft_group(job: Job, group: int, lighthouse_port: int, worker: list[str]) -> None:
    """One replica group as the next node of `job`: a torchrun of `worker` (worker_args). A replacement for a lost
    group takes its REPLICA_GROUP_ID, as a new host in the lost one's slot would."""
    environment = [
        "LOGLEVEL=INFO",
        f"REPLICA_GROUP_ID={group}",
        f"TORCHFT_LIGHTHOUSE=http://127.0.0.1:{lighthouse_port}",
    ]
    command = ["env", *environment, sys.executable, "-m", "torch.distributed.run", *TORCHFT_TORCHRUN_FLAGS]
    job.start_agent(len(job.agents), [*command, "--", *worker])


def start_nvrx_node(job: Job, store_port: int, worker: list[str], max_restarts: int = 3) -> None:
    """One ft_launcher agent as the next node of `job`; the first one hosts the c10d store."""
    node = len(job.agents)
    conf, log_dir = TORCHRUN_TUNED_CONF, job.log_dir(node)
    command = torchrun_command(node, store_port, job.rdzv_id, conf, log_dir, worker, max_restarts)
    assert command[1:3] == ["-m", "torch.distributed.run"]  # torchrun's flags, then `--` and the script
    script = command.index("--")
    launcher = [sys.executable, "-m", "nvidia_resiliency_ext.fault_tolerance.launcher"]
    job.start_agent(node, [*launcher, *command[3:script], *NVRX_FLAGS, *command[script:]])


def start_torchft(job: Job, log: Path) -> subprocess.Popen:
    """The Lighthouse (returned: it is not a node) and one torchrun per replica group."""
    lighthouse, port = start_lighthouse(job)
    for group in range(NODES):
        start_torchft_group(job, group, port, worker_args("torchft", log, job.workdir))
        time.sleep(0.5)
    return lighthouse


def start_nvrx(job: Job, log: Path) -> None:
    port = free_port()
    for _ in range(NODES):
        start_nvrx_node(job, port, worker_args("nvrx", log, job.workdir))
        time.sleep(0.5)  # join in order: node 0 hosts the c10d store, the faulted node is the last


def workers_of(agent: int) -> list[int]:
    """The training processes under `agent` (torchrun or ft_launcher start them as `python -u peer_worker.py`;
    ft_launcher's rank monitors carry the launcher's command line)."""
    found = []
    for pid in process_tree(agent)[1:]:
        try:
            parts = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(part.endswith(b"peer_worker.py") for part in parts[1:3]) and b"-m" not in parts[1:3]:
            found.append(pid)
    return sorted(found)


def with_rounds(system: str, records: list[dict], fault_time: float) -> list[dict]:
    """The committed steps, each with the configuration it belongs to as `round`: torchft's quorum id; under
    ft_launcher 1 for a worker started after the fault (a restart), else 0."""
    committed = [r for r in records if r["committed"]]
    if system == "torchft":
        return committed
    return [dict(r, round=int(r["started"] > fault_time)) for r in committed]


def steps_per_second(steps: list[Step]) -> float | None:
    full = [s for s in steps if s.world_size == FULL_WORLD][-20:]
    if len(full) < 2 or full[-1].time <= full[0].time:
        return None
    return (full[-1].step - full[0].step) / (full[-1].time - full[0].time)


def run_peer(system: str, fault: str, args: argparse.Namespace) -> Result:
    workdir = Path(tempfile.mkdtemp(prefix=f"peer-bench-{system}-{fault}-"))
    job = Job(system, workdir)
    log_path = workdir / "steps.jsonl"
    lighthouse = None
    try:
        if system == "torchft":
            lighthouse = start_torchft(job, log_path)
        else:
            start_nvrx(job, log_path)
        logger.info("  started %d %s nodes, logs in %s", NODES, system, workdir)
        log = ProbeLog(log_path)
        trained = wait_for_full_world(log, job, args)
        if trained is None:
            return Result(
                system, fault, None, note=f"the {FULL_WORLD}-rank world never trained {args.fault_step} steps"
            )
        rate = steps_per_second(completed_steps(with_rounds(system, log.collectives, time.time())))
        round_at_fault = max(r["round"] for r in log.collectives)
        if fault == "crash":
            worker = workers_of(job.agents[FAULTED_NODE].pid)[0]
            fault_time = time.time()
            os.kill(worker, signal.SIGKILL)
            logger.info("  SIGKILL worker pid %d of node%d", worker, FAULTED_NODE)
        else:
            fault_time = job.hit(FAULTED_NODE, signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
        first = wait_for_next(log, job, system, fault_time, round_at_fault, args.deadline)
        if first is None:
            note = f"no committed step in a later configuration within {args.deadline:.0f} s; " + agents_note(job)
            return Result(system, fault, None, rate=rate, note=note)
        full = None
        if fault == "crash" and first.world_size < FULL_WORLD:  # the restarted worker's group is not back yet
            full = wait_for_next(log, job, system, fault_time, round_at_fault, args.deadline, FULL_WORLD)
        log.read_new()
        return Result(
            system,
            fault,
            first.time - fault_time,
            lost_steps(system, log.collectives, fault_time, first),
            first.world_size,
            rate,
            describe(system, log.collectives, fault_time, round_at_fault, first, full, fault, args.deadline),
        )
    finally:
        job.stop()
        if lighthouse is not None:
            lighthouse.kill()
            lighthouse.wait()
        if args.keep_logs:
            logger.info("  kept logs in %s", workdir)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def wait_for_full_world(log: ProbeLog, job: Job, args: argparse.Namespace) -> Step | None:
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if log.read_new():
            full = [
                s
                for s in completed_steps(with_rounds(job.launcher, log.collectives, time.time()))
                if s.world_size == FULL_WORLD
            ]
            # 10 steps at full size too (a torchft quorum of 6 may form late): the step rate before the fault
            if len(full) >= 10 and full[-1].step >= args.fault_step:
                return full[-1]
        if job.running_agents() < NODES:
            return None
        time.sleep(0.1)
    return None


def wait_for_next(
    log: ProbeLog, job: Job, system: str, fault_time: float, after_round: int, deadline_s: float, world: int = 0
) -> Step | None:
    """The first step committed by every rank of a configuration after the fault's (of `world` ranks, if set)."""
    next_progress = time.time() + 15
    while time.time() < fault_time + deadline_s:
        log.read_new()
        later = [r for r in with_rounds(system, log.collectives, fault_time) if r["round"] > after_round]
        found = [s for s in completed_steps(later) if not world or s.world_size == world]
        if found:
            return found[0]
        if job.running_agents() == 0:
            return None
        if time.time() >= next_progress:
            logger.info(
                "  ... %.0f s after the fault, no committed step in a later configuration", time.time() - fault_time
            )
            next_progress += 15
        time.sleep(0.05)
    return None


def lost_steps(system: str, records: list[dict], fault_time: float, first: Step) -> int:
    if system == "torchft":  # dropped by should_commit() from the fault to the first step after it
        return len({r["step"] for r in records if not r["committed"] and fault_time <= r["time"] <= first.time})
    return len(steps_redone(with_rounds(system, records, fault_time), first))


def describe(
    system: str,
    records: list[dict],
    fault_time: float,
    round_at_fault: int,
    first: Step,
    full: Step | None,
    fault: str,
    deadline: float,
) -> str:
    before = [r["step"] for r in records if r["time"] <= fault_time and r["committed"]]
    parts = [f"fault at step {max(before, default=0)}; next committed step {first.step} at world {first.world_size}"]
    if system == "torchft":
        dropped = sorted({r["step"] for r in records if not r["committed"] and r["time"] >= fault_time})
        parts.append(f"quorum {round_at_fault} -> {first.round}")
        if dropped:
            parts.append(f"attempts dropped by should_commit after the fault (any group): {len(dropped)}")
    else:
        restarted = sorted({r["started"] for r in records if r["started"] > fault_time})
        if restarted:
            parts.append(f"workers restarted +{restarted[0] - fault_time:.2f} s")
    if full is not None:
        parts.append(f"world {FULL_WORLD} again +{full.time - fault_time:.2f} s")
    elif fault == "crash" and first.world_size < FULL_WORLD:
        parts.append(f"world {FULL_WORLD} not again within {deadline:.0f} s")
    return "; ".join(parts)


def agents_note(job: Job) -> str:
    parts = []
    for node, agent in enumerate(job.agents):
        code = agent.poll()
        parts.append(f"node{node} " + ("alive" if code is None else f"exited rc={code}"))
    return ", ".join(parts)


# -- the report -----------------------------------------------------------------------------------------------


def print_report(results: list[Result], args: argparse.Namespace) -> None:
    header = ("system", "fault", "s to next committed step", "steps lost", "world", "steps/s before", "note")
    rows = [header]
    for r in results:
        seconds = f"{r.seconds:.2f}" if r.seconds is not None else f"none in {args.deadline:.0f} s"
        rate = f"{r.rate:.1f}" if r.rate is not None else "-"
        lost = "-" if r.lost is None else str(r.lost)
        world = "-" if r.world_size is None else str(r.world_size)
        rows.append((r.system, f"{r.fault} ({FAULTS[r.fault]})", seconds, lost, world, rate, r.note))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    print()
    for row in rows:
        print(" | ".join(cell.ljust(width) for cell, width in zip(row, widths)) + " | " + row[-1])
    print()
    by_key = {(r.system, r.fault): r for r in results}
    for fault in args.faults:
        elastic = by_key.get(("elastic-run", fault))
        for system in (s for s in args.systems if s != "elastic-run"):
            peer = by_key.get((system, fault))
            if elastic is None or peer is None:
                continue
            if elastic.seconds is not None and peer.seconds is not None:
                print(f"{fault}: {system} / elastic-run = {peer.seconds / elastic.seconds:.1f}x", end="")
                print(f" ({peer.seconds:.2f} s vs {elastic.seconds:.2f} s)")
            else:
                print(f"{fault}: {system} {fmt(peer.seconds)}, elastic-run {fmt(elastic.seconds)}")
    print()
    print(f"model: examples/train.py {' '.join(TINY_MODEL)}, global batch 32 over {NODES} nodes x {NPROC_PER_NODE}")
    print("elastic-run: bench/training_recovery_bench.py's elastic-run variant (warm workers, --memory-every 1,")
    print("  disk checkpoint every 50 steps), --nnodes 2:3 --max-restarts 3, lease 1 s x 3")
    print(f"torchft 0.2.0: torchft_lighthouse {' '.join(LIGHTHOUSE_FLAGS)}; per replica group: torchrun")
    print(f"  {' '.join(TORCHFT_TORCHRUN_FLAGS)}; Manager(min_replica_size=1), heartbeat 100 ms (default),")
    print(f"  peer_worker.py {' '.join(TORCHFT_WORKER_FLAGS)} (seconds: ProcessGroupGloo and Manager timeouts)")
    print("nvidia-resiliency-ext 0.4.1: ft_launcher --nnodes 2:3 --max-restarts 3 --rdzv-backend c10d")
    print(f"  --rdzv-conf {TORCHRUN_TUNED_CONF} {' '.join(NVRX_FLAGS)};")
    print(f"  a heartbeat every step, a checkpoint (torch.save) every {NVRX_CKPT_EVERY} step(s) by rank 0")
    print()
    print(NOTES)


NOTES = """\
notes:
- torchft's survivors never stop: no worker restart, no new process group to build from scratch, no checkpoint
  to load; a dead or hung group is out of the next quorum once its heartbeats are 1 s late, and at most the step
  in flight is dropped. Where elastic-run restarts the survivors' workers (warm: no new interpreter, state from
  the snapshot in memory), torchft keeps them training, which is why it can be faster after a SIGSTOP here.
- torchft shrinks the batch with the quorum (each group keeps its share: 4 ranks train 22 of the 32 samples);
  elastic-run and this ft_launcher job re-split the global batch of 32 over the ranks left.
- torchft does not restart a dead group: here torchrun (--max-restarts) does, and the group heals from a live one
  ("world 6 again"); a lost node stays lost until something starts a replacement. Its Lighthouse is a single
  point of failure (elastic-run's etcd can be a 3-member cluster).
- Two torchft 0.2.0 problems found on CPU/gloo and worked around in bench/peer_worker.py: its DDP comm hook
  asserts (`assert fut._fut`) after a failed all_reduce, crashing every survivor; and a group restarted by
  torchrun can read its dead predecessor's manager address from torchrun's store and hang (a fresh TCPStore
  per incarnation here).
- ft_launcher (0.4.1) restarts every worker on every node, like torchrun: a failed rank is found within the
  heartbeat timeout (2 s here; SIGKILL of a node is seen at once by the survivors' gloo), but the c10d
  rendezvous, its health checks and a fresh interpreter per worker (imports, process group) take most of the
  time; its heartbeat timeouts can also be calculated from observed intervals (x 5) and kept across runs.
- steps/s is each system's own rate before the fault (peers unpaced; elastic-run runs examples/train.py with
  FSDP2 and a snapshot in memory every step, its rate is not measured by that scenario)."""


def fmt(seconds: float | None) -> str:
    return "none within the deadline" if seconds is None else f"{seconds:.2f} s"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = [s for s in args.systems if s in PEER_MODULES and importlib.util.find_spec(PEER_MODULES[s]) is None]
    if missing:
        print(f"peer_bench: {', '.join(missing)} not installed: {INSTALL} (or --systems elastic-run)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    signal.signal(signal.SIGTERM, terminate_like_ctrl_c)
    results: list[Result] = []
    try:
        for fault in args.faults:
            for system in args.systems:
                logger.info("%s, %s (%s) on node%d of %d:", system, fault.upper(), FAULTS[fault], FAULTED_NODE, NODES)
                result = run_elastic(fault, args) if system == "elastic-run" else run_peer(system, fault, args)
                logger.info("  -> %s; %s", fmt(result.seconds), result.note)
                results.append(result)
    except KeyboardInterrupt:
        logger.warning("interrupted: every process started was killed; results so far follow")
        print_report(results, args)
        return 130
    print_report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
