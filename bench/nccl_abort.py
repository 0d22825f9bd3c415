"""What aborting an NCCL collective does, as `elastic.run` aborts one when a new round is offered (needs a GPU).

Two ranks on GPU 0, each a host of its own to NCCL (`NCCL_HOSTID`: NCCL refuses two ranks of one communicator
on one GPU of one host), traffic through sockets on `lo`. After an `all_reduce` both join, rank 1 stops joining;
2 s into rank 0's next `all_reduce` a thread calls `elastic.process_groups.abort_all()`. Rank 0 prints whether
that collective returned or raised and when, how long the abort itself took, whether the next collective raised,
how long destroying the group took, and how long a new group of one took to form and reduce in the same process.

    python bench/nccl_abort.py

On an H100 with torch 2.11 and NCCL 2.28.9 (this script's first form, the one run so far): the blocked
`all_reduce` returned without an error at the abort, the next collective raised `DistBackendError` 0.55 s after
it, the group was destroyed in 0.00 s and a new one reduced in 0.03 s (see `elastic.process_groups.aborts`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from elastic import process_groups  # noqa: E402
from launcher.etcd.server import free_port  # noqa: E402

ABORT_AFTER_S = 2.0


def collective(tensor: torch.Tensor) -> None:
    dist.all_reduce(tensor)
    torch.cuda.synchronize()


def rank_main(rank: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        NCCL_HOSTID=f"nccl-abort-{rank}",
        NCCL_SOCKET_IFNAME="lo",
        TORCH_NCCL_ASYNC_ERROR_HANDLING="1",  # as torchrun and elastic-run give workers
    )
    process_groups.track_group_sockets()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    tensor = torch.ones(4, device=device)
    collective(tensor)
    if rank == 1:
        time.sleep(4 * ABORT_AFTER_S)  # joins nothing more, as a stopped peer would
        os._exit(0)
    aborted_at: list[float] = []

    def abort() -> None:
        aborted_at.append(time.monotonic())
        process_groups.abort_all()
        print(f"abort_all returned in {time.monotonic() - aborted_at[0]:.2f}s", flush=True)

    threading.Timer(ABORT_AFTER_S, abort).start()
    began = time.monotonic()
    try:
        collective(tensor)
        print(f"the blocked all_reduce returned without error after {time.monotonic() - began:.2f}s", flush=True)
        collective(tensor)
        print("a collective after the abort returned without error", flush=True)
    except Exception as exc:  # what NCCL raises once aborted: DistBackendError
        print(
            f"raised {type(exc).__name__} {time.monotonic() - aborted_at[0]:.2f}s after the abort: {str(exc)[:120]}",
            flush=True,
        )
    started = time.monotonic()
    process_groups.destroy_all()
    print(f"groups destroyed in {time.monotonic() - started:.2f}s", flush=True)
    os.environ.update(WORLD_SIZE="1", MASTER_PORT=str(free_port()), NCCL_HOSTID="nccl-abort-0-again")
    started = time.monotonic()
    dist.init_process_group("nccl", device_id=device, rank=0, world_size=1)
    collective(torch.ones(4, device=device))
    print(f"a new group formed and reduced in process in {time.monotonic() - started:.2f}s", flush=True)
    dist.destroy_process_group()
    os._exit(0)


def main() -> int:
    if not torch.cuda.is_available():
        print("nccl_abort: needs a CUDA GPU", file=sys.stderr)
        return 2
    port = free_port()
    ranks = [mp.get_context("spawn").Process(target=rank_main, args=(rank, port)) for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(60)
        if process.is_alive():
            process.kill()
    return 0 if all(process.exitcode == 0 for process in ranks) else 1


if __name__ == "__main__":
    sys.exit(main())
