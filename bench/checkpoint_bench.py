"""Checkpoint benchmark: training stall of async vs sync save, save throughput vs a raw write, reshard load time.

    python bench/checkpoint_bench.py [--megabytes 200] [--directory /tmp]

Targets: async stall <= 10% of the sync save, save throughput >= 80% of a raw sequential write of the
same bytes (with fsync, in the same directory, in the same run), load after resharding 4 -> 8 ranks
<= 1.2x the load at the same world size. Not a test: figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard

from elastic.checkpoint import CheckpointManager, ModelState

REPEATS = 3
HIDDEN = 4096


def make_model(megabytes: int) -> torch.nn.Module:
    """fp32 Linear layers totalling at least ``megabytes`` MiB of parameters."""
    layers = math.ceil(megabytes * 2**20 / (4 * HIDDEN * HIDDEN))
    with torch.no_grad():
        model = torch.nn.Sequential(*(torch.nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(layers)))
        for parameter in model.parameters():
            parameter.normal_()
    return model


def state_bytes(model: torch.nn.Module) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in model.state_dict().values())


def timed_saves(directory: Path, model: torch.nn.Module, async_save: bool) -> tuple[list[float], list[float]]:
    """Per save: seconds training was blocked, and seconds until the checkpoint was committed."""
    # keep > REPEATS: deleting the previous checkpoint is retention, not part of the save being measured
    manager = CheckpointManager(directory, keep=REPEATS + 1, async_save=async_save, check_at_start=False)
    state = {"model": ModelState(model)}
    stalls, totals = [], []
    for step in range(1, REPEATS + 1):
        with torch.no_grad():
            next(model.parameters()).add_(1.0)  # a training step between saves
        started = time.perf_counter()
        manager.save(step, state)
        stalls.append(time.perf_counter() - started)
        manager.wait()
        totals.append(time.perf_counter() - started)
    manager.close()
    return stalls, totals


def raw_write_seconds(directory: Path, model: torch.nn.Module) -> float:
    """Sequential write of the same bytes to one file with fsync, as dd conv=fsync would do."""
    path = directory / "raw.bin"
    started = time.perf_counter()
    with open(path, "wb") as stream:
        for tensor in model.state_dict().values():
            stream.write(tensor.detach().contiguous().view(torch.uint8).numpy().data)
        stream.flush()
        os.fsync(stream.fileno())
    elapsed = time.perf_counter() - started
    path.unlink()
    return elapsed


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _rank(rank: int, world_size: int, port: int, megabytes: int, directory: str, action: str, report: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = make_model(megabytes)
    fully_shard(model)
    state = {"model": ModelState(model)}
    manager = CheckpointManager(directory, async_save=False, check_at_start=False)
    dist.barrier()
    started = time.perf_counter()
    if action == "save":
        manager.save(1, state)
    else:
        manager.load_latest(state)
    dist.barrier()
    elapsed = time.perf_counter() - started
    manager.close()
    if rank == 0:
        Path(report).write_text(json.dumps({"seconds": elapsed}))
    dist.destroy_process_group()


def on_ranks(world_size: int, megabytes: int, directory: Path, action: str) -> float:
    report = directory / f"{action}-{world_size}.json"
    args = (world_size, _free_port(), megabytes, str(directory), action, str(report))
    mp.start_processes(_rank, args=args, nprocs=world_size, start_method="spawn")
    return json.loads(report.read_text())["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=int, default=200, help="model state size in MiB (default 200)")
    parser.add_argument("--directory", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ["OMP_NUM_THREADS"] = "1"
    work = Path(tempfile.mkdtemp(prefix="checkpoint-bench-", dir=args.directory))
    try:
        model = make_model(args.megabytes)
        size = state_bytes(model)
        sync_stalls, sync_totals = timed_saves(work / "sync", model, async_save=False)
        async_stalls, async_totals = timed_saves(work / "async", model, async_save=True)
        raw = statistics.median(raw_write_seconds(work, model) for _ in range(REPEATS))
        del model
        on_ranks(4, args.megabytes, work / "sharded", "save")
        same_size_load = on_ranks(4, args.megabytes, work / "sharded", "load")
        reshard_load = on_ranks(8, args.megabytes, work / "sharded", "load")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    sync_save, steady_stall = statistics.median(sync_totals), statistics.median(async_stalls[1:])
    mib = size / 2**20
    print(f"\nmodel state {mib:.0f} MiB, median of {REPEATS} saves, directory {args.directory}\n")
    print(f"{'measure':<44}{'seconds':>9}{'MiB/s':>9}")
    rows = [
        ("sync save (stall = save + commit)", sync_save),
        ("async save stall, first (allocates staging)", async_stalls[0]),
        ("async save stall, steady", steady_stall),
        ("async save until committed", statistics.median(async_totals)),
        ("raw sequential write + fsync", raw),
        ("load at 4 ranks of a 4-rank checkpoint", same_size_load),
        ("load at 8 ranks of a 4-rank checkpoint", reshard_load),
    ]
    for name, seconds in rows:
        print(f"{name:<44}{seconds:>9.3f}{mib / seconds:>9.0f}")
    print()
    checks = [
        ("async stall / sync save", steady_stall / sync_save, "<= 0.10", steady_stall / sync_save <= 0.10),
        ("save throughput / raw write", raw / sync_save, ">= 0.80", raw / sync_save >= 0.80),
        ("reshard load / same-size load", reshard_load / same_size_load, "<= 1.20", reshard_load / same_size_load <= 1.20),
    ]
    for name, ratio, target, met in checks:
        print(f"{name:<32}{ratio:>7.2f}  target {target}  {'met' if met else 'MISSED'}")


if __name__ == "__main__":
    main()
