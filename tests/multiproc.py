"""Run a function on N gloo ranks in real processes, with a deadline, for the checkpoint tests.

Processes fork from a forkserver that imported torch once, so 16 ranks start in about a second on
two cores instead of paying a torch import each. Every process is killed on failure or timeout.
"""

from __future__ import annotations

import importlib.util
import io
import multiprocessing
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

_PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.fsdp", "elastic.checkpoint"]
if importlib.util.find_spec("torchtitan") is not None:  # its model imports take 5 s of CPU: paid once, not per rank
    _PRELOAD += ["torchtitan.models.llama3", "elastic.integrations.torchtitan"]
_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(_PRELOAD)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=60),
        )
        value = fn(rank, world_size, *args)
        dist.destroy_process_group()
        # As bytes: tensors put on the queue directly travel as shared-memory handles that die with this process.
        encoded = io.BytesIO()
        torch.save(value, encoded)
        results.put((rank, True, encoded.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


class Job:
    """N ranks running ``fn(rank, world_size, *args)``; ``join`` returns their results by rank."""

    def __init__(self, world_size: int, fn: Callable, *args: Any) -> None:
        self.world_size = world_size
        self._results = _context.Queue()
        port = _free_port()
        self.processes = [
            _context.Process(target=_rank_main, args=(rank, world_size, port, fn, args, self._results), daemon=True)
            for rank in range(world_size)
        ]
        for process in self.processes:
            process.start()

    def join(self, timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        values: dict[int, Any] = {}
        try:
            while len(values) < self.world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"ranks {sorted(set(range(self.world_size)) - set(values))} did not finish within {timeout}s"
                    )
                try:
                    rank, ok, value = self._results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [p.exitcode for p in self.processes if p.exitcode not in (None, 0)]
                    if dead:
                        raise RuntimeError(f"a rank died with exit code {dead[0]} before reporting") from None
                    continue
                if not ok:
                    raise RuntimeError(f"rank {rank} of {self.world_size} failed:\n{value}")
                values[rank] = torch.load(io.BytesIO(value), weights_only=False)
            for process in self.processes:
                process.join(timeout=max(deadline - time.monotonic(), 1.0))
            return [values[rank] for rank in range(self.world_size)]
        finally:
            self.kill()

    def kill(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join(timeout=10)


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = 90) -> list[Any]:
    return Job(world_size, fn, *args).join(timeout)
