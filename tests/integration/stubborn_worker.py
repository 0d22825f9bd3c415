"""A worker under `elastic.run` for tests: trains with all_reduce and heartbeats; with STUBBORN unset or 1, local
rank 0 of node a in round 0 never returns to either, so it cannot unwind when the next round is offered.

Each call of main appends a mark: round, node, pid, whether it re-entered in process, whether it is stubborn."""

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import elastic

calls = 0


def main(marks: Path) -> None:
    global calls
    calls += 1
    dist.init_process_group("gloo")
    round_number = int(os.environ["ELASTIC_ROUND"])
    node = Path(os.environ["ELASTIC_HEARTBEAT_FILE"]).parts[-4]  # <log dir>/<node>/attempt_N/<local rank>/heartbeat
    stubborn = (
        os.environ.get("STUBBORN", "1") == "1" and round_number == 0 and node == "a" and os.environ["LOCAL_RANK"] == "0"
    )
    mark = dict(round=round_number, node=node, pid=os.getpid(), reentered=calls > 1, stubborn=stubborn)
    with open(marks, "a") as log:
        log.write(json.dumps(mark) + "\n")
    if stubborn:
        while True:
            time.sleep(0.1)  # neither a heartbeat nor a collective: nothing raises RoundChanged here
    steps = 20 if round_number > 0 else 10**6
    for step in range(steps):
        dist.all_reduce(torch.ones(1))
        elastic.heartbeat(step)
        time.sleep(0.1)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--marks", type=Path, required=True)
    elastic.run(main, parser.parse_args().marks)
