"""A worker under `elastic.run` for tests: in round 0, node b's rank posts a large receive and stops itself, and
node a's rank sends to it, so that gloo queues the send behind a peer that reads nothing: a wait no abort ends
(test_gloo_abort.py). In later rounds it trains a few steps of all_reduce and returns.

Each call of main appends a mark: round, node, pid, whether it re-entered in process."""

import argparse
import json
import logging
import os
import signal
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
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", force=True)  # elastic.rounds' own lines
    round_number = int(os.environ["ELASTIC_ROUND"])
    node = Path(os.environ["ELASTIC_HEARTBEAT_FILE"]).parts[-4]  # <log dir>/<node>/attempt_N/<local rank>/heartbeat
    with open(marks, "a") as log:
        log.write(json.dumps(dict(round=round_number, node=node, pid=os.getpid(), reentered=calls > 1)) + "\n")
    if round_number == 0:
        large = torch.zeros(512 << 20, dtype=torch.uint8)
        peer = 1 - dist.get_rank()
        posted = marks.with_name("posted")
        if node == "b":
            dist.irecv(large, src=peer)  # posted: a's send goes straight to the wire
            time.sleep(0.5)  # gloo's thread tells a that the receive is posted
            posted.touch()
            os.kill(os.getpid(), signal.SIGSTOP)  # reads nothing more: a's socket buffer fills, gloo queues the rest
        while not posted.exists():
            time.sleep(0.05)
        dist.send(large, dst=peer)  # node a: blocks behind the stopped peer, and the abort does not end it
    for step in range(5):
        dist.all_reduce(torch.ones(1))
        elastic.heartbeat(step)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--marks", type=Path, required=True)
    elastic.run(main, parser.parse_args().marks)
