"""A plain torchrun-style worker: all-reduce in a loop, one JSON line per completed collective.

It uses only what torchrun gives a script (`init_process_group()` from the environment), so the same file runs
under torchrun and elastic-run. The recovery benchmark and the launcher's tests read its log to see when a
smaller or larger world trained again. It calls `elastic.heartbeat` once per step, for elastic-run's progress
watchdog: a no-op under torchrun, and a local no-op where the elastic library is not installed.

    elastic-run --standalone --nproc-per-node 2 examples/collective_probe.py --steps 20 --log /tmp/probe.jsonl
"""

import argparse
import contextlib
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

try:
    from elastic import heartbeat, long_operation
    from elastic import run as run_in_rounds
except ImportError:  # run standalone, without the elastic library: nothing watches progress
    from contextlib import nullcontext as long_operation  # type: ignore[assignment]

    def heartbeat(step: int | None = None) -> None:
        pass

    def run_in_rounds(main, *args):  # type: ignore[misc]  # elastic.run's fallback: main once
        return main(*args)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="collectives to complete before exiting 0")
    parser.add_argument("--step-time", type=float, default=0.2, help="seconds of 'compute' between collectives")
    parser.add_argument("--log", default=None, help="append one JSON line per completed collective here")
    parser.add_argument(
        "--stop-file",
        default=None,
        help="end early, every rank after the same collective, once this file exists (for tests that end a job "
        "when they have seen enough)",
    )
    parser.add_argument(
        "--inprocess",
        action="store_true",
        help="run under elastic.run: a new round that keeps this worker's node re-enters main in this process",
    )
    parser.add_argument(
        "--long-operation",
        default=None,
        help="run each step's collective inside elastic.long_operation(NAME), as a checkpoint save's are",
    )
    parser.add_argument(
        "--startup-long-operation",
        default=None,
        help="begin each round inside elastic.long_operation(NAME): --startup-time seconds, then a collective, as a "
        "checkpoint load's gather",
    )
    parser.add_argument(
        "--startup-time", type=float, default=0.3, help="seconds of that start-up before its collective"
    )
    parser.add_argument("--fail-rank", type=int, default=None, help="this rank raises at --fail-step ...")
    parser.add_argument("--fail-step", type=int, default=3)
    parser.add_argument("--fail-restarts", type=int, default=1, help="... while TORCHELASTIC_RESTART_COUNT < this")
    return parser.parse_args()


@record
def main() -> None:
    args = parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    round_ = int(os.environ.get("ELASTIC_ROUND", "0"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    if args.startup_long_operation:
        with long_operation(args.startup_long_operation):
            time.sleep(args.startup_time)
            dist.barrier()
    log = open(args.log, "a") if args.log else None
    completed = 0
    for step in range(args.steps):
        if rank == args.fail_rank and step == args.fail_step and restarts < args.fail_restarts:
            raise RuntimeError(f"injected failure at step {step} on rank {rank} (restart {restarts})")
        stop_seen = bool(args.stop_file) and os.path.exists(args.stop_file)
        value = torch.tensor([rank + 1.0, float(stop_seen)])
        with long_operation(args.long_operation) if args.long_operation else contextlib.nullcontext():
            dist.all_reduce(value)  # the second element: whether any rank saw the stop file, so all stop together
        if value[0].item() != world_size * (world_size + 1) / 2:
            raise RuntimeError(f"all_reduce gave {value[0].item()} in a world of {world_size}")
        if log:
            entry = dict(
                time=time.time(),
                rank=rank,
                world_size=world_size,
                round=round_,
                restarts=restarts,
                step=step,
                pid=os.getpid(),
                master_port=int(os.environ["MASTER_PORT"]),
            )
            log.write(json.dumps(entry) + "\n")
            log.flush()
        heartbeat(step)
        completed = step + 1
        if value[1].item():
            break
        time.sleep(args.step_time)
    dist.destroy_process_group()
    print(f"rank {rank}/{world_size} done after {completed} collectives", file=sys.stderr)


if __name__ == "__main__":
    if "--inprocess" in sys.argv[1:]:
        run_in_rounds(main)
    else:
        main()
