"""A torchrun-style worker that takes its time to stop: on SIGTERM it sleeps, then exits 0.

Like examples/collective_probe.py it inits from the environment, all-reduces in a loop and appends one JSON line
per completed collective to --log; it also logs `sigterm` when the signal arrives and `sigterm_done` right before
it exits, so a test can tell that the whole grace was granted (a SIGKILL would leave no `sigterm_done`).
"""

import argparse
import json
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step-time", type=float, default=0.1)
    parser.add_argument("--sigterm-sleep", type=float, default=4.0)
    parser.add_argument("--log", required=True)
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    round_ = int(os.environ.get("ELASTIC_ROUND", "0"))
    log = open(args.log, "a")

    def write(**fields) -> None:
        entry = dict(
            time=time.time(),
            rank=rank,
            world_size=world_size,
            round=round_,
            pid=os.getpid(),
            node=os.environ.get("ELASTIC_TEST_NODE", ""),
            **fields,
        )
        log.write(json.dumps(entry) + "\n")
        log.flush()

    def on_sigterm(signum, frame) -> None:
        write(event="sigterm")
        time.sleep(args.sigterm_sleep)
        write(event="sigterm_done")
        os._exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    for step in range(args.steps):
        value = torch.ones(1) * (rank + 1)
        dist.all_reduce(value)
        if value.item() != world_size * (world_size + 1) / 2:
            raise RuntimeError(f"all_reduce gave {value.item()} in a world of {world_size}")
        write(event="collective", step=step)
        time.sleep(args.step_time)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
