"""Checkpoint benchmark: training stall of async vs sync save, save throughput vs a raw write, reshard load time,
and snapshots in memory against disk (stall, and load).

    python bench/checkpoint_bench.py [--megabytes 200] [--rounds 5] [--directory /tmp]

Targets: async stall <= 10% of the sync save; save throughput >= 80% of a raw sequential write of the
same bytes (with fsync, same directory, same run); load at 8 ranks of a checkpoint saved at 4 ranks
<= 1.2x the load at 8 ranks of one saved at 8; at 4 ranks on 2 simulated nodes (a memory folder each, on
/dev/shm), loading from memory >= 10x faster than from disk (the page cache dropped before each disk load when
run as root), and a memory snapshot stalls training no longer than an async disk save (both in a run's steady
state: after the first saves, which allocate). Each measure is
interleaved with the one it is compared to, round after round, and the medians are compared, because the host
may be busy with other work.
Not a test: the figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import functools
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
from elastic.checkpoint.memory import KEEP
from elastic.node_memory import MEMORY_DIR_ENV, SHARED_MEMORY

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


def raw_write(path: Path, model: torch.nn.Module) -> float:
    """Sequential write of the same bytes to one new file with fsync, as dd conv=fsync would do."""
    started = time.perf_counter()
    with open(path, "wb") as stream:
        for tensor in model.state_dict().values():
            stream.write(tensor.detach().contiguous().view(torch.uint8).numpy().data)
        stream.flush()
        os.fsync(stream.fileno())
    return time.perf_counter() - started


def timed_save(manager: CheckpointManager, step: int, state: dict) -> tuple[float, float]:
    """Seconds training was blocked by ``save``, and seconds until the checkpoint was committed."""
    started = time.perf_counter()
    manager.save(step, state)
    stall = time.perf_counter() - started
    manager.wait()
    return stall, time.perf_counter() - started


def single_process_rounds(directory: Path, model: torch.nn.Module, rounds: int) -> dict[str, list[float]]:
    # Nothing is deleted until the end: retention is not part of a save, and on thin-provisioned disks
    # writing into just-freed blocks is much faster than into new ones, which would skew the comparison.
    managers = {
        mode: CheckpointManager(directory / mode, keep=rounds + 1, async_save=mode == "async", check_at_start=False)
        for mode in ("sync", "async")
    }
    state = {"model": ModelState(model)}
    times: dict[str, list[float]] = {"raw": [], "sync": [], "async stall": [], "async total": []}
    for step in range(1, rounds + 1):
        with torch.no_grad():
            next(model.parameters()).add_(1.0)  # a training step between saves
        times["raw"].append(raw_write(directory / f"raw-{step}.bin", model))
        times["sync"].append(timed_save(managers["sync"], step, state)[1])
        stall, total = timed_save(managers["async"], step, state)
        times["async stall"].append(stall)
        times["async total"].append(total)
    for manager in managers.values():
        manager.close()
    return times


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _timed_on_all_ranks(action) -> float:
    dist.barrier()
    started = time.perf_counter()
    action()
    dist.barrier()
    return time.perf_counter() - started


def _rank(rank: int, world_size: int, port: int, megabytes: int, work: str, rounds: int) -> None:
    """Save at ``world_size``; at 8 ranks, then load the 8-rank and the 4-rank checkpoint in turn."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = make_model(megabytes)
    size = state_bytes(model)
    fully_shard(model)
    state = {"model": ModelState(model)}
    save_manager = CheckpointManager(Path(work) / f"saved-at-{world_size}", async_save=False, check_at_start=False)
    save_manager.save(1, state)
    save_manager.close()
    if world_size == 4:
        memory_rounds(rank, Path(work), state, size, rounds)
    if world_size == 8:
        loads: dict[str, list[float]] = {"same": [], "reshard": []}
        for _ in range(rounds):
            for kind, saved_at in (("same", 8), ("reshard", 4)):
                manager = CheckpointManager(Path(work) / f"saved-at-{saved_at}", check_at_start=False)
                loads[kind].append(_timed_on_all_ranks(functools.partial(manager.load_latest, state)))
                manager.close()
        if rank == 0:
            (Path(work) / "loads.json").write_text(json.dumps(loads))
    dist.destroy_process_group()


def drop_page_cache() -> bool:
    """Evict cached file data, so a load from disk reads the disk (root only); whether it could."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3")
    except OSError:
        return False
    return True


def memory_root(work: Path) -> Path:
    """Where the simulated nodes keep their snapshots: in shared memory, as under elastic-run."""
    return SHARED_MEMORY / work.name


def read_seconds(paths: list[Path]) -> float:
    """Seconds to read every byte of ``paths`` into memory, in 4 MiB blocks."""
    block = bytearray(4 << 20)
    started = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as stream:
            while stream.readinto(block):
                pass
    return time.perf_counter() - started


def memory_copy_seconds(size: int) -> float:
    """Seconds to copy ``size`` bytes from memory to memory on every core, the fastest of 5: no load from memory,
    which puts every byte of the state into the model's tensors, can take less."""
    source = torch.ones(size, dtype=torch.uint8)
    target = torch.zeros(size, dtype=torch.uint8)  # both touched: no page faults in the copy
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        fastest = math.inf
        for _ in range(5):
            started = time.perf_counter()
            target.copy_(source)
            fastest = min(fastest, time.perf_counter() - started)
        return fastest
    finally:
        torch.set_num_threads(threads)


def memory_rounds(rank: int, work: Path, state: dict, size: int, rounds: int) -> None:
    """4 ranks as 2 nodes of 2: the stall of a memory snapshot against an async disk save's, then the load of
    the same state from memory (each node's own part, the other's from its copy) against the load from disk."""
    os.environ[MEMORY_DIR_ENV] = str(memory_root(work) / f"node{rank // 2}")
    directory = work / "memory-vs-disk"
    manager = CheckpointManager(directory, async_save=True, check_at_start=False, memory_every=1)
    times: dict[str, list[float]] = {
        "memory stall": [],
        "4-rank async stall": [],
        "memory load": [],
        "disk load": [],
        "memory copy": [],
        "disk read": [],
    }
    # Measured in a run's steady state, after KEEP rounds: the async stager has its buffers, and a snapshot writes
    # over the oldest one's files (the first saves of a run allocate, both kinds).
    for round_ in range(KEEP + rounds):
        disk_step, memory_step = 2 * round_ + 1, 2 * round_ + 2  # the newest is always in memory
        disk_stall = _timed_on_all_ranks(functools.partial(manager.save, disk_step, state))
        manager.wait()
        assert manager.should_save(memory_step)  # chooses memory: no disk schedule
        memory_stall = _timed_on_all_ranks(functools.partial(manager.save, memory_step, state))
        if round_ >= KEEP:
            times["4-rank async stall"].append(disk_stall)
            times["memory stall"].append(memory_stall)
    manager.close()
    cold = True
    for _ in range(rounds):
        for kind, memory_every in (("memory load", 1), ("disk load", 0)):
            loader = CheckpointManager(directory, check_at_start=False, memory_every=memory_every)
            if kind == "disk load" and rank == 0:
                cold = drop_page_cache() and cold
            times[kind].append(_timed_on_all_ranks(functools.partial(loader.load_latest, state)))
            loader.close()
    if rank == 0:  # what bounds the ratios: reading the disk checkpoint's bytes, and one copy of them in memory
        newest = max(directory.glob("step-*"), key=lambda folder: int(folder.name[5:]))
        for _ in range(rounds):
            times["memory copy"].append(memory_copy_seconds(size))
            cold = drop_page_cache() and cold
            times["disk read"].append(read_seconds(sorted(newest.glob("*.distcp"))))
        (work / "memory.json").write_text(json.dumps({**times, "disk cache dropped": cold}))


def on_ranks(world_size: int, megabytes: int, work: Path, rounds: int) -> None:
    args = (world_size, _free_port(), megabytes, str(work), rounds)
    mp.start_processes(_rank, args=args, nprocs=world_size, start_method="spawn")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=int, default=200, help="model state size in MiB (default 200)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved repetitions (default 5)")
    parser.add_argument("--directory", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ["OMP_NUM_THREADS"] = "1"
    work = Path(tempfile.mkdtemp(prefix="checkpoint-bench-", dir=args.directory))
    try:
        model = make_model(args.megabytes)
        size = state_bytes(model)
        times = single_process_rounds(work, model, args.rounds)
        del model
        on_ranks(4, args.megabytes, work, args.rounds)
        on_ranks(8, args.megabytes, work, args.rounds)
        times.update(json.loads((work / "loads.json").read_text()))
        memory = json.loads((work / "memory.json").read_text())
        cold = memory.pop("disk cache dropped")
        times.update(memory)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(memory_root(work), ignore_errors=True)

    median = {name: statistics.median(values) for name, values in times.items()}
    mib = size / 2**20
    print(f"\nmodel state {mib:.0f} MiB; medians of {args.rounds} interleaved rounds; directory {args.directory}\n")
    print(f"{'measure':<46}{'median s':>9}{'MiB/s':>8}   all rounds (s)")
    rows = [
        ("raw sequential write + fsync", "raw"),
        ("sync save until committed (= its stall)", "sync"),
        ("async save: training stall", "async stall"),
        ("async save: until committed", "async total"),
        ("load at 8 ranks, saved at 8", "same"),
        ("load at 8 ranks, saved at 4 (reshard)", "reshard"),
        ("4 ranks: async disk save, training stall", "4-rank async stall"),
        ("4 ranks: memory snapshot, training stall", "memory stall"),
        (f"4 ranks: load from disk ({'page cache dropped' if cold else 'page cache warm'})", "disk load"),
        ("4 ranks: load from memory (2 nodes)", "memory load"),
        (f"disk checkpoint's files, read ({'cache dropped' if cold else 'cache warm'})", "disk read"),
        ("one copy of the state in memory", "memory copy"),
    ]
    for label, name in rows:
        rounds = " ".join(f"{value:.3f}" for value in times[name])
        print(f"{label:<46}{median[name]:>9.3f}{mib / median[name]:>8.0f}   {rounds}")
    print()
    checks = [
        ("async stall / sync save", median["async stall"] / median["sync"], "<=", 0.10),
        ("save throughput / raw write", median["raw"] / median["sync"], ">=", 0.80),
        ("reshard load / same-size load", median["reshard"] / median["same"], "<=", 1.20),
        ("disk load / memory load", median["disk load"] / median["memory load"], ">=", 10.0),
        ("(bound: disk load / memory copy)", median["disk load"] / median["memory copy"], ">=", 10.0),
        ("memory stall / async disk stall", median["memory stall"] / median["4-rank async stall"], "<=", 1.0),
    ]
    for label, ratio, relation, target in checks:
        met = ratio <= target if relation == "<=" else ratio >= target
        print(f"{label:<32}{ratio:>7.2f}  target {relation} {target:.2f}  {'met' if met else 'MISSED'}")


if __name__ == "__main__":
    main()
