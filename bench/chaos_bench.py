"""Chaos benchmark: a stream of faults against examples/train.py under elastic-run, next to the same job without
faults in the same invocation.

Both runs: a fresh etcd and --nodes agents x --nproc workers (--nnodes N-1:N, --max-restarts 1000, lease 1 s x 3,
last call 3 s) training --steps steps of the tiny model (global batch 24, a checkpoint on disk every 50 steps).
In the chaos run, once training started, one fault every --fault-every seconds, cycling through --kinds:

  kill   SIGKILL a node's agent and every process under it;
  stop   SIGSTOP the same, SIGKILLed 10 s later (a hung host that is then rebooted);
  crash  SIGKILL one training worker;
  hang   SIGSTOP one training worker (the progress watchdog, --watchdog-min, finds it);
  term   SIGTERM a node's agent (a preemption notice: it drains and leaves).

A node that is gone is replaced --rejoin-after seconds later by a new agent with a new node id (a scale-up).
The victim is drawn (--seed) among the nodes that run. Then, from the sample log each rank writes:

  goodput      the fault-free run's seconds from its first completed step to its last, over the chaos run's;
  pauses       every gap between two completed steps longer than 5 x the fault-free median step (at least 1 s),
               with the faults and joins that came in it;
  redone       steps completed more than once (a new round resumed from before them);
  differ       steps whose samples (all ranks together) are not the fault-free run's;
  loss_rel     the largest relative difference of a step's loss from the fault-free run's.

It prints one JSON line, then a table of the pauses.

    python bench/chaos_bench.py                                   # 400 steps, a fault every 15 s, all kinds
    python bench/chaos_bench.py --kinds kill,crash --fault-every 10 --watchdog-min 10
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))  # recovery_bench puts the repository on sys.path itself

from recovery_bench import (  # noqa: E402
    Job,
    process_tree,
    signal_groups_of,
    terminate_like_ctrl_c,
)
from training_recovery_bench import TINY_MODEL, TRAIN, completed_steps  # noqa: E402

from launcher.etcd.server import EtcdServer  # noqa: E402
from launcher.workers.process_tree import child_pids  # noqa: E402

logger = logging.getLogger("chaos-bench")

KINDS = ("kill", "stop", "crash", "hang", "term")
STOPPED_UNTIL_KILL_S = 10.0
RDZV_CONF = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=3"


@dataclass
class Change:
    """A fault, or a replacement node joining, at unix time `at`."""

    at: float
    what: str


@dataclass
class Run:
    job: Job
    args: argparse.Namespace
    changes: list[Change] = field(default_factory=list)

    @property
    def samples(self) -> Path:
        return self.job.workdir / "samples.jsonl"

    def start_node(self) -> int:
        node = len(self.job.agents)
        assert self.job.etcd is not None, "started before any node"
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
            self.job.etcd.endpoint,
            "--rdzv-id",
            self.job.rdzv_id,
            "--rdzv-conf",
            RDZV_CONF,
            "--max-restarts",
            "1000",
            "--watchdog-min",
            str(self.args.watchdog_min),
            "--node-id",
            f"node{node}",
            "--log-dir",
            str(self.job.log_dir(node)),
            str(TRAIN),
            "--steps",
            str(self.args.steps),
            "--global-batch",
            "24",
            "--ckpt-dir",
            str(self.job.workdir / "ckpt"),
            "--ckpt-every",
            "50",
            "--sample-log",
            str(self.samples),
            *TINY_MODEL,
        ]
        self.job.start_agent(node, command)
        return node

    def records(self) -> list[dict]:
        if not self.samples.is_file():
            return []
        return [json.loads(line) for line in self.samples.read_text().splitlines() if line.strip()]


def run_job(workdir: Path, args: argparse.Namespace, chaos: bool) -> Run:
    job = Job(launcher="elastic-run", workdir=workdir)
    (workdir / "etcd").mkdir(parents=True)
    job.etcd = EtcdServer(data_dir=str(workdir / "etcd")).start()
    run = Run(job, args)
    try:
        for _ in range(args.nodes):
            run.start_node()
        if chaos:
            _stream_of_faults(run, args)
        else:
            _wait_for_the_end(run, time.monotonic() + args.deadline)
    finally:
        job.stop()
    return run


def _wait_for_the_end(run: Run, deadline: float) -> None:
    while time.monotonic() < deadline:
        if run.job.running_agents() == 0:
            return
        time.sleep(0.5)
    logger.warning("  the job did not end within --deadline %.0f s", run.args.deadline)


def _stream_of_faults(run: Run, args: argparse.Namespace) -> None:
    """One fault every --fault-every s once training started; gone nodes replaced --rejoin-after s later."""
    rng = random.Random(args.seed)
    kinds = args.kinds
    deadline = time.monotonic() + args.deadline
    while not completed_steps(run.records()) and time.monotonic() < deadline:
        time.sleep(0.2)
    next_fault = time.time() + args.fault_every
    faulted: set[int] = set()  # nodes hit whole (gone, stopped or leaving): no second fault for them
    to_kill: dict[int, float] = {}  # stopped node -> when it gets SIGKILL
    leaving: set[int] = set()  # SIGTERMed agents, replaced once they exited
    joins: list[float] = []  # when replacements start
    count = 0
    while run.job.running_agents() and time.monotonic() < deadline:
        now = time.time()
        for node, at in list(to_kill.items()):
            if now >= at:
                signal_groups_of(process_tree(run.job.agents[node].pid), signal.SIGKILL)
                del to_kill[node]
                joins.append(now + args.rejoin_after)
        for node in list(leaving):
            if run.job.agents[node].poll() is not None:
                leaving.discard(node)
                joins.append(now + args.rejoin_after)
        for at in [at for at in joins if now >= at]:
            joins.remove(at)
            node = run.start_node()
            run.changes.append(Change(now, f"node{node} joins"))
        if now >= next_fault:
            live = [n for n, agent in enumerate(run.job.agents) if agent.poll() is None and n not in faulted]
            kind = kinds[count % len(kinds)]
            if live and _fault(run, kind, rng.choice(live), faulted, to_kill, leaving, joins, args):
                count += 1
            next_fault = now + (args.fault_every if live else 1.0)
        time.sleep(0.1)


def _fault(run: Run, kind: str, node: int, faulted: set, to_kill: dict, leaving: set, joins: list, args) -> bool:
    """Apply fault `kind` to `node`; False when it found nothing to fault (a node between rounds has no worker)."""
    agent = run.job.agents[node]
    now = time.time()
    if kind in ("crash", "hang"):
        workers = child_pids(agent.pid)
        if not workers:
            return False
        signal_groups_of([workers[0]], signal.SIGKILL if kind == "crash" else signal.SIGSTOP)
    elif kind == "term":
        agent.send_signal(signal.SIGTERM)
        faulted.add(node)
        leaving.add(node)
    else:
        signal_groups_of(process_tree(agent.pid), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        faulted.add(node)
        if kind == "kill":
            joins.append(now + args.rejoin_after)
        else:
            to_kill[node] = now + STOPPED_UNTIL_KILL_S
    run.changes.append(Change(now, f"{kind} node{node}"))
    logger.info("  %s node%d", kind, node)
    return True


# -- what the sample logs say ------------------------------------------------------------------------------------


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


def compare(free: Run, chaos: Run) -> dict:
    free_steps, chaos_steps = completed_steps(free.records()), completed_steps(chaos.records())
    free_s = free_steps[-1].time - free_steps[0].time
    chaos_s = chaos_steps[-1].time - chaos_steps[0].time
    median = statistics.median(b.time - a.time for a, b in zip(free_steps, free_steps[1:]))
    long_gap = max(1.0, 5 * median)
    pauses: list[dict[str, Any]] = []
    for before, after in zip(chaos_steps, chaos_steps[1:]):
        if after.time - before.time > long_gap:
            causes = [c.what for c in chaos.changes if before.time - 1.0 <= c.at <= after.time]
            pauses.append({"s": round(after.time - before.time, 2), "after_step": before.step, "causes": causes})
    expected, got = step_samples(free.records()), step_samples(chaos.records())
    differ = sorted(step for step in expected if got.get(step, ([], 0.0))[0] != expected[step][0])
    loss_rel = max(
        (abs(got[s][1] - loss) / abs(loss) for s, (_, loss) in expected.items() if s in got and loss),
        default=None,
    )
    faults = [c.what.split()[0] for c in chaos.changes if not c.what.endswith("joins")]
    return {
        "goodput": round(free_s / chaos_s, 3),
        "fault_free_s": round(free_s, 1),
        "chaos_s": round(chaos_s, 1),
        "faults": {kind: faults.count(kind) for kind in KINDS if kind in faults},
        "joins": sum(c.what.endswith("joins") for c in chaos.changes),
        "steps": len(expected),
        "steps_missing": sorted(set(expected) - set(got)),
        "redone": len(chaos_steps) - len({s.step for s in chaos_steps}),
        "differ": differ,
        "loss_rel": loss_rel,
        "longest_pause_s": max((float(p["s"]) for p in pauses), default=0.0),
        "pauses": pauses,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    parser.add_argument("--fault-every", type=float, default=15.0, help="seconds between faults (default 15)")
    parser.add_argument("--rejoin-after", type=float, default=5.0, help="seconds until a gone node is replaced")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"faults, cycled (default {','.join(KINDS)})")
    parser.add_argument("--steps", type=int, default=400, help="steps to train (default 400)")
    parser.add_argument("--seed", type=int, default=0, help="draws the victims (default 0)")
    parser.add_argument("--nodes", type=int, default=3, help="agents (default 3)")
    parser.add_argument("--nproc", type=int, default=2, help="workers per agent (default 2)")
    parser.add_argument("--watchdog-min", type=float, default=3.0, help="elastic-run's --watchdog-min (default 3)")
    parser.add_argument("--deadline", type=float, default=900.0, help="seconds allowed per run (default 900)")
    parser.add_argument("--keep-logs", action="store_true", help="keep both runs' directories")
    args = parser.parse_args(argv)
    args.kinds = [kind.strip() for kind in args.kinds.split(",") if kind.strip()]
    unknown = sorted(set(args.kinds) - set(KINDS))
    if unknown or not args.kinds:
        parser.error(f"--kinds: unknown {unknown}; choose from {','.join(KINDS)}")
    if args.nodes < 2:
        parser.error("--nodes: at least 2 (the job goes on with N-1)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    signal.signal(signal.SIGTERM, terminate_like_ctrl_c)
    root = Path(tempfile.mkdtemp(prefix="chaos-bench-"))
    try:
        logger.info("fault-free run (%d steps)", args.steps)
        free = run_job(root / "fault-free", args, chaos=False)
        logger.info("chaos run: a fault every %.0f s (%s)", args.fault_every, ",".join(args.kinds))
        chaos = run_job(root / "chaos", args, chaos=True)
        result = compare(free, chaos)
    finally:
        if args.keep_logs:
            logger.info("kept %s", root)
        else:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result), flush=True)
    print(f"\n{'pause s':>8} | after step | causes")
    for pause in result["pauses"]:
        print(f"{pause['s']:8.2f} | {pause['after_step']:10d} | {', '.join(pause['causes']) or '-'}")
    print(
        f"\ngoodput {result['goodput']} ({result['fault_free_s']} s fault-free, {result['chaos_s']} s with "
        f"{sum(result['faults'].values())} faults and {result['joins']} joins); steps redone {result['redone']}, "
        f"steps whose samples differ {len(result['differ'])}, largest relative loss difference {result['loss_rel']}"
    )
    return 0 if not result["steps_missing"] else 1


if __name__ == "__main__":
    sys.exit(main())
