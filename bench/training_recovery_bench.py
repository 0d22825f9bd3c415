"""Training recovery benchmark: seconds from a fault to the first training step after it, and the steps redone.

bench/recovery_bench.py times a collective probe; this one runs examples/train.py (a tiny model, a checkpoint on
disk every 50 steps) under elastic-run. For each fault, and for each of two configurations in one run on this
machine:

  elastic-run  warm workers, a snapshot in memory every step (--memory-every 1), a drain before planned changes
               (--drain-timeout 60, the default);
  baseline     the defaults before issue #9: --no-warm-workers, --memory-every 0 (disk checkpoints only) and
               --drain-timeout 0 (no drain);

  1. start a fresh etcd and 3 agents ("nodes") x 2 workers, --nnodes 2:3, --max-restarts 3, lease 1 s x 3
     (2 agents for scale-up);
  2. wait until the world has trained --fault-step steps (every rank logged the step);
  3. fault the LAST node (never node 0, round 0's rank 0), but for kill-controller:
       kill      SIGKILL its agent and every process under it (a dead host);
       kill-controller  the same on node 0, the controller's node and the round's store's host;
       stop      SIGSTOP the same (a hung host: only its lease running out tells);
       crash     SIGKILL one of its workers (the agent restarts the round);
       hang      SIGSTOP one of its workers (its agent lives; the progress watchdog, set to 5 s for this fault,
                 finds it and its blocked peers silent; it continues them for their stack dumps and kills them a
                 second later, so the world may train on a few steps meanwhile, which count as redone if the
                 next round starts from before them);
       preempt   SIGTERM its agent (a preemption notice: the workers drain, then the agent leaves);
       preempt-controller  the same on node 0, the controller's node;
       scale-up  start the 3rd agent while 2 train;
  4. measure the seconds from the fault to the first step completed by every rank of a round after the fault's
     round (from the `time` each rank writes into the sample log), the seconds until such a round completed
     the step the job had reached at the fault ("back": the steps redone cost time too), how long training
     paused (from the last step completed before that round to its first: for a scale-up, the cost of the
     change), that round's world size, and the steps redone: those logged in an earlier round at or past the
     step the new round resumed from, which it trains again.

Both configurations run in the same invocation, one scenario after the other, so that their ratio means
something on a machine whose load changes from minute to minute. Every figure printed is measured in this run.
A scenario's processes (stopped ones continued first), its etcd and its directory go when it ends, on Ctrl-C too.

    python bench/training_recovery_bench.py                      # all six faults, with the baseline
    python bench/training_recovery_bench.py --faults kill,crash,preempt,scale-up
    python bench/training_recovery_bench.py --faults hang --no-baseline --keep-logs
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))  # recovery_bench puts the repository on sys.path itself

from recovery_bench import (  # noqa: E402
    ELASTIC_RDZV_CONF,
    FAULTED_NODE,
    NODES,
    NPROC_PER_NODE,
    REPO,
    Job,
    ProbeLog,
    describe_event,
    elastic_run_command,
    last_exception,
    membership_events,
    terminate_like_ctrl_c,
)

from launcher.etcd.server import EtcdServer  # noqa: E402
from launcher.workers.process_tree import child_pids  # noqa: E402

logger = logging.getLogger("training-recovery-bench")

TRAIN = REPO / "examples" / "train.py"
TINY_MODEL = ["--seq-len", "16", "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--corpus-chars", "6000"]
CKPT_EVERY = 50
# far more than a scenario trains: the job must still be training when recovery is measured, and is then killed
STEPS = 100_000
# started first, it holds the controller key, round 0's group rank 0 and so the round's store: its peers find it
# gone (the controller's own probe cannot), and a standby takes the key before the round without it forms
CONTROLLER_NODE = 0

FAULTS = {
    "kill": "node SIGKILL",
    "kill-controller": "node0 SIGKILL",
    "stop": "node SIGSTOP",
    "crash": "worker SIGKILL",
    "hang": "worker SIGSTOP",
    "preempt": "agent SIGTERM",
    "preempt-controller": "node0 agent SIGTERM",
    "scale-up": "3rd node joins",
}
VARIANTS = {
    "elastic-run": ([], ["--memory-every", "1"]),
    "baseline": (["--no-warm-workers", "--drain-timeout", "0"], ["--memory-every", "0"]),
}
VARIANT_NAMES = {
    "elastic-run": "elastic-run (warm, memory every step, drain)",
    "baseline": "baseline (cold, disk only, no drain)",
}
# The watchdog's default least allowance (--watchdog-min 60) would make the hang fault a minute of waiting; with
# 5 s (and `auto`: at least 10x the slowest recent step) a stopped worker is found in seconds, while a slow step
# on a loaded machine is not taken for a hang (a memory snapshot is part of its step, not a long operation). Only
# the hang fault needs this: the others keep the watchdog's defaults.
HANG_WATCHDOG = ["--watchdog-timeout", "auto", "--watchdog-min", "5"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, from {', '.join(FAULTS)}")
    parser.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run every fault with the defaults before issue #9 (default: yes)",
    )
    parser.add_argument(
        "--fault-step",
        type=int,
        default=25,
        help=f"the step every rank has trained before the fault (default 25: halfway between the disk checkpoints "
        f"every {CKPT_EVERY}, which a fault that lands a few steps late on a loaded machine does not cross)",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=120.0,
        help="seconds after the fault to wait for a step in a later round (default 120)",
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=180.0,
        help="seconds allowed for the first world to train --fault-step steps (default 180)",
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep each scenario's directory and print its path")
    args = parser.parse_args(argv)
    args.faults = [fault.strip() for fault in args.faults.split(",") if fault.strip()]
    unknown = [fault for fault in args.faults if fault not in FAULTS]
    if unknown or not args.faults:
        parser.error(f"--faults: expected a comma-separated subset of {', '.join(FAULTS)}, got {unknown or 'none'}")
    args.variants = list(VARIANTS) if args.baseline else ["elastic-run"]
    return args


# -- one scenario's job --------------------------------------------------------------------------------------


def start_node(job: Job, node: int, rdzv_id: str, variant: str, fault: str) -> None:
    """Start agent `node` of `job` (recovery_bench's command line, running examples/train.py)."""
    launcher_flags, train_flags = VARIANTS[variant]
    if fault == "hang":
        launcher_flags = [*launcher_flags, *HANG_WATCHDOG]
    train_args = [
        "--steps",
        str(STEPS),
        "--ckpt-dir",
        str(job.workdir / "ckpt"),
        "--ckpt-every",
        str(CKPT_EVERY),
        "--sample-log",
        str(sample_log(job)),
        *train_flags,
        *TINY_MODEL,
    ]
    assert job.etcd is not None  # started before any node
    command = elastic_run_command(
        node,
        job.etcd.endpoint,
        rdzv_id,
        job.log_dir(node),
        [*launcher_flags, str(TRAIN), *train_args],
        warm=variant == "elastic-run",
    )
    job.start_agent(node, command)


def sample_log(job: Job) -> Path:
    return job.workdir / "samples.jsonl"


def signal_worker(job: Job, node: int, signum: int) -> float:
    """Send `signum` to one worker of `node` (its agent lives on); returns the time of the fault."""
    worker = child_pids(job.agents[node].pid)[0]  # seen through its supervisor; waiting warm interpreters left out
    fault_time = time.time()
    os.kill(worker, signum)
    logger.info("  %s worker pid %d of node%d", signal.Signals(signum).name, worker, node)
    return fault_time


def faulted_node(fault: str) -> int:
    return CONTROLLER_NODE if fault in ("kill-controller", "preempt-controller") else FAULTED_NODE


def apply_fault(job: Job, fault: str, rdzv_id: str, variant: str) -> float:
    """Fault the last node (node 0 for kill-controller); returns the time of the fault."""
    if fault in ("kill", "kill-controller"):
        return job.hit(faulted_node(fault), signal.SIGKILL)
    if fault == "stop":
        return job.hit(FAULTED_NODE, signal.SIGSTOP)
    if fault == "crash":
        return signal_worker(job, FAULTED_NODE, signal.SIGKILL)
    if fault == "hang":
        return signal_worker(job, FAULTED_NODE, signal.SIGSTOP)
    if fault in ("preempt", "preempt-controller"):
        node = faulted_node(fault)
        fault_time = time.time()
        os.kill(job.agents[node].pid, signal.SIGTERM)
        logger.info("  SIGTERM agent pid %d of node%d", job.agents[node].pid, node)
        return fault_time
    fault_time = time.time()
    start_node(job, FAULTED_NODE, rdzv_id, variant, fault)
    logger.info("  started node%d (agent pid %d)", FAULTED_NODE, job.agents[FAULTED_NODE].pid)
    return fault_time


# -- reading the sample log ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """A step every rank of its round's world logged."""

    round: int
    step: int
    world_size: int
    time: float  # when its last rank logged it


def completed_steps(records: list[dict]) -> list[Step]:
    """The steps every rank of their world logged, in the order they completed."""
    ranks: dict[tuple[int, int], set[int]] = {}
    latest: dict[tuple[int, int], dict] = {}
    for record in records:
        key = (record["round"], record["step"])
        ranks.setdefault(key, set()).add(record["rank"])
        if key not in latest or record["time"] > latest[key]["time"]:
            latest[key] = record
    done = [
        Step(round_, step, latest[(round_, step)]["world_size"], latest[(round_, step)]["time"])
        for (round_, step), seen in ranks.items()
        if len(seen) == latest[(round_, step)]["world_size"]
    ]
    return sorted(done, key=lambda s: s.time)


def wait_for_training(log: ProbeLog, job: Job, world_size: int, steps: int, timeout: float) -> Step | None:
    """The first step at or past `steps` completed by a world of `world_size`, or None if none came in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.read_new():
            found = [s for s in completed_steps(log.collectives) if s.world_size == world_size and s.step >= steps]
            if found:
                return found[0]
        if job.running_agents() < len(job.agents):
            return None
        time.sleep(0.1)
    return None


def wait_for_recovery(
    log: ProbeLog, job: Job, fault_time: float, after_round: int, deadline_s: float, from_step: int = 0
) -> Step | None:
    """The first step (at or past `from_step`) completed in a round after `after_round`, or None within
    `deadline_s` of the fault."""
    next_progress = time.time() + 15
    unread = True  # what the log already holds counts too: the step may have been read by an earlier wait
    while time.time() < fault_time + deadline_s:
        if log.read_new() or unread:
            unread = False
            found = [s for s in completed_steps(log.collectives) if s.round > after_round and s.step >= from_step]
            if found:
                return found[0]
        if job.running_agents() == 0:
            return None
        if time.time() >= next_progress:
            logger.info("  ... %.0f s after the fault, no step in a later round yet", time.time() - fault_time)
            next_progress += 15
        time.sleep(0.05)
    return None


def steps_redone(records: list[dict], first: Step) -> list[int]:
    """Steps logged (by any rank) in a round before `first`'s at or past `first.step`: its round trains them
    again. A rank that died mid-step may have logged none of it; its peers' records of that step still count."""
    return sorted({r["step"] for r in records if r["round"] < first.round and r["step"] >= first.step})


# -- one scenario --------------------------------------------------------------------------------------------


@dataclass
class Result:
    fault: str
    variant: str
    seconds: float | None
    back: float | None = None  # from the fault until a later round completed the step the job had reached
    paused: float | None = None  # from the last step before the new round to its first: how long nothing trained
    redone: int | None = None
    world_size: int | None = None
    note: str = ""


def run_scenario(fault: str, variant: str, args: argparse.Namespace) -> Result:
    workdir = Path(tempfile.mkdtemp(prefix=f"training-recovery-bench-{variant}-{fault}-"))
    job = Job(variant, workdir)
    rdzv_id = job.rdzv_id
    nodes = NODES - 1 if fault == "scale-up" else NODES
    try:
        etcd_dir = workdir / "etcd"  # inside the scenario directory, so it goes with it
        etcd_dir.mkdir()
        job.etcd = EtcdServer(data_dir=str(etcd_dir)).start()
        for node in range(nodes):
            start_node(job, node, rdzv_id, variant, fault)
            time.sleep(0.5)  # join in order: the faulted node is the last, never round 0's rank 0
        logger.info("  started %d agents, logs in %s", nodes, workdir)
        log = ProbeLog(sample_log(job))
        trained = wait_for_training(log, job, nodes * NPROC_PER_NODE, args.fault_step, args.startup_timeout)
        if trained is None:
            why = f"the {nodes * NPROC_PER_NODE}-worker world never trained {args.fault_step} steps"
            return Result(fault, variant, None, note=f"{why}; {agents_note(job)}")
        log.read_new()
        round_at_fault = max(r["round"] for r in log.collectives)
        logger.info(
            "  world of %d trained step %d (round %d); faulting", trained.world_size, trained.step, round_at_fault
        )
        fault_time = apply_fault(job, fault, rdzv_id, variant)
        first = wait_for_recovery(log, job, fault_time, round_at_fault, args.deadline)
        survivor = 1 if faulted_node(fault) == 0 else 0
        events = membership_events(job, fault_time, first.world_size if first else 0, wait_s=1.0, survivor=survivor)
        for event in events:
            logger.info("    %s", describe_event(event, fault_time))
        if first is None:
            return Result(
                fault,
                variant,
                None,
                note=f"no step in a later round within {args.deadline:.0f} s; {agents_note(job)}",
            )
        log.read_new()
        redone = steps_redone(log.collectives, first)
        # the ranks trained on while we read the log and found the processes to signal: where they were at the fault
        before = [r["step"] for r in log.collectives if r["round"] == round_at_fault and r["time"] <= fault_time]
        step_at_fault = max(before, default=trained.step)
        # the steps redone cost time too: when the job was back where the fault found it
        back = wait_for_recovery(log, job, fault_time, round_at_fault, args.deadline, from_step=step_at_fault)
        # detection and rendezvous up to here, the workers' start-up, checkpoint load and first step after it
        started = next((e for e in events if e["event"] == "round_started" and e.get("round") == first.round), None)
        last_before = max(s.time for s in completed_steps(log.collectives) if s.round < first.round)
        return Result(
            fault,
            variant,
            first.time - fault_time,
            back.time - fault_time if back else None,
            first.time - last_before,
            len(redone),
            first.world_size,
            f"fault at step {step_at_fault} (round {round_at_fault}); round {first.round} "
            + (f"started +{started['time'] - fault_time:.2f} s, " if started else "")
            + f"resumed at step {first.step}"
            + (f", redoing {redone[0]}..{redone[-1]}" if redone else ""),
        )
    finally:
        job.stop()
        if args.keep_logs:
            logger.info("  kept logs in %s", workdir)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def agents_note(job: Job) -> str:
    """What each agent came to: its exit code and the last exception it printed, or alive with N workers."""
    parts = []
    for node, agent in enumerate(job.agents):
        code = agent.poll()
        if code is None:
            parts.append(f"node{node} alive with {len(child_pids(agent.pid))} worker(s)")
        else:
            output = job.agent_output(node).read_text(errors="replace")
            parts.append(f"node{node} exited rc={code} ({last_exception(output)})")
    return "; ".join(parts)


# -- the report ----------------------------------------------------------------------------------------------


def print_report(results: list[Result], args: argparse.Namespace) -> None:
    header = ["fault", *(VARIANT_NAMES[v] + ": s / back / paused / redone / world" for v in args.variants)]
    if len(args.variants) > 1:
        header += ["back: baseline / elastic-run", "paused: baseline / elastic-run"]
    rows = [header]
    variants = len(args.variants)
    for position, fault in enumerate(args.faults):  # a fault named twice is two scenarios: a row each
        ran: list[Result | None] = list(results[position * variants : (position + 1) * variants])
        if not ran:
            continue
        found = ran + [None] * (variants - len(ran))
        row = [f"{fault} ({FAULTS[fault]})", *(cell(r, args.deadline) for r in found)]
        if len(args.variants) > 1:
            row += [ratio(*(r.back if r else None for r in found)), ratio(*(r.paused if r else None for r in found))]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    print()
    for row in rows:
        print(" | ".join(text.ljust(width) for text, width in zip(row, widths)).rstrip())
    print()
    for result in results:
        print(f"{result.fault}, {result.variant}: {result.note}")
    print(f"\nelastic-run --nnodes {NODES - 1}:{NODES} --nproc-per-node {NPROC_PER_NODE} --max-restarts 3 ", end="")
    print(f"--rdzv-conf {ELASTIC_RDZV_CONF}")
    print(f"examples/train.py {' '.join(TINY_MODEL)} --ckpt-every {CKPT_EVERY}; the fault at step {args.fault_step}")
    for variant in args.variants:
        launcher_flags, train_flags = VARIANTS[variant]
        print(f"  {variant}: elastic-run {' '.join(launcher_flags) or '(defaults)'}; train.py {' '.join(train_flags)}")
    if "hang" in args.faults:
        print(f"  the hang fault, in every configuration, adds: elastic-run {' '.join(HANG_WATCHDOG)}")


def cell(result: Result | None, deadline: float) -> str:
    if result is None:
        return "-"
    if result.seconds is None:
        return f"none in {deadline:.0f} s"
    back = "-" if result.back is None else f"{result.back:.2f} s"
    return f"{result.seconds:.2f} s / {back} / {result.paused:.2f} s / {result.redone} / {result.world_size}"


def ratio(elastic: float | None, baseline: float | None) -> str:
    if elastic is None or baseline is None:
        return "-"
    return f"{baseline / elastic:.1f}x"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    signal.signal(signal.SIGTERM, terminate_like_ctrl_c)
    results: list[Result] = []
    try:
        for fault in args.faults:
            for variant in args.variants:
                node = faulted_node(fault)
                logger.info("%s, %s (%s) on node%d of %d:", variant, fault.upper(), FAULTS[fault], node, NODES)
                result = run_scenario(fault, variant, args)
                logger.info("  -> %s; %s", cell(result, args.deadline), result.note)
                results.append(result)
    except KeyboardInterrupt:
        logger.warning("interrupted: every process started was killed; results so far follow")
        print_report(results, args)
        return 130
    print_report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
